"""A packed forward for the Llama family: the dense work runs on the tokens rows carry.

KVRows.forward takes a padded block [B, T] (a verify step pads every row to the longest
draft). transformers' forward pays for all B * T positions. Here the embeddings, the
q/k/v/o projections, the MLP, the norms and the head run on the N valid tokens only,
flattened to [N, hidden], so a row that carries no draft costs one token. Attention runs
per row over the row's own cache columns, its mask of real columns and the causal order of
the new ones ([B, heads, T, L]); on a CPU, where it costs what it computes, a pass with
a few wide rows computes the narrow width for every row in one call and the wide rows' other
queries in a call each (``split``), each call's queries gathered from the packed tokens: a
lone row of 9 tokens no longer makes all 16 rows' attention 9 tokens wide (docs/benchmarks.md,
"ragged attention").

The weights, the RoPE module (with the model's rope scaling), the norms and the MLP are the
loaded transformers model's own modules; only the wiring between them is ours. Each row's
new keys and values go into the BufferLayers right after the row's last real column, not at
the cache's end as transformers' forward writes them: a row keeps no holes where its rejected
drafts were (the next pass writes over them), and the cache is as wide as its longest row,
not as the sum of every pass's widest row (docs/benchmarks.md, "a row's own length").

On a CPU the linear layers (the projections, the MLP, the head) run as oneDNN's linear over
a copy of each weight reordered once for it (``prepacked``; q, k and v as one layer:
``fused``), the way torch.compile's CPU freezing runs them: at 4-16 tokens a pass
PyTorch's default path took 2-5x longer per layer, the head 6 ms for one token
(docs/benchmarks.md, "linear layers prepacked on a CPU"). The copy costs the weights' memory
once more. SPECQ_PACKED_LINEAR=0 keeps every layer's own call.

``refusal`` says why a model cannot take this path (another architecture, a sliding
window, query/key norms, ...): such a model keeps transformers' forward, which is also the
reference the tests hold this one to. SPECQ_PACKED_FORWARD=0 forces that fallback for
every model (for comparison).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel

from specq.worker.engine.logits import Logits

log = logging.getLogger(__name__)

ENV = "SPECQ_PACKED_FORWARD"  # "0", "false", "off" or "no": transformers' forward always
LINEAR_ENV = "SPECQ_PACKED_LINEAR"  # "0", ...: each linear layer's own call (no prepacking)
OFF = ("0", "false", "off", "no")
# A prepacked call takes this many rows at least (fewer: the first repeated). From 1,536
# inputs oneDNN's one-row kernel adds in another order than its batch kernel, so a row alone
# would not get the bits it gets in a batch; and a SmolLM2 pass at batch 1 took 10-13 % longer
# at two rows a call than at one or three (a probe; docs/benchmarks.md, "a row alone as in a
# batch")
FEWEST_ROWS = 3
PROBE_TOLERANCE = 1e-3  # a prepacked layer's output beside the module's on a probe, relative
# An attention call on a CPU, priced in query x key columns (about 0.024 us each on 2 cores,
# three query heads a key head): a row in a call reads its keys and values once, as many as
# ROW_QUERIES queries would, and a call of its own (the SDPA call, the gathers of its queries
# and outputs from and to the packed tokens) costs CALL_COLUMNS, fitted to whole passes of 16
# rows x 200 columns: the split the planner picks was the faster in 9 shapes of 9
# (docs/benchmarks.md, "ragged attention"; "a split pass's queries gathered")
ROW_QUERIES = 3.5
CALL_COLUMNS = 600
FAMILIES = ("llama", "qwen2")  # model_type values whose layers have the shape below
LAYER_PARTS = ("input_layernorm", "post_attention_layernorm", "mlp", "self_attn")
ATTENTION_PARTS = ("q_proj", "k_proj", "v_proj", "o_proj")


class Columns(Protocol):
    """Where a pass's keys and values go (batch.BufferCache)."""

    def write(self, layer: int, place: tuple[torch.Tensor, torch.Tensor], keys: torch.Tensor,
              values: torch.Tensor, rows: int,
              length: int) -> tuple[torch.Tensor, torch.Tensor]: ...


def enabled() -> bool:
    """False when the environment turns the packed forward off for every model."""
    return os.environ.get(ENV, "1").strip().lower() not in OFF


def refusal(model: PreTrainedModel) -> str | None:
    """Why ``model`` cannot run packed, or None when it can.

    Checked, not assumed: the model type, the modules the forward below calls, and the
    config features it does not implement (sliding windows, norms on q and k, extra
    attention inputs).
    """
    cfg = model.config
    if cfg.model_type not in FAMILIES:
        return f"model type {cfg.model_type!r} is not one of {FAMILIES}"
    if model.training:
        return "the model is in training mode (dropout)"
    base = getattr(model, "model", None)
    parts = ("embed_tokens", "layers", "norm", "rotary_emb")
    if base is None or not all(hasattr(base, p) for p in parts) or not hasattr(model, "lm_head"):
        return "the model lacks the Llama layout (model.embed_tokens, layers, norm, lm_head)"
    if getattr(cfg, "sliding_window", None) is not None or getattr(cfg, "use_sliding_window",
                                                                   False):
        return "sliding-window attention"
    if any(t != "full_attention" for t in getattr(cfg, "layer_types", None) or []):
        return "a layer type other than full attention"
    for layer in base.layers[: cfg.num_hidden_layers]:
        attn = getattr(layer, "self_attn", None)
        if not all(hasattr(layer, p) for p in LAYER_PARTS) or attn is None:
            return "a decoder layer without the Llama parts"
        if not all(isinstance(getattr(attn, p, None), nn.Linear) for p in ATTENTION_PARTS):
            return "attention projections that are not plain linear layers"
        if not (hasattr(attn, "head_dim") and hasattr(attn, "scaling")):
            return "attention without head_dim and scaling"
        if hasattr(attn, "q_norm") or hasattr(attn, "k_norm"):
            return "norms on queries and keys"
        if getattr(attn, "sliding_window", None) is not None:
            return "sliding-window attention"
        if (attn.q_proj.out_features != cfg.num_attention_heads * attn.head_dim
                or attn.k_proj.out_features != cfg.num_key_value_heads * attn.head_dim
                or cfg.num_attention_heads % cfg.num_key_value_heads):
            return "head counts that do not match the config"
    return None


Linear = Callable[[torch.Tensor], torch.Tensor]


def prepacking() -> bool:
    """Whether linear layers on a CPU may run prepacked: oneDNN is in this build of torch
    and the environment does not turn it off (LINEAR_ENV)."""
    return (os.environ.get(LINEAR_ENV, "1").strip().lower() not in OFF
            and torch.backends.mkldnn.is_available())


def prepacked(module: nn.Linear) -> Linear:
    """``module`` as the packed forward calls it: on a CPU (float32 or bfloat16 weights, and
    oneDNN in this build of torch), oneDNN's linear over a copy of the weight reordered
    once into the layout its kernels read (torch.ops.mkldnn, as torch.compile's CPU freezing
    uses it); elsewhere, or where the library refuses the weight or disagrees with the
    module on a probe, the module itself."""
    layer = _packed(module)
    return module if layer is None else (lambda x: layer(x)[0])


def fused(*modules: nn.Linear) -> Callable[[torch.Tensor], tuple[torch.Tensor, ...]]:
    """Linear layers that read the same input (q, k and v) as one prepacked layer over
    their weights stacked, its output split back: one call where there were several (at 16
    tokens 80 -> 56 us for a SmolLM2 layer's q, k and v). Each module's own call where they
    cannot run prepacked."""
    layer = _packed(*modules)
    return (lambda x: tuple(m(x) for m in modules)) if layer is None else layer


def _packed(*modules: nn.Linear) -> _Prepacked | None:
    """The modules as one prepacked layer, or None where they cannot run prepacked."""
    if not prepacking():
        return None
    layer = _Prepacked(*modules)
    return layer if layer.packed is not None else None


class _Prepacked:
    """Linear layers run by oneDNN as one, over their weights stacked and reordered once
    (``prepacked``, ``fused``); a call returns each layer's output. A weight or bias that
    changes (replaced, written in place, moved to another dtype or device: ``_state``) is
    copied, reordered and probed again; where that fails, the modules' own calls."""

    def __init__(self, *modules: nn.Linear) -> None:
        self.modules = modules
        self.sizes = [m.out_features for m in modules]
        self._pack()

    def _pack(self) -> None:
        self.params = _params(self.modules)
        self.states = [_state(t) for t in self.params]
        weights = [m.weight for m in self.modules]
        self.packed: torch.Tensor | None = None
        first = weights[0]
        if (first.device.type != "cpu" or first.dtype not in (torch.float32, torch.bfloat16)
                or any(w.dtype != first.dtype or w.device != first.device for w in weights)):
            return
        biases = [m.bias for m in self.modules]
        self.bias = None if all(b is None for b in biases) else torch.cat([
            b.detach() if b is not None else first.new_zeros(n)
            for b, n in zip(biases, self.sizes)])
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(
                torch.cat([w.detach() for w in weights]) if len(weights) > 1
                else first.detach(), None)
            probe = torch.randn(3, self.modules[0].in_features,
                                generator=torch.Generator().manual_seed(0)).to(first.dtype)
            with torch.inference_mode():
                want = torch.cat([m(probe) for m in self.modules], -1)
                got = torch.ops.mkldnn._linear_pointwise(probe, packed, self.bias, "none",
                                                         [], "")
        except (RuntimeError, AttributeError) as exc:  # an op missing, a dtype refused
            log.info("linear layers %s %s kept as they are: %s", self.sizes, first.dtype, exc)
            return
        scale = want.abs().max().item() or 1.0
        if got.shape != want.shape or (got - want).abs().max().item() > PROBE_TOLERANCE * scale:
            log.warning("linear layers %s %s kept as they are: oneDNN's output differs from "
                        "the modules' on a probe", self.sizes, first.dtype)
            return
        self.packed = packed

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if any(t is not u or _state(t) != s
               for t, u, s in zip(_params(self.modules), self.params, self.states)):
            self._pack()
        if self.packed is None:
            return tuple(m(x) for m in self.modules)
        n = x.numel() // x.shape[-1]
        few = 0 < n < FEWEST_ROWS  # then the first row repeated, its outputs dropped
        rows = x.reshape(n, -1) if few else x
        if few:
            rows = torch.cat([rows, rows[:1].expand(FEWEST_ROWS - n, -1)])
        out = torch.ops.mkldnn._linear_pointwise(rows, self.packed, self.bias, "none", [], "")
        if few:
            out = out[:n].reshape(*x.shape[:-1], out.shape[-1])
        return (out,) if len(self.sizes) == 1 else out.split(self.sizes, -1)


def _params(modules: tuple[nn.Linear, ...]) -> list[torch.Tensor | None]:
    """Each module's weight and bias (None where it has none): what a prepacked copy holds."""
    return [t for m in modules for t in (m.weight, m.bias)]


def _state(weight: torch.Tensor | None) -> tuple | None:
    """What a copy of a weight or bias was made from: its storage, dtype and version
    counter (which moves when it is written in place; a tensor made under inference mode
    keeps none, and cannot be written outside it). ``module.to(dtype)`` swaps the storage
    of the same parameter."""
    if weight is None:
        return None
    try:
        version = weight._version
    except RuntimeError:
        version = None
    return weight.data_ptr(), weight.dtype, weight.device, version


class _MLP:
    """The Llama MLP, down(act(gate(x)) * up(x)), over prepacked linear layers."""

    def __init__(self, mlp: Any) -> None:
        # gate and up stay two layers: as one, a prefill of 580 tokens took 25 % longer
        # (500-527 against 363-416 ms), for 2 % off a pass of 16 tokens
        self.gate, self.up = prepacked(mlp.gate_proj), prepacked(mlp.up_proj)
        self.down, self.act = prepacked(mlp.down_proj), mlp.act_fn

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(self.gate(x)) * self.up(x))


def _mlp(mlp: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """The layer's MLP over prepacked layers where it has the Llama parts, else itself."""
    parts = ("gate_proj", "up_proj", "down_proj")
    if all(isinstance(getattr(mlp, p, None), nn.Linear) for p in parts) and callable(
            getattr(mlp, "act_fn", None)):
        return _MLP(mlp)
    return mlp


class _Attention:
    """A layer's attention projections, prepacked, beside the module's head sizes."""

    def __init__(self, attn: Any) -> None:
        self.qkv = fused(attn.q_proj, attn.k_proj, attn.v_proj)
        self.o_proj = prepacked(attn.o_proj)
        self.head_dim, self.scaling = attn.head_dim, attn.scaling


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE as transformers' Llama applies it (rotate_half).

    x: [N, heads, D]; cos, sin: [N, 1, D]
    """
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def row_mask(mask: torch.Tensor, columns: torch.Tensor, valid: torch.Tensor,
             groups: int = 1) -> torch.Tensor:
    """Which columns each new position attends to: [B, 1, groups * T, L] bool.

    mask: [B, L] the row's real columns after the pass; columns: [B, T] the column each new
    position was written to; valid: [B, T]. A valid position sees its row's real columns up
    to its own. A padding position sees every column (its output is never used, but stays
    finite). The ``groups`` query heads that share a key head take the same rows, one after
    the other.
    """
    B, T = valid.shape
    L = mask.shape[1]
    order = torch.arange(L, device=valid.device)[None, None] <= columns[:, :, None]
    allowed = (mask[:, None, :] & order) | ~valid[:, :, None]  # [B, T, L]
    return allowed[:, None, None].expand(B, 1, groups, T, L).reshape(B, 1, groups * T, L)


def split(extents: list[int], old: int, per_call: int | None = None) -> int:
    """The width t of the attention call over all rows.

    Each row's first t queries go in that call; a row whose valid tokens reach past t
    (``extents``: per row, the last valid position + 1) takes the rest in a call of its own.
    A row's n queries in a call over ``old`` cache columns and the new ones up to its last
    cost (ROW_QUERIES + n) x those columns, and each call past the first ``per_call``
    (default CALL_COLUMNS). t = max(extents) is one padded call."""
    per_call = CALL_COLUMNS if per_call is None else per_call
    B, T, R = len(extents), max(extents), ROW_QUERIES
    best, best_cost = T, B * (R + T) * (old + T)
    for t in range(1, T):
        wide = [e for e in extents if e > t]
        cost = B * (R + t) * (old + t) + sum(per_call + (R + e - t) * (old + e) for e in wide)
        if cost < best_cost:
            best, best_cost = t, cost
    return best


def _picks(rows: list[list[int]], first: list[int]) -> tuple[list[int], list[int], int]:
    """Where each row's wanted logits are: its valid positions from first[b] on, in slots
    0, 1, ... of its row of W = T - max(first). -> (their indices among the packed tokens
    [n], their slots in the flattened [B * W] block [n], W). ``rows``: per row, its valid
    flags."""
    W = len(rows[0]) - max(first)
    need, slots, k = [], [], 0
    for b, (flags, f) in enumerate(zip(rows, first)):
        for j, v in enumerate(flags):
            if v:
                if f <= j < f + W:
                    need.append(k)
                    slots.append(b * W + j - f)
                k += 1
    return need, slots, W


def _spread(x: torch.Tensor, index: torch.Tensor, B: int, T: int) -> torch.Tensor:
    """Packed rows [N, ...] back to their padded places [B, T, ...], zeros between."""
    out = x.new_zeros(B * T, *x.shape[1:])
    return out.index_copy_(0, index, x).view(B, T, *x.shape[1:])


@dataclass(frozen=True)
class _Call:
    """One attention call of a pass (PackedForward._calls): its rows of the batch, its
    queries start..stop - 1 of each, the cache columns it reads, its mask [rows, 1, groups
    x (stop - start), cols]. ``reads`` [rows x (stop - start)]: the packed token each query
    is taken from (a padding query takes token 0; its output is never kept); ``writes``:
    the packed tokens its outputs go to, ``kept`` the outputs that are theirs (None: all,
    in order)."""

    rows: slice
    start: int
    stop: int
    cols: int
    mask: torch.Tensor
    reads: torch.Tensor
    writes: torch.Tensor
    kept: torch.Tensor | None


def _places(packed: list[list[int]], device: torch.device
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(reads, writes, kept) of a call (``_Call``) from its rows' positions' places among
    the packed tokens (-1: padding)."""
    flat = [p for row in packed for p in row]
    kept = [i for i, p in enumerate(flat) if p >= 0]
    reads = torch.tensor([max(p, 0) for p in flat], dtype=torch.long, device=device)
    writes = torch.tensor([flat[i] for i in kept], dtype=torch.long, device=device)
    every = len(kept) == len(flat)
    return reads, writes, None if every else torch.tensor(kept, dtype=torch.long, device=device)


class PackedForward:
    """The forward pass of a Llama-family model over packed tokens, into a KVRows cache."""

    def __init__(self, model: PreTrainedModel) -> None:
        reason = refusal(model)
        if reason is not None:
            raise ValueError(f"no packed forward for this model: {reason}")
        base = model.model
        self.embed, self.norm, self.rope = base.embed_tokens, base.norm, base.rotary_emb
        self.layers = list(base.layers[: model.config.num_hidden_layers])
        self.attention = [_Attention(layer.self_attn) for layer in self.layers]
        self.mlps = [_mlp(layer.mlp) for layer in self.layers]
        self.head = prepacked(model.lm_head) if isinstance(model.lm_head, nn.Linear) else (
            model.lm_head)
        cfg = model.config
        self.groups = cfg.num_attention_heads // cfg.num_key_value_heads  # queries per key

    @torch.inference_mode()
    def __call__(self, cache: Columns, mask: torch.Tensor, ends: torch.Tensor,
                 input_ids: torch.Tensor, valid: torch.Tensor, last_only: bool = False,
                 first: list[int] | None = None) -> tuple[Logits, torch.Tensor]:
        """Write each row's valid tokens into ``cache`` right after the row's last real
        column, and return their logits and the new mask.

        mask: [B, L] bool, the real columns before this pass; ends: [B] the column after
        each row's last real one (KVRows.marker); input_ids, valid: [B, T].
        Returns (the valid positions' logits in a [B, T] block (logits.py), or the last
        column's [B, 1] when ``last_only``, or with ``first`` (per row, the first position
        whose logits it needs) a [B, T - max(first)] block, row b's positions from first[b]
        on; the mask [B, L'] after the pass, L' the furthest row's end: it shrinks when the
        rows' longest ones dropped their last columns). Only the positions returned go through
        the head. Reads the valid places and the rows' ends on the host in one go (a
        device sync).
        """
        B, T = input_ids.shape
        dev, L = input_ids.device, mask.shape[1]
        counts = valid.long().cumsum(1)  # [B, T]
        host = torch.cat([ends, valid.reshape(-1).long()]).tolist()
        rows = [host[B + b * T : B + (b + 1) * T] for b in range(B)]  # valid, per row
        stops = [e + sum(r) for e, r in zip(host[:B], rows)]  # each row's end after the pass
        width = max(stops, default=0)
        flat = [b * T + j for b, r in enumerate(rows) for j, v in enumerate(r) if v]
        index = torch.tensor(flat, dtype=torch.long, device=dev)  # [N] flat valid places
        columns = ends[:, None] + counts - 1  # [B, T] where each valid token goes
        place = (index // T, columns.reshape(-1)[index])  # [N] row and column of each
        new = mask.new_zeros(B, width)
        new[:, : min(L, width)] = mask[:, :width]
        new[place] = True
        seen = mask.sum(1, keepdim=True)  # [B, 1] real tokens so far
        positions = seen + counts - 1  # [B, T]
        x = self.embed(input_ids.reshape(-1)[index])  # [N, hidden]
        cos, sin = self.rope(x, positions.reshape(-1)[index][None])  # [1, N, D] each
        cos, sin = cos[0, :, None], sin[0, :, None]  # [N, 1, D]
        allowed = row_mask(new, columns, valid, self.groups)  # [B, 1, groups * T, L']
        # the positions whose logits are wanted, made before any kernel of the pass is queued
        # (a copy to the device waits for those)
        picks = None if first is None else _picks(rows, first)
        if picks is not None:  # [n] each: among the packed tokens, and in the block
            wanted, slots = (torch.tensor(v, dtype=torch.long, device=dev) for v in picks[:2])
        calls = self._calls(self._plan(dev, rows, max(host[:B], default=0), stops), allowed,
                            self.groups, rows)
        for i, (layer, attn, mlp) in enumerate(zip(self.layers, self.attention, self.mlps)):
            x = x + self._attention(attn, layer.input_layernorm(x), cache, i,
                                    index, place, (B, T, width), cos, sin, calls)
            x = x + mlp(layer.post_attention_layernorm(x))
        x = self.norm(x)  # [N, hidden]
        if last_only:
            last = _spread(x, index, B, T)[:, -1:]  # [B, 1, hidden]
            return Logits.block(self.head(last)), new  # [B, 1, V]
        if picks is None:
            return self._logits(x, (B, T), index, flat), new
        return self._logits(x.index_select(0, wanted), (B, picks[2]), slots, picks[1]), new

    def _logits(self, x: torch.Tensor, shape: tuple[int, int], slots: torch.Tensor,
                places: list[int]) -> Logits:
        """The head over packed positions x [n, hidden] at ``places`` of a block of
        ``shape`` (``slots`` the same on the device); a full block is kept as it is."""
        logits = self.head(x)  # [n, V]
        if len(places) == shape[0] * shape[1]:  # every place carried, in order
            return Logits(logits, shape)
        return Logits(logits, shape, slots, places)

    @staticmethod
    def _plan(device: torch.device, rows: list[list[int]], old: int,
              stops: list[int]) -> tuple[int, int, list[tuple[int, int, int]]]:
        """How the attention of a pass is cut (``split``): the width t of the call over all
        rows and the columns it reads (``old``, the furthest row's end before the pass, + t),
        and (row, extent, the row's end) for each row whose queries go on past t. ``rows``:
        per row, its valid flags. On a GPU, and for a pass of one token a row, one padded
        call (t = T): there a call costs more than the padding it saves."""
        T = len(rows[0]) if rows else 1
        if T == 1 or device.type != "cpu":
            return T, max(stops, default=0), []
        extents = [max((j + 1 for j, v in enumerate(r) if v), default=1) for r in rows]
        t = split(extents, old)
        return t, min(old + t, max(stops)), [(b, e, stops[b]) for b, e in enumerate(extents)
                                             if e > t]

    @staticmethod
    def _calls(plan: tuple[int, int, list[tuple[int, int, int]]], allowed: torch.Tensor,
               groups: int, rows: list[list[int]]) -> torch.Tensor | list[_Call]:
        """The attention calls of a pass cut by ``plan`` (``_plan``), their masks and the
        packed tokens each reads and writes, made once for every layer. One call, every row
        padded to T: its mask, ``allowed`` ([B, 1, groups * T, L], row_mask) as it is.
        ``rows``: per row, its valid flags."""
        t, narrow, wide = plan
        B, _, GT, L = allowed.shape
        T = GT // groups
        if t == T:
            return allowed
        m = allowed.view(B, 1, groups, T, L)
        places: list[list[int]] = []  # per row, each position's place among the packed
        k = 0  # tokens (-1: padding)
        for flags in rows:
            places.append([])
            for v in flags:
                places[-1].append(k if v else -1)
                k += v
        dev = allowed.device
        return [_Call(r, start, stop, cols,
                      m[r, :, :, start:stop, :cols].reshape(-1, 1, groups * (stop - start), cols),
                      *_places([p[start:stop] for p in places[r]], dev))
                for r, start, stop, cols in [(slice(None), 0, t, narrow)] + [
                    (slice(b, b + 1), t, e, end) for b, e, end in wide]]

    @staticmethod
    def _attention(attn: Any, h: torch.Tensor, cache: Columns, layer: int,
                   index: torch.Tensor, place: tuple[torch.Tensor, torch.Tensor],
                   shape: tuple[int, int, int], cos: torch.Tensor, sin: torch.Tensor,
                   calls: torch.Tensor | list[_Call]) -> torch.Tensor:
        """One layer's attention for packed tokens h [N, hidden]; returns [N, hidden].

        The new keys and values are written at their rows' columns (``place``: row and
        column of each); the queries attend over the rows' first L columns as their masks
        say (row_mask). Grouped-query heads go without copying the keys: the query heads
        that share a key head are laid along the query axis of that head ([B, kv_heads,
        groups * T, D]). One call (``calls`` its mask): the queries padded to [B, heads, T,
        D]. Several (``_calls``): each call takes its queries from the packed tokens and
        puts its outputs back there (the first t queries of every row in one call; each row
        listed, its queries t..extent - 1 in a call of its own over its own columns, views
        of the cache); no [B, T] block is made.
        """
        B, T, L = shape
        D = attn.head_dim
        q, k, v = attn.qkv(h)
        q = rotate(q.unflatten(-1, (-1, D)), cos, sin)  # [N, heads, D]
        k = rotate(k.unflatten(-1, (-1, D)), cos, sin)  # [N, kv_heads, D]
        v = v.unflatten(-1, (-1, D))  # [N, kv_heads, D]
        N, H, Hkv = q.shape[0], q.shape[1], k.shape[1]
        G = H // Hkv
        keys, values = cache.write(layer, place, k, v, B, L)  # [B, kv_heads, L, D] each
        if isinstance(calls, torch.Tensor):  # every row padded to T, in one call
            q = _spread(q, index, B, T).transpose(1, 2).reshape(B, Hkv, G * T, D)
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=calls,
                                                 scale=attn.scaling)
            out = out.reshape(B, H, T, D).transpose(1, 2).reshape(B * T, H * D)
            return attn.o_proj(out.index_select(0, index))  # [N, hidden]
        o = q.new_empty(N, H * D)  # every packed token's output: each is some call's
        q = q.view(N, Hkv, G, D)
        for c in calls:
            n = c.stop - c.start
            x = q.index_select(0, c.reads).view(-1, n, Hkv, G, D)  # [rows, n, kv, G, D]
            x = x.permute(0, 2, 3, 1, 4).reshape(-1, Hkv, G * n, D)
            out = F.scaled_dot_product_attention(x, keys[c.rows, :, :c.cols],
                                                 values[c.rows, :, :c.cols],
                                                 attn_mask=c.mask, scale=attn.scaling)
            out = out.view(-1, Hkv, G, n, D).permute(0, 3, 1, 2, 4).reshape(-1, H * D)
            o.index_copy_(0, c.writes, out if c.kept is None else out.index_select(0, c.kept))
        return attn.o_proj(o)  # [N, hidden]
