"""The rows of a batch: one model's KV cache over them, with per-row valid columns.

Layout (DESIGN.md, shape 2; arXiv 2510.22876 discusses the pitfalls): every row shares
the cache's column index, but each row keeps its own mask of real columns, and later
columns take their position ids from the row's count of real columns, so RoPE sees each
row's true positions. Where a forward writes depends on the forward:

- the packed one (packed.py, the Llama family): each row's tokens go right after its own
  last real column. A row's rejected drafts are its last columns, masked out, and its
  next pass writes over them: no holes pile up, and the cache is as wide as its longest
  row (docs/benchmarks.md, "a row's own length");
- transformers' own (any other model): a forward appends T columns to every row, and a
  row's rejected draft columns stay in the cache as holes, masked out.

``compact`` squeezes the holes out now and then (a prefill's padding, the padded forward's
rejected columns); no per-step copying. ``marker`` says where the next forward's columns
go, and ``keep`` takes it back to drop the rejected ones.

The keys and values live in preallocated per-layer buffers [rows, heads, capacity, dim]
(gpt-fast's KVCache, grown by doubling): a forward writes its columns in place and the
attention reads a view of the filled ones, where transformers' DynamicCache concatenates
every layer's whole cache at every forward. A row's real columns may sit anywhere left
of the columns being written (keys carry their positions from RoPE, and the causal mask
only orders old columns before new ones), so rows join and leave without shifting
anyone's columns.
"""

from __future__ import annotations

import inspect
import secrets
import weakref
from typing import Any, cast

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import Cache, CacheLayerMixin

from specq.schema.generation import new_token_limit
from specq.worker.engine import packed as packing
from specq.worker.engine.logits import Logits

MIN_COLUMNS = 64  # a fresh buffer's columns; it doubles from there
# Compact once the holes (masked columns every pass still attends over) reach a share of the
# cache: holes cost every pass, a compaction once (docs/benchmarks.md#2026-12-02-compaction-bar).
WASTE_SHARE, MIN_WASTE = 1 / 6, 16  # the target's bar: its waste is read free with the step's sync
LAZY_SHARE, LAZY_MIN = 1 / 2, 64  # the bar of a cache that must sync to count (a draft model's)


def _capacity(need: int, have: int) -> int:
    """Columns to allocate for ``need``: at least double what there was (amortised)."""
    return max(need, 2 * have, MIN_COLUMNS)


class BufferLayer(CacheLayerMixin):
    """One layer's keys and values, written in place into buffers that grow by doubling.

    ``keys`` and ``values`` are the whole buffers [rows, heads, capacity, dim]; ``length``
    columns of the first ``rows`` rows are in use. ``update`` writes the new columns at
    ``length`` and returns views of the used part.
    """

    is_sliding = False
    keys: torch.Tensor  # set by lazy_initialization, before any use
    values: torch.Tensor

    def __init__(self, **kwargs) -> None:
        super().__init__()
        self.rows = self.length = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        B, H, T, D = key_states.shape
        self.keys = key_states.new_zeros(B, H, _capacity(T, 0), D)
        self.values = value_states.new_zeros(B, H, _capacity(T, 0), value_states.shape[-1])
        self.device = key_states.device
        self.rows, self.is_initialized = B, True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args,
               **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        B, L, T = self.rows, self.length, key_states.shape[2]
        self.reserve(B, L + T)
        self.keys[:B, :, L : L + T] = key_states
        self.values[:B, :, L : L + T] = value_states
        self.length = L + T
        return self.keys[:B, :, : L + T], self.values[:B, :, : L + T]

    def reserve(self, rows: int, columns: int) -> None:
        """Make room for ``rows`` rows and ``columns`` columns, keeping what is used."""
        R, H, C, D = self.keys.shape
        if rows <= R and columns <= C:
            return
        R, C = max(rows, R), (C if columns <= C else _capacity(columns, C))
        for name in ("keys", "values"):
            old = getattr(self, name)
            new = old.new_zeros(R, H, C, old.shape[-1])  # zeros: masked columns stay finite
            new[: self.rows, :, : self.length] = old[: self.rows, :, : self.length]
            setattr(self, name, new)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1


class BufferCache(Cache):
    """A model's BufferLayers, one per layer, made as the forward reaches them."""

    def __init__(self) -> None:
        super().__init__(layer_class_to_replicate=BufferLayer)

    @property
    def buffers(self) -> list[BufferLayer]:
        """The layers, each a BufferLayer (the only kind this cache makes)."""
        return cast(list[BufferLayer], self.layers)

    def write(self, layer: int, place: tuple[torch.Tensor, torch.Tensor], keys: torch.Tensor,
              values: torch.Tensor, rows: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Write keys and values [N, heads, dim] at their rows and columns (``place``: [N]
        each) of ``layer``, now ``rows`` x ``length`` columns in use; returns views of the
        used part [rows, heads, length, dim] (the packed forward's update: packed.py)."""
        while len(self.layers) <= layer:
            self.layers.append(BufferLayer())
        buf = self.buffers[layer]
        if not buf.is_initialized:
            buf.lazy_initialization(keys.new_empty(rows, keys.shape[1], length, keys.shape[2]),
                                    values.new_empty(rows, values.shape[1], length,
                                                     values.shape[2]))
        buf.reserve(rows, length)
        buf.rows, buf.length = rows, length
        buf.keys[place[0], :, place[1]] = keys
        buf.values[place[0], :, place[1]] = values
        return buf.keys[:rows, :, :length], buf.values[:rows, :, :length]


class KVRows:
    """A model's cache over the batch rows and the mask of real columns.

    ``packed`` is True when a forward costs the tokens the rows carry (packed.py: a Llama
    family model), False when it costs the padded block (transformers' own forward, for
    every other model or when SPECQ_PACKED_FORWARD=0). ``packed=False`` asks for the
    padded forward; ``packed=True`` insists on the packed one (an error if the model has
    none).
    """

    def __init__(self, model: PreTrainedModel, packed: bool | None = None) -> None:
        self.model = model
        self._packed = _packed_forward(model, packed)
        self.cache: BufferCache | None = None
        self.mask: torch.Tensor | None = None  # [B, L] bool: column holds a real token
        self._new_api, self._takes_cache_position, self._takes_logits_to_keep = (
            _forward_takes(type(model)))
        self.device = model.device  # a KVRows lives within one step or one generation
        # compact() counts the waste (a sync) only from length _recheck_at on; it counted
        # it last at length _counted_at
        self._recheck_at = self._counted_at = 0

    @classmethod
    @torch.inference_mode()
    def from_prefix(cls, model: PreTrainedModel, layers: list[tuple[torch.Tensor, torch.Tensor]],
                    lengths: list[int], packed: bool | None = None) -> KVRows:
        """Rows whose first columns hold the first lengths[b] columns of one sequence's
        keys and values (``layers``: per layer, keys and values [1, heads, >= P, dim]):
        a shared prompt prefix computed once, copied into each row."""
        kv, P = cls(model, packed), max(lengths)
        kv.cache = BufferCache()
        for keys, values in layers:
            layer = BufferLayer()
            layer.lazy_initialization(keys[:, :, :P].expand(len(lengths), -1, -1, -1),
                                      values[:, :, :P].expand(len(lengths), -1, -1, -1))
            layer.keys[:, :, :P] = keys[:, :, :P]
            layer.values[:, :, :P] = values[:, :, :P]
            layer.length = P
            kv.cache.buffers.append(layer)
        cols = torch.arange(P, device=kv.device)[None]  # [1, P]
        kv.mask = cols < torch.tensor(lengths, device=kv.device)[:, None]  # [B, P]
        return kv

    @torch.inference_mode()
    def columns(self, row: int, start: int, stop: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """A copy of one row's keys and values in columns start..stop-1, per layer
        [1, heads, stop - start, dim] (what ``from_prefix`` takes)."""
        assert self.cache is not None, "no columns before a forward"
        return [(layer.keys[row : row + 1, :, start:stop].clone(),
                 layer.values[row : row + 1, :, start:stop].clone())
                for layer in self.cache.buffers]

    @torch.inference_mode()
    def real_columns(self, row: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """A copy of one row's real columns, in order, per layer [1, heads, n, dim] (what
        ``from_prefix`` takes): its prompt's keys and values after a prefill, wherever the
        forward put them."""
        assert self.cache is not None and self.mask is not None, "no columns before a forward"
        idx = self.mask[row].nonzero()[:, 0]
        return [(layer.keys[row : row + 1, :, : layer.length].index_select(2, idx),
                 layer.values[row : row + 1, :, : layer.length].index_select(2, idx))
                for layer in self.cache.buffers]

    @property
    def packed(self) -> bool:
        """True when a forward's cost follows the valid tokens, not the padded block."""
        return self._packed is not None

    @property
    def rows(self) -> int:
        return 0 if self.mask is None else self.mask.shape[0]

    @property
    def length(self) -> int:
        return 0 if self.mask is None else self.mask.shape[1]

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, valid: torch.Tensor,
                last_only: bool = False, first: list[int] | None = None) -> torch.Tensor:
        """Append T columns per row and return their logits.

        input_ids: [B, T] int64; valid: [B, T] bool (False = padding, masked for good)
        returns logits [B, T, V], or [B, 1, V] for the last column when ``last_only``; a
        padding position's logits are finite and mean nothing (zeros when ``packed``).
        ``first`` (the packed forward only): per row, the first position whose logits are
        wanted; returns [B, T - max(first), V], row b's from first[b] on (a row that
        joins the pass with its prompt wants only its last position's: packed.py).
        """
        return self.logits(input_ids, valid, last_only=last_only, first=first).padded()

    def logits(self, input_ids: torch.Tensor, valid: torch.Tensor,
               last_only: bool = False, first: list[int] | None = None) -> Logits:
        """``forward``, its logits as the pass computed them: the packed forward's only at
        the valid positions (logits.py), transformers' over the whole block."""
        B, T = input_ids.shape
        if self.cache is None:
            self.cache = BufferCache()
            self.mask = torch.zeros(B, 0, dtype=torch.bool, device=self.device)
        assert self.mask is not None  # set with the cache
        if self._packed is not None:  # each row's tokens right after its last real column
            ends = self.marker()
            assert isinstance(ends, torch.Tensor)  # a packed cache's marker is per row
            logits, self.mask = self._packed(self.cache, self.mask, ends, input_ids, valid,
                                             last_only, first)
            return logits
        if first is not None:
            raise ValueError("first: only the packed forward returns logits from a position")
        L = self.length
        seen = self.mask.sum(1, keepdim=True)  # [B, 1] real tokens so far
        position_ids = (seen + valid.long().cumsum(1) - 1).clamp(min=0)  # [B, T]
        mask = torch.cat([self.mask, valid], dim=1)  # [B, L + T]
        kwargs: dict[str, Any] = {"cache" if self._new_api else "past_key_values": self.cache}
        if self._takes_cache_position:  # transformers 4.x; 5.x derives it from the cache
            kwargs["cache_position"] = torch.arange(L, L + T, device=self.device)
        if last_only and self._takes_logits_to_keep:
            kwargs["logits_to_keep"] = 1
        out = self.model(
            input_ids=input_ids,
            attention_mask=mask.long(),
            position_ids=position_ids,
            use_cache=True,
            **kwargs,
        )
        self.mask = mask
        return Logits.block(out.logits[:, -1:] if last_only else out.logits)

    def marker(self) -> int | torch.Tensor:
        """Where the next forward's columns go: the cache's end (transformers' forward:
        every row's columns there), or each row's own next column [B] (the packed forward:
        right after the row's last real column). What ``keep`` takes."""
        if self._packed is None or self.mask is None:
            return self.length
        cols = torch.arange(1, self.length + 1, device=self.device)
        return (self.mask * cols).amax(1) if self.length else self.mask.new_zeros(
            self.rows, dtype=torch.long)

    def keep(self, start: int | torch.Tensor, keep_len: torch.Tensor) -> None:
        """Of each row's columns from ``start`` (a ``marker`` taken before the forwards
        that wrote them) on, keep the first keep_len[b].

        keep_len: [B] int64
        """
        assert self.mask is not None, "nothing to keep before a forward"
        if isinstance(start, int) and start < self._counted_at:  # columns older than the
            self._recheck_at = 0  # last count: count again
        # a packed cache's rows drop their own last columns (the next forward writes over
        # them): its waste does not grow and the lazy count stands
        first = start[:, None] if isinstance(start, torch.Tensor) else start
        cols = torch.arange(self.length, device=self.device)[None, :] - first  # [B, L]
        self.mask &= cols < keep_len[:, None]

    @torch.inference_mode()
    def select(self, rows: torch.Tensor | list[int]) -> None:
        """Keep only these rows, in this order. rows: [B'] int64 on the host

        Only the rows that change place are copied, within the buffers: a caller that
        fills the holes with rows from the end (``fill_holes``) moves few.
        """
        self._recheck_at = 0
        if self.cache is None:
            return
        assert self.mask is not None  # set with the cache
        rows = torch.as_tensor(rows, dtype=torch.long).cpu()
        self.mask = self.mask.index_select(0, upload(rows, self.device))
        if rows.numel() == 0:
            self.mask = self.mask[:, :0]
        moved = (rows != torch.arange(rows.numel())).nonzero()[:, 0]
        src, dst = rows[moved].to(self.device), moved.to(self.device)
        for layer in self.cache.buffers:
            if moved.numel():
                for buf in (layer.keys, layer.values):
                    used = buf[:, :, : layer.length]
                    used.index_copy_(0, dst, used.index_select(0, src))
            layer.rows, layer.length = self.rows, self.length

    @torch.inference_mode()
    def extend(self, other: KVRows) -> None:
        """Append other's rows after ours."""
        self._recheck_at = 0
        if other.cache is None:
            return
        if self.cache is None:  # nothing to copy into: take other's buffers as they are
            self.cache, self.mask = other.cache, other.mask
            return
        B = self.rows
        self.add_rows(other.rows)
        self.replace(torch.arange(B, B + other.rows), other)

    @torch.inference_mode()
    def add_rows(self, n: int) -> None:
        """Append n rows with no real column yet (their tokens come later, by replace)."""
        self._recheck_at = 0
        assert self.cache is not None and self.mask is not None, "rows go after a forward"
        self.mask = torch.cat([self.mask, self.mask.new_zeros(n, self.length)])
        for layer in self.cache.buffers:
            layer.reserve(self.rows, self.length)
            layer.rows = self.rows

    @torch.inference_mode()
    def replace(self, rows: torch.Tensor, other: KVRows) -> None:
        """Put other's rows in place of ``rows``, which hold no real column yet.

        Other's columns land at the left of ours (any place left of the next forward's
        columns is right: see the module docstring); only other's used part is copied.
        """
        self._recheck_at = 0
        assert self.cache is not None and self.mask is not None, "rows go after a forward"
        assert other.cache is not None and other.mask is not None, "nothing to put in place"
        L, Lo = max(self.length, other.length), other.length
        rows = torch.as_tensor(rows, dtype=torch.long).to(self.device)
        if L > self.length:
            self.mask = torch.cat([self.mask, self.mask.new_zeros(self.rows, L - self.length)], 1)
        self.mask[rows] = torch.cat([other.mask, other.mask.new_zeros(other.rows, L - Lo)], 1)
        for mine, theirs in zip(self.cache.buffers, other.cache.buffers):
            mine.reserve(self.rows, L)
            for buf, new in ((mine.keys, theirs.keys), (mine.values, theirs.values)):
                buf[:, :, :Lo].index_copy_(0, rows, new[: other.rows, :, :Lo])
            mine.rows, mine.length = self.rows, L

    def waste(self) -> int:
        """Columns that compaction would free."""
        return 0 if self.mask is None else self.length - int(self.mask.sum(1).max())

    def waste_on_device(self) -> torch.Tensor:
        """The waste as a 0-d tensor on the device, to be read with a sync already due."""
        assert self.mask is not None, "no waste before a forward"
        return self.length - self.mask.sum(1).max()

    @torch.inference_mode()
    def compact(self, force: bool = False, waste: int | None = None) -> None:
        """Move each row's real columns to the left end, in order, and drop the rest.

        With ``waste`` (read free, with a sync that was due anyway: ``waste_on_device``),
        once it reaches MIN_WASTE columns and WASTE_SHARE of the cache. Without it, counting
        reads the mask on the host, a sync of its own: then only once LAZY_MIN columns and
        LAZY_SHARE of the cache would be freed, counted again only once the length has grown
        enough for the waste to reach that bar (while the rows stay the same, waste grows no
        faster than the length). Either way the copy happens now and then, not every step;
        it gathers within the buffers.
        """
        if self.mask is None:
            return
        if waste is not None:
            if waste and (force or waste >= max(MIN_WASTE, int(self.length * WASTE_SHARE))):
                self._gather(waste)
            return
        if not force and self.length < self._recheck_at:
            return
        waste, self._counted_at = self.waste(), self.length
        bar = max(LAZY_MIN, int(self.length * LAZY_SHARE))
        if waste == 0 or (not force and waste < bar):
            self._recheck_at = self.length + bar - waste
            return
        self._gather(waste)

    def _gather(self, waste: int) -> None:
        """Compaction proper: each row's real columns to the left, ``waste`` columns fewer."""
        assert self.mask is not None
        keep = self.length - waste
        # a stable sort puts real columns first and keeps them in order
        idx = self.mask.long().sort(dim=1, descending=True, stable=True).indices[:, :keep]
        assert self.cache is not None  # set with the mask
        for layer in self.cache.buffers:
            B, L = layer.rows, layer.length
            for buf in (layer.keys, layer.values):
                _, H, _, D = buf.shape
                gather = idx[:, None, :, None].expand(B, H, keep, D)  # [B, H, keep, D]
                buf[:B, :, :keep] = buf[:B, :, :L].gather(2, gather)
            layer.length = keep
        self.mask = self.mask.gather(1, idx)
        self._recheck_at = 0


# A model's packed forward, made once: an admission makes several KVRows, and the checks
# and wiring cost more than a tiny model's prefill (docs/benchmarks.md#2026-12-04-the-admission)
_PACKED: weakref.WeakKeyDictionary[PreTrainedModel, tuple[bool, packing.PackedForward | None]]
_PACKED = weakref.WeakKeyDictionary()


def _packed_forward(model: PreTrainedModel,
                    packed: bool | None) -> packing.PackedForward | None:
    """The model's packed forward if it is wanted and the model has one (see KVRows)."""
    if packed is False or (packed is None and not packing.enabled()):
        return None
    training, forward = _PACKED.get(model, (None, None))
    if training is not model.training:  # refusal() reads the mode: checked again on a change
        forward = None if packing.refusal(model) is not None else packing.PackedForward(model)
        _PACKED[model] = (model.training, forward)
    if forward is None and packed:
        return packing.PackedForward(model)  # packed=True on a refused model: its error
    return forward


_TAKES: dict[type, tuple[bool, bool, bool]] = {}  # model class -> _forward_takes


def _forward_takes(model_class: type[PreTrainedModel]) -> tuple[bool, bool, bool]:
    """Whether the class's forward takes ``cache`` (transformers 5's name; else
    ``past_key_values``), ``cache_position`` and ``logits_to_keep``; read once a class."""
    if model_class not in _TAKES:
        params = inspect.signature(model_class.forward).parameters
        _TAKES[model_class] = ("cache" in params, "cache_position" in params,
                               "logits_to_keep" in params)
    return _TAKES[model_class]


def fill_holes(done: list[bool]) -> list[int]:
    """The rows to keep when rows ``done`` leave, in an order that moves few of them:
    each leaving row's place goes to a kept row from the end of the batch."""
    keep = [b for b, d in enumerate(done) if not d]
    tail = [b for b in keep if b >= len(keep)]  # kept rows past the new end: they move
    return [b if b < len(keep) and not done[b] else tail.pop() for b in range(len(keep))]


class Row:
    """One request in flight: its tokens so far, its limits and its counters."""

    def __init__(self, request, prompt_ids: list[int], eos_ids: set[int], tokenizer,
                 context: int | None = None) -> None:
        from specq.worker.engine.result import Result  # local: request imports nothing from here

        self.request = request
        self.tokens: list[int] = list(prompt_ids)  # prompt + generated
        self.prompt_len = len(prompt_ids)
        # new tokens at most: max_new_tokens, or (None) what the model's context leaves
        self.limit = new_token_limit(request, self.prompt_len, context)
        self.eos_ids = eos_ids
        self.tokenizer = tokenizer
        self.result = Result(id=request.id, prompt_tokens=len(prompt_ids))
        self.seed = request.seed if request.seed is not None else secrets.randbits(62)
        # a stop string of n bytes ends within the last n tokens (a token decodes to a
        # byte or more), and a few before them make its first character whole
        self._stop_window = max((len(s.encode()) for s in request.stop), default=0) + 8
        # a free drafter's proposal held while the engine does not draft, and how much of
        # it the emitted tokens matched so far (shadow.py)
        self.shadow: tuple[list[int], int] | None = None
        self.matcher = None  # the grammar state of a row with a response_format (grammar.py)
        # prompt tokens not in the target's cache yet: a row that joins a running pass
        # carries them in it, its prompt's last token the last of them (speculative.py)
        self.unseen: list[int] = []

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len :]

    @property
    def ended(self) -> bool:
        """It stopped generating (EOS, a stop string, max_new_tokens) or failed (``fail``)."""
        return self.result.finish_reason is not None or self.result.error is not None

    def fail(self, error: str) -> None:
        """End the row alone with an error (its batch-mates go on): no finish_reason, and
        no token after it."""
        self.result.error = error
        self.result.finish_reason = None

    def emit(self, new_tokens: list[int]) -> int:
        """Append tokens until a stop condition; returns how many were kept (none once the
        row failed: its grammar refused the step's tokens)."""
        if self.result.error is not None:
            return 0
        for n, tok in enumerate(new_tokens, start=1):
            self.tokens.append(tok)
            if tok in self.eos_ids or self._hit_stop_string():
                self.result.finish_reason = "stop"
            elif len(self.tokens) - self.prompt_len >= self.limit:
                self.result.finish_reason = "length"
            if self.ended:
                return n
        return len(new_tokens)

    def _hit_stop_string(self) -> bool:
        """A stop string in the end of the generated text; never in the prompt's (a chat
        template ending in "assistant\\n" holds the stop "\\n"), as OpenAI's and vLLM's."""
        if not self.request.stop:
            return False
        start = max(self.prompt_len, len(self.tokens) - self._stop_window)
        tail = self.tokenizer.decode(self.tokens[start:], skip_special_tokens=True)
        return any(s in tail for s in self.request.stop)

    def finish(self):
        """Fill in the result's token ids and text (cut before a stop string)."""
        res = self.result
        res.token_ids = self.generated
        text = self.tokenizer.decode(res.token_ids, skip_special_tokens=True)
        cuts = [text.find(s) for s in self.request.stop if s in text]
        res.text = text[: min(cuts)] if cuts else text
        res.counters.new_tokens = len(res.token_ids)
        return res


def upload(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``t`` on ``device``. A host tensor bound for CUDA goes through pinned memory,
    asynchronously: a copy from pageable memory makes the host wait for every kernel queued
    before it, a sync in the middle of the step (DESIGN.md: at most one per step)."""
    device = torch.device(device)
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def left_pad(seqs: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Ragged token lists -> ids [B, T] and valid [B, T], padded on the left (built from
    lists in one call each: a copy per row cost more than the prefill of a short prompt)."""
    T = max(len(s) for s in seqs)
    ids = torch.tensor([[pad_id] * (T - len(s)) + list(s) for s in seqs], dtype=torch.long)
    lengths = torch.tensor([len(s) for s in seqs], dtype=torch.long)
    valid = torch.arange(T) >= (T - lengths)[:, None]
    return upload(ids, device), upload(valid, device)
