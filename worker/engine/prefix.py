"""Prefill that computes a shared prompt prefix once (vLLM's automatic prefix caching,
SGLang's RadixAttention, in small).

Offline jobs repeat a system prompt or a synthesis template in every prompt. A prompt's
keys and values over its first P tokens depend on those tokens alone (causal attention),
so rows that share a prefix can take its columns from one batch-1 pass and prefill only
their own suffixes. A PrefixStore keeps a few token sequences with their keys and values
(least recently used first out), so later refills with the same template skip it too;
any leading part of a stored sequence serves a prompt that shares that part.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from specq.worker.engine.batch import KVRows, left_pad

MIN_PREFIX = 16  # fewer shared tokens are not worth a pass of their own
STORE_TOKENS = 8192  # tokens kept over all stored sequences (memory: this many columns)
STORE_ENTRIES = 8  # sequences kept: a job's few templates, least recently used out


@dataclass
class Prefix:
    """A token sequence and its keys and values, per layer [1, heads, len(tokens), dim]."""

    tokens: tuple[int, ...]
    layers: list[tuple[torch.Tensor, torch.Tensor]]


def common_length(a: tuple[int, ...] | list[int], b: tuple[int, ...] | list[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


class PrefixStore:
    """A few token sequences with their keys and values, least recently used first out."""

    def __init__(self, max_tokens: int = STORE_TOKENS, max_entries: int = STORE_ENTRIES):
        self.max_tokens, self.max_entries = max_tokens, max_entries
        self.entries: OrderedDict[tuple[int, ...], Prefix] = OrderedDict()
        self.served = 0  # prompt tokens whose columns came from a stored prefix

    def match(self, prompt: list[int]) -> tuple[Prefix | None, int]:
        """The stored sequence sharing the longest prefix with ``prompt``, and how many
        tokens of it serve (at most all but the prompt's last token, whose logits the
        prefill must compute)."""
        best, best_len = None, 0
        for prefix in self.entries.values():
            n = min(common_length(prefix.tokens, prompt), len(prompt) - 1)
            if n > best_len:
                best, best_len = prefix, n
        if best is not None:
            self.entries.move_to_end(best.tokens)
        return best, best_len

    def add(self, prefix: Prefix) -> None:
        if len(prefix.tokens) > self.max_tokens:
            return
        self.entries[prefix.tokens] = prefix
        self.entries.move_to_end(prefix.tokens)
        while (len(self.entries) > self.max_entries
               or sum(len(t) for t in self.entries) > self.max_tokens):
            self.entries.popitem(last=False)


def _groups(prompts: list[list[int]],
            served: list[int] | None = None) -> list[tuple[list[int], int]]:
    """Groups of prompts (indices) worth a shared prefix computed once, and its length.

    In sorted order, a run of prompts shares the least of its neighbours' shares (at most
    all but the shortest one's last token). A run's prefix saves each of its rows the
    tokens it shares beyond what the store already serves that row (``served``), and costs
    its own tokens beyond that; a run is split where its least share falls whenever its
    parts save more: templates under one chat header share the header with each other but
    their whole instructions within their own run. A group saves MIN_PREFIX tokens at
    least (fewer are not worth a pass)."""
    n = len(prompts)
    have = served or [0] * n
    order = sorted(range(n), key=lambda i: prompts[i])
    shares = [min(common_length(prompts[a], prompts[b]), len(prompts[a]) - 1,
                  len(prompts[b]) - 1) for a, b in zip(order, order[1:])]

    # each run's best: (tokens saved, its groups), its parts' first (no recursion: prompts
    # nested one token deeper each would go a frame a level)
    best: dict[tuple[int, int], tuple[int, list[tuple[list[int], int]]]] = {}
    todo = [(0, n, False)]
    while todo:
        lo, hi, parts_done = todo.pop()
        if hi - lo < 2:
            best[lo, hi] = (0, [])
            continue
        least = min(shares[lo: hi - 1])
        cuts = [k + 1 for k in range(lo, hi - 1) if shares[k] == least]
        parts = list(zip([lo] + cuts, cuts + [hi]))
        if not parts_done:
            todo.append((lo, hi, True))
            todo += [(a, b, False) for a, b in parts]
            continue
        rows = order[lo:hi]
        own = -1
        if least >= MIN_PREFIX:
            own = (sum(max(0, least - have[i]) for i in rows)
                   - (least - max(min(have[i], least) for i in rows)))
        split = sum(best[p][0] for p in parts)
        best[lo, hi] = ((own, [(rows, least)]) if own >= MIN_PREFIX and own >= split else
                        (split, [g for p in parts for g in best[p][1]]))
    return best[0, n][1]


@torch.inference_mode()
def prefill(model: PreTrainedModel, prompts: list[list[int]], pad_id: int,
            store: PrefixStore | None) -> tuple[KVRows, torch.Tensor]:
    """Prefill ``prompts`` (a row each, in order): (their cache, last logits [n, 1, V]).

    Without a store, one padded pass. With one, a row takes the columns of the longest
    prefix of its prompt that the store holds and computes the rest. Where prompts share
    more than the store serves them (``_groups``), the shared prefixes are computed first,
    in one pass of their own, and stored; then every row's rest, in one pass. The prompts
    of rows that took nothing are stored too, for later rows.
    """
    dev = model.device
    if store is None:
        kv = KVRows(model)
        return kv, kv.forward(*left_pad(prompts, pad_id, dev), last_only=True)
    bases = [_base(store, p) for p in prompts]
    new = [Prefix(tuple(prompts[run[0]][:n]), [])
           for run, n in _groups(prompts, [n for _, n in bases])]
    computed = 0
    if new:  # their own pass, each from what the store holds of it
        heads = [_base(store, list(p.tokens)) for p in new]
        kv, _ = _rest(model, [list(p.tokens) for p in new], heads, pad_id)
        computed += sum(len(p.tokens) - n for p, (_, n) in zip(new, heads))
        for b, prefix in enumerate(new):
            prefix.layers = kv.real_columns(b)
            store.add(prefix)
        bases = [_base(store, p, new) for p in prompts]
    kv, logits = _rest(model, prompts, bases, pad_id)
    computed += sum(len(p) - n for p, (_, n) in zip(prompts, bases))
    store.served += sum(map(len, prompts)) - computed
    # a new template, perhaps: later rows may share it. The store keeps max_entries at most,
    # so only the last that many are copied (the others would be dropped at once)
    lone = [b for b, (p, _) in enumerate(bases) if p is None and len(prompts[b]) > MIN_PREFIX]
    for b in lone[-store.max_entries:]:
        store.add(Prefix(tuple(prompts[b]), kv.real_columns(b)))
    return kv, logits


def remember(store: PrefixStore, kv: KVRows, rows: list[tuple[int, list[int]]]) -> None:
    """Store the prompts of rows (row, prompt) that joined a pass with no stored prefix
    (``seeded``), as ``prefill`` stores its lone prompts: later rows of their template take
    their columns. A joined row's prompt is its first columns (the packed forward wrote
    them from column 0), read without a sync. Only the last max_entries are copied (the
    store would drop the others at once)."""
    lone = [(b, prompt) for b, prompt in rows if len(prompt) > MIN_PREFIX]
    for b, prompt in lone[-store.max_entries:]:
        store.add(Prefix(tuple(prompt), kv.columns(b, 0, len(prompt))))


def shared(prompts: list[list[int]], bases: list[tuple[Prefix | None, int]]) -> bool:
    """Whether the prompts share prefixes past what their bases (``stored``) serve them,
    worth computing once (``_groups``): a prefill of its own does that, rows that join a
    pass each compute their whole rest."""
    return bool(_groups(prompts, [n for _, n in bases]))


def stored(store: PrefixStore | None,
           prompts: list[list[int]]) -> list[tuple[Prefix | None, int]]:
    """Per prompt, the stored prefix that serves it longest and how many of its tokens
    ((None, 0) without a store or under MIN_PREFIX tokens): what ``seeded`` copies."""
    return [_base(store, p) if store is not None else (None, 0) for p in prompts]


@torch.inference_mode()
def seeded(model: PreTrainedModel, bases: list[tuple[Prefix | None, int]],
           store: PrefixStore | None) -> KVRows:
    """Rows (in order) that join a running batch's pass with their prompts (speculative.py:
    ``_join``): each row's first columns those of its base (``stored``: a prefix, and how
    many of its tokens), copied, and nothing computed; the pass computes the rest. The
    cache has no buffers where no row has a base.

    Only what the store holds serves: prompts that share a prefix the store lacks compute
    it each (``prefill`` computes it once, in a pass of its own; a few rows joining a pass
    are worth less than that pass)."""
    kv = KVRows(model)
    parts: dict[int, tuple[Prefix, list[int], list[int]]] = {}  # id -> prefix, rows, lengths
    for i, (prefix, n) in enumerate(bases):
        if prefix is not None:
            _, rows, lengths = parts.setdefault(id(prefix), (prefix, [], []))
            rows.append(i)
            lengths.append(n)
    if not parts:
        return kv
    for prefix, _, lengths in parts.values():
        kv.extend(KVRows.from_prefix(model, prefix.layers, lengths))
    order = [i for _, rows, _ in parts.values() for i in rows]
    plain = [i for i, (prefix, _) in enumerate(bases) if prefix is None]
    if plain:
        kv.add_rows(len(plain))  # rows with no column yet: the pass writes them all
    order += plain
    back = sorted(range(len(order)), key=order.__getitem__)  # the row of each prompt
    if back != list(range(len(order))):
        kv.select(back)
    if store is not None:
        store.served += sum(n for _, n in bases)
    return kv


def _base(store: PrefixStore, prompt: list[int],
          new: Sequence[Prefix] = ()) -> tuple[Prefix | None, int]:
    """The prefix that serves ``prompt`` longest (of the store's, and ``new``: this
    admission's shared ones, which the store may have dropped already), and how many of
    its tokens; (None, 0) under MIN_PREFIX tokens."""
    prefix, n = store.match(prompt)
    for other in new:
        m = min(common_length(other.tokens, prompt), len(prompt) - 1)
        if m > n:
            prefix, n = other, m
    return (prefix, n) if prefix is not None and n >= MIN_PREFIX else (None, 0)


def _rest(model: PreTrainedModel, prompts: list[list[int]],
          bases: list[tuple[Prefix | None, int]], pad_id: int) -> tuple[KVRows, torch.Tensor]:
    """Rows (in order) whose first columns are their base's (a prefix, and how many of its
    tokens: None, 0 for none: ``seeded``), the rest of their prompts computed in one pass.
    -> (their cache, last logits [n, 1, V])"""
    for i, (prefix, n) in enumerate(bases):
        if prefix is not None and tuple(prompts[i][:n]) != prefix.tokens[:n]:
            raise AssertionError(f"prefix plan: row {i} was given another prompt's prefix")
    kv = seeded(model, bases, None)  # the caller counts what the store served
    rest = [p[n:] for p, (_, n) in zip(prompts, bases)]
    return kv, kv.forward(*left_pad(rest, pad_id, model.device), last_only=True)  # [n, 1, V]
