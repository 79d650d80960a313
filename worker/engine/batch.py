"""The rows of a batch: one model's KV cache over them, with per-row valid columns.

Layout (DESIGN.md, shape 2; arXiv 2510.22876 discusses the pitfalls): every row shares
the cache's column index, but each row keeps its own mask of real columns. A forward
appends T columns to every row; a row's rejected draft columns stay in the cache,
masked out, and later columns take their position ids from the row's count of real
columns, so RoPE sees each row's true positions. `compact` squeezes the holes out now
and then; no per-step copying.
"""

from __future__ import annotations

import inspect
import secrets

import torch
from transformers import DynamicCache, PreTrainedModel


class KVRows:
    """A model's DynamicCache over the batch rows and the mask of real columns."""

    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model
        self.cache: DynamicCache | None = None
        self.mask: torch.Tensor | None = None  # [B, L] bool: column holds a real token
        params = inspect.signature(model.forward).parameters
        self._new_api = "cache" in params
        self._takes_cache_position = "cache_position" in params
        self._takes_logits_to_keep = "logits_to_keep" in params
        # compact() counts the waste (a sync) only from length _recheck_at on; it counted
        # it last at length _counted_at
        self._recheck_at = self._counted_at = 0

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def rows(self) -> int:
        return 0 if self.mask is None else self.mask.shape[0]

    @property
    def length(self) -> int:
        return 0 if self.mask is None else self.mask.shape[1]

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, valid: torch.Tensor,
                last_only: bool = False) -> torch.Tensor:
        """Append T columns per row and return their logits.

        input_ids: [B, T] int64; valid: [B, T] bool (False = padding, masked for good)
        returns logits [B, T, V], or [B, 1, V] for the last column when ``last_only``
        """
        B, T = input_ids.shape
        if self.cache is None:
            self.cache = DynamicCache()
            self.mask = torch.zeros(B, 0, dtype=torch.bool, device=self.device)
        L = self.length
        seen = self.mask.sum(1, keepdim=True)  # [B, 1] real tokens so far
        position_ids = (seen + valid.long().cumsum(1) - 1).clamp(min=0)  # [B, T]
        mask = torch.cat([self.mask, valid], dim=1)  # [B, L + T]
        kwargs = {"cache" if self._new_api else "past_key_values": self.cache}
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
        return out.logits[:, -1:] if last_only else out.logits

    def keep(self, start: int, keep_len: torch.Tensor) -> None:
        """Of the columns from ``start`` on, keep the first keep_len[b] real ones per row.

        keep_len: [B] int64
        """
        if start < self._counted_at:  # columns older than the last count: count again
            self._recheck_at = 0
        cols = torch.arange(self.length - start, device=self.device)[None, :]  # [1, T]
        self.mask[:, start:] &= cols < keep_len[:, None]

    def select(self, rows: torch.Tensor) -> None:
        """Keep only these rows, in this order. rows: [B'] int64"""
        self._recheck_at = 0
        if self.cache is None:
            return
        if rows.numel() == 0:
            self.cache, self.mask = None, None
            return
        for layer in self.cache.layers:
            layer.keys = layer.keys.index_select(0, rows)
            layer.values = layer.values.index_select(0, rows)
        self.mask = self.mask.index_select(0, rows)

    def extend(self, other: KVRows) -> None:
        """Append other's rows after ours; the shorter side is padded on the left."""
        self._recheck_at = 0
        if other.cache is None:
            return
        if self.cache is None:
            self.cache, self.mask = other.cache, other.mask
            return
        L = max(self.length, other.length)
        self._pad_left(L - self.length)
        other._pad_left(L - other.length)
        for mine, theirs in zip(self.cache.layers, other.cache.layers):
            mine.keys = torch.cat([mine.keys, theirs.keys])
            mine.values = torch.cat([mine.values, theirs.values])
        self.mask = torch.cat([self.mask, other.mask])

    def add_rows(self, n: int) -> None:
        """Append n rows with no real column yet (their tokens come later, by replace)."""
        self._recheck_at = 0
        for layer in self.cache.layers:
            B, H, L, D = layer.keys.shape
            layer.keys = torch.cat([layer.keys, layer.keys.new_zeros(n, H, L, D)])
            layer.values = torch.cat([layer.values, layer.values.new_zeros(n, H, L, D)])
        self.mask = torch.cat([self.mask, self.mask.new_zeros(n, self.length)])

    def replace(self, rows: torch.Tensor, other: KVRows) -> None:
        """Put other's rows in place of ``rows``, which hold no real column yet."""
        self._recheck_at = 0
        L = max(self.length, other.length)
        self._pad_left(L - self.length)
        other._pad_left(L - other.length)
        for mine, theirs in zip(self.cache.layers, other.cache.layers):
            mine.keys[rows] = theirs.keys
            mine.values[rows] = theirs.values
        self.mask[rows] = other.mask

    def _pad_left(self, n: int) -> None:
        if n <= 0:
            return
        for layer in self.cache.layers:
            B, H, _, D = layer.keys.shape
            pad = layer.keys.new_zeros(B, H, n, D)
            layer.keys = torch.cat([pad, layer.keys], dim=2)
            layer.values = torch.cat([pad, layer.values], dim=2)
        self.mask = torch.cat([self.mask.new_zeros(self.rows, n), self.mask], dim=1)

    def waste(self) -> int:
        """Columns that compaction would free."""
        return 0 if self.mask is None else self.length - int(self.mask.sum(1).max())

    def compact(self, force: bool = False) -> None:
        """Move each row's real columns to the right end, in order, and drop the rest.

        Unless forced, only once at least 64 columns and half the cache would be freed,
        so the copy happens now and then, not every step. Counting the waste reads the
        mask on the host, a sync with the device: while the rows stay the same, waste
        grows no faster than the length, so it is counted again only once the length
        has grown enough for it to reach the bar.
        """
        if self.mask is None or (not force and self.length < self._recheck_at):
            return
        waste, bar, self._counted_at = self.waste(), max(64, self.length // 2), self.length
        if waste == 0 or (not force and waste < bar):
            self._recheck_at = self.length + bar - waste
            return
        L = self.length
        keep = int(self.mask.sum(1).max())
        # a stable sort puts masked columns first and keeps real ones in order
        idx = self.mask.long().sort(dim=1, stable=True).indices[:, L - keep :]  # [B, keep]
        for layer in self.cache.layers:
            B, H, _, D = layer.keys.shape
            gather = idx[:, None, :, None].expand(B, H, keep, D)
            layer.keys = layer.keys.gather(2, gather)
            layer.values = layer.values.gather(2, gather)
        self.mask = self.mask.gather(1, idx)
        self._recheck_at = 0


class Row:
    """One request in flight: its tokens so far, its limits and its counters."""

    def __init__(self, request, prompt_ids: list[int], eos_ids: set[int], tokenizer) -> None:
        from specq.worker.engine.result import Result  # local: request imports nothing from here

        self.request = request
        self.tokens: list[int] = list(prompt_ids)  # prompt + generated
        self.prompt_len = len(prompt_ids)
        self.eos_ids = eos_ids
        self.tokenizer = tokenizer
        self.result = Result(id=request.id, prompt_tokens=len(prompt_ids))
        self.seed = request.seed if request.seed is not None else secrets.randbits(62)
        self._stop_window = max((len(s) for s in request.stop), default=0) + 8
        # a free drafter's proposal held while the engine does not draft, and how much of
        # it the emitted tokens matched so far (shadow.py)
        self.shadow: tuple[list[int], int] | None = None

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len :]

    @property
    def done(self) -> bool:
        return self.result.finish_reason is not None

    def emit(self, new_tokens: list[int]) -> int:
        """Append tokens until a stop condition; returns how many were kept."""
        for n, tok in enumerate(new_tokens, start=1):
            self.tokens.append(tok)
            if tok in self.eos_ids or self._hit_stop_string():
                self.result.finish_reason = "stop"
            elif len(self.tokens) - self.prompt_len >= self.request.max_new_tokens:
                self.result.finish_reason = "length"
            if self.done:
                return n
        return len(new_tokens)

    def _hit_stop_string(self) -> bool:
        if not self.request.stop:
            return False
        tail = self.tokenizer.decode(self.tokens[-self._stop_window :], skip_special_tokens=True)
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


def left_pad(seqs: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Ragged token lists -> ids [B, T] and valid [B, T], padded on the left."""
    T = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), T), pad_id, dtype=torch.long)
    valid = torch.zeros(len(seqs), T, dtype=torch.bool)
    for i, s in enumerate(seqs):
        if s:
            ids[i, T - len(s) :] = torch.tensor(s)
            valid[i, T - len(s) :] = True
    return ids.to(device), valid.to(device)
