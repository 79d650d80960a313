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


def _groups(prompts: list[list[int]]) -> list[tuple[list[int], int]]:
    """Runs of prompts (indices) that share at least MIN_PREFIX leading tokens, and the
    length they share (at most all but the shortest one's last token)."""
    order = sorted(range(len(prompts)), key=lambda i: prompts[i])
    runs: list[list[int]] = [order[:1]]
    shared: list[int | None] = [None]
    for prev, i in zip(order, order[1:]):  # sorted: a run shares its least adjacent share
        n = min(common_length(prompts[prev], prompts[i]),
                len(prompts[prev]) - 1, len(prompts[i]) - 1)
        if n >= MIN_PREFIX:
            runs[-1].append(i)
            shared[-1] = n if shared[-1] is None else min(shared[-1], n)
        else:
            runs.append([i])
            shared.append(None)
    return [(r, n) for r, n in zip(runs, shared) if n is not None]


@torch.inference_mode()
def prefill(model: PreTrainedModel, prompts: list[list[int]], pad_id: int,
            store: PrefixStore | None) -> tuple[KVRows, torch.Tensor]:
    """Prefill ``prompts`` (a row each, in order): (their cache, last logits [n, 1, V]).

    Without a store, one padded pass. With one, prompts that share a prefix with a
    stored sequence, or at least MIN_PREFIX tokens with each other (that prefix is then
    computed once and stored), take its columns and prefill their suffixes, one pass per
    prefix; the rest take one plain pass, and their prompts are stored for later rows.
    """
    dev = model.device
    if store is None:
        kv = KVRows(model)
        return kv, kv.forward(*left_pad(prompts, pad_id, dev), last_only=True)
    plan: dict[int, tuple[Prefix, list[int], list[int]]] = {}  # id -> prefix, rows, lengths
    plain = []
    for i, p in enumerate(prompts):
        prefix, n = store.match(p)
        if prefix is not None and n >= MIN_PREFIX:
            _, rows, lengths = plan.setdefault(id(prefix), (prefix, [], []))
            rows.append(i)
            lengths.append(n)
            store.served += n
        else:
            plain.append(i)
    grouped: set[int] = set()
    for run, n in _groups([prompts[i] for i in plain]):  # run: positions in ``plain``
        rows = [plain[j] for j in run]
        one = KVRows(model)
        tokens = prompts[rows[0]][:n]
        one.forward(torch.tensor([tokens], device=dev), torch.ones(1, n, dtype=torch.bool,
                                                                   device=dev))
        prefix = Prefix(tuple(tokens), one.columns(0, 0, n))
        store.add(prefix)
        plan[id(prefix)] = (prefix, rows, [n] * len(rows))
        store.served += n * (len(rows) - 1)  # the first row paid for it
        grouped.update(rows)
    plain = [i for i in plain if i not in grouped]
    parts: list[tuple[list[int], KVRows, torch.Tensor]] = []
    for prefix, rows, lengths in plan.values():
        for i, n in zip(rows, lengths):  # a row takes no prefix but its own
            if tuple(prompts[i][:n]) != prefix.tokens[:n]:
                raise AssertionError(f"prefix plan: row {i} was given another prompt's "
                                     f"prefix")
        kv = KVRows.from_prefix(model, prefix.layers, lengths)
        suffixes = [prompts[i][n:] for i, n in zip(rows, lengths)]
        parts.append((rows, kv, kv.forward(*left_pad(suffixes, pad_id, dev), last_only=True)))
    if plain:
        kv = KVRows(model)
        ids, valid = left_pad([prompts[i] for i in plain], pad_id, dev)
        parts.append((plain, kv, kv.forward(ids, valid, last_only=True)))
        # a new template, perhaps: later rows may share it. The store keeps max_entries at
        # most, so only the last that many are copied (the others would be dropped at once)
        lone = [(b, i) for b, i in enumerate(plain) if len(prompts[i]) > MIN_PREFIX]
        marker = kv.marker()  # a prompt's columns end there (either forward: KVRows.marker)
        ends = marker.tolist() if isinstance(marker, torch.Tensor) else [marker] * kv.rows
        for b, i in lone[-store.max_entries:]:
            n = len(prompts[i])
            store.add(Prefix(tuple(prompts[i]), kv.columns(b, ends[b] - n, ends[b])))
    return _merge(parts, len(prompts))


def _merge(parts: list[tuple[list[int], KVRows, torch.Tensor]],
           n: int) -> tuple[KVRows, torch.Tensor]:
    """One cache and one logits tensor over the parts' rows, in prompt order."""
    kv = parts[0][1]
    for _, other, _ in parts[1:]:
        kv.extend(other)
    order = [i for rows, _, _ in parts for i in rows]  # prompt index of each merged row
    logits = torch.cat([lg for _, _, lg in parts])  # [n, 1, V]
    back = sorted(range(n), key=order.__getitem__)  # merged row of each prompt
    if back != list(range(n)):
        kv.select(back)
        logits = logits[torch.tensor(back, device=logits.device)]
    return kv, logits
