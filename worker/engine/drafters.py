"""Drafters propose up to g tokens per row; the target verifies them.

- DraftModel: a smaller causal LM with the target's tokenizer, sampled like the target.
- PromptLookup: copies the continuation of the latest n-gram match in the row's own
  tokens (prompt and text so far); a point-mass draft, no model.
- NoDraft: proposes nothing; the engine then decodes with the target alone.
- SuffixDrafter (suffix.py): the better of prompt lookup and a draft from an index over the
  job's finished rows; the one drafter that keeps state across generations (per job).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from functools import cached_property
from typing import Protocol

import torch
from transformers import PreTrainedModel

from specq.worker.engine.batch import KVRows, left_pad, upload
from specq.worker.engine.prefix import PrefixStore, prefill
from specq.worker.engine.sampling import keyed_race, logits_to_probs


@dataclass
class Proposal:
    token_ids: torch.Tensor  # [B, g] int64
    num_draft: torch.Tensor  # [B] int64 on the host, proposals per row (<= g): the engine
    # reads the verify pass's width from it without waiting for the device
    probs: torch.Tensor | None  # [B, g, V] draft probabilities, None for point masses
    # [B, g] on the host: the drafter's own probability that each draft token is right,
    # given the ones before it (a drafter that scores its drafts: suffix.py); None: no guess
    confidence: torch.Tensor | None = None

    def cut(self, g: int) -> Proposal:
        """The first g draft tokens of each row."""
        return Proposal(self.token_ids[:, :g], self.num_draft.clamp(max=g),
                        None if self.probs is None else self.probs[:, :g],
                        None if self.confidence is None else self.confidence[:, :g])

    @cached_property
    def confidences(self) -> list[list[float]]:
        """Per row, the confidence of each token it proposes (read once: the policy and
        the step's verdicts both use it)."""
        assert self.confidence is not None
        return [c[:n] for c, n in zip(self.confidence.tolist(), self.num_draft.tolist())]


def padded(rows: list[list], width: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows of up to ``width`` values as one [len(rows), width] tensor, zeros after each: one
    tensor for all rows (a tensor a row cost more than a drafter's own lookups)."""
    return torch.tensor([r + [0] * (width - len(r)) for r in rows],
                        dtype=dtype).reshape(len(rows), width)


class DraftGrammar(Protocol):
    """What a draft model asks of the rows' grammars as it drafts (grammar.DraftMasks, which
    imports this module: declared here, no import back)."""

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """logits: [B, 1, V] at the rows' current draft positions -> masked in place"""

    def advance(self, tokens: list[int]) -> None:
        """Each row drafted tokens[b]: its grammar state moves past it."""

    def rewind(self) -> None:
        """Undo every ``advance``: the rows' grammars are where the step began."""


@dataclass
class DraftInputs:
    """What a drafter may read of the batch (the tensors on the host)."""

    tokens: list[list[int]]  # per row: prompt + generated so far
    seeds: torch.Tensor  # [B] int64
    temperature: torch.Tensor  # [B]
    top_k: torch.Tensor  # [B]
    top_p: torch.Tensor  # [B]
    greedy: bool  # every row is greedy
    # masks a draft model's logits with the rows' grammars (grammar.py); None: no row shaped
    grammar: DraftGrammar | None = None


class Drafter(Protocol):
    """Proposes draft tokens; its capabilities choose how the engine drafts (drafting.py)."""

    name: str
    free: bool  # costs nothing next to a target pass: proposes while g = 0 (shadow.py)
    scored: bool  # its proposals carry each token's confidence (Proposal.confidence)
    races: bool  # samples by keyed_race: sampled rows' targets race with the same noise
    # admits a row before its first token (keeps no cache of its own): a refill may join a
    # running batch's pass, its prompt beside the rows' drafts (speculative.py: _join)
    admits_unseen: bool

    def admit(self, prompts: list[list[int]], first_tokens: list[int]) -> None:
        """New rows join at the end of the batch, their prompts and first tokens known
        (``first_tokens`` empty where they join a pass before it: ``admits_unseen``)."""

    def select(self, rows: torch.Tensor) -> None:
        """Keep only these rows, in this order."""

    def propose(self, batch: DraftInputs, g: int) -> Proposal: ...

    def update(self, accepted: list[int], tokens: list[list[int]]) -> None:
        """After a verify pass (g may have been 0), per row: the drafts accepted, and the
        tokens emitted (those drafts, then the target's recovered or bonus token)."""

    def compact(self) -> None: ...

    def reset(self) -> None:
        """Forget every row (a generation starts, or one failed half-way)."""

    def use_job(self, job: Hashable) -> None:
        """The rows of the generation starting now belong to this job (None: unnamed)."""

    def finish(self, tokens: list[int]) -> None:
        """A row ended normally (EOS, stop string, max tokens): its prompt + output."""


class _JobBlind:
    """A drafter that learns nothing from the job's finished rows."""

    free = scored = races = False  # capabilities (Drafter): none unless a drafter says so
    admits_unseen = True

    def use_job(self, job: Hashable) -> None: ...
    def finish(self, tokens: list[int]) -> None: ...


class _Stateless(_JobBlind):
    """A drafter that keeps no per-row state."""

    def admit(self, prompts: list[list[int]], first_tokens: list[int]) -> None: ...
    def select(self, rows: torch.Tensor) -> None: ...
    def update(self, accepted: list[int], tokens: list[list[int]]) -> None: ...
    def compact(self) -> None: ...
    def reset(self) -> None: ...


class NoDraft(_Stateless):
    name = "none"

    def propose(self, batch: DraftInputs, g: int) -> Proposal:
        B = len(batch.tokens)
        return Proposal(torch.zeros(B, 0, dtype=torch.long), torch.zeros(B, dtype=torch.long),
                        None)


class PromptLookup(_Stateless):
    """n-gram copy from the row's own tokens (Saxena 2023, "prompt lookup decoding")."""

    name = "prompt_lookup"
    free = True  # costs nothing next to a target pass: may propose while g = 0 (shadow.py)

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def propose(self, batch: DraftInputs, g: int) -> Proposal:
        # plain lists: torch ops a row (unfold, compare, nonzero per n-gram) took 1.0 ms a
        # step at 16 rows of 300 tokens, beside a 60 ms pass
        conts = [self.lookup(seq, g) for seq in batch.tokens]
        return Proposal(padded(conts, g, torch.long),
                        torch.tensor([len(c) for c in conts], dtype=torch.long), None)

    def lookup(self, seq: list[int], g: int) -> list[int]:
        """The g tokens after the latest earlier occurrence of seq's last n tokens, n from
        max_ngram down to min_ngram (the longest match that occurs wins, then the latest).

        One scan back over the occurrences of the last token (list.index in C over the
        reversed tokens), each extended back to its match length, until one matches
        max_ngram tokens: the first occurrence of the longest length is its latest."""
        N = len(seq)
        top = min(self.max_ngram, N - 1)  # a match of n tokens needs n + 1 of them
        if top < self.min_ngram:
            return []
        last, rev = seq[-1], seq[-2::-1]  # rev[i] = seq[N - 2 - i]
        best, best_end, i = 0, -1, 0  # the longest match so far, its latest end
        while best < top:
            try:
                i = rev.index(last, i)
            except ValueError:
                break
            end = N - 2 - i
            m = 1
            while m < top and end - m >= 0 and seq[end - m] == seq[N - 1 - m]:
                m += 1
            if m > best:  # newest first: the first of a length is its latest
                best, best_end = m, end
            i += 1
        if best < self.min_ngram:
            return []
        return seq[best_end + 1 : best_end + 1 + g]


class DraftModel(_JobBlind):
    """A draft LM with its own cache over the batch rows. A sampled row's drafts are raced
    (sampling.keyed_race) with the noise the target races with at the same positions.

    Its cache holds every token of a row except `pending` ones (1 or 2 per row, or more
    after steps without drafting), which the next proposal feeds first. A row is
    prefilled only when a proposal needs it: while the engine does not draft (g = 0), the
    draft model costs nothing.
    """

    name = "draft_model"
    races = True  # samples by keyed_race: the engine's target samples by it too
    admits_unseen = False  # its cache prefills a row from the prompt and the first token

    def __init__(self, model: PreTrainedModel, pad_id: int = 0, vocab_size: int | None = None,
                 share_prefixes: bool = True):
        self.model = model
        self.pad_id = pad_id
        self.vocab_size = vocab_size  # the target's logits width, when it differs
        self.prefixes = PrefixStore() if share_prefixes else None  # prefix.py
        self.reset()

    def reset(self) -> None:
        self.kv = KVRows(self.model)
        self.pending: list[list[int]] = []
        self.fresh: list[bool] = []  # row not prefilled yet: its whole prompt is pending
        # where its drafts went in the cache (KVRows.marker), g and the drafts of the
        # latest proposal
        self._last: tuple[int | torch.Tensor, int, list[list[int]]] | None = None

    def admit(self, prompts: list[list[int]], first_tokens: list[int]) -> None:
        """Rows wait, prompt pending, until a proposal needs them."""
        if self.kv.cache is not None:
            self.kv.add_rows(len(prompts))
        self.pending += [list(p) + [t] for p, t in zip(prompts, first_tokens)]
        self.fresh += [True] * len(prompts)

    def _catch_up(self) -> None:
        """Prefill the fresh rows (all but their last pending token) together, a shared
        prompt prefix once (prefix.py)."""
        rows = [i for i, f in enumerate(self.fresh) if f]
        if not rows:
            return
        new, _ = prefill(self.model, [self.pending[i][:-1] for i in rows], self.pad_id,
                         self.prefixes)
        if self.kv.cache is None:  # no cache yet: every row is fresh
            self.kv.extend(new)
        else:
            self.kv.replace(torch.tensor(rows), new)
        for i in rows:
            self.pending[i] = self.pending[i][-1:]
            self.fresh[i] = False

    def select(self, rows: torch.Tensor) -> None:
        self.kv.select(rows)
        keep = rows.tolist()
        self.pending = [self.pending[i] for i in keep]
        self.fresh = [self.fresh[i] for i in keep]

    def compact(self) -> None:
        self.kv.compact()

    @torch.inference_mode()
    def propose(self, batch: DraftInputs, g: int) -> Proposal:
        self._catch_up()
        B, dev = len(self.pending), self.kv.device
        ids, valid = left_pad(self.pending, self.pad_id, dev)
        logits = self._fit(self.kv.forward(ids, valid, last_only=True))  # [B, 1, V]
        start = self.kv.marker()  # where x_1 .. x_{g-1} go
        if not batch.greedy:
            pos = torch.tensor([len(t) for t in batch.tokens], device=dev)[:, None]  # [B, 1]
            seeds = batch.seeds.to(dev)
            params = (batch.temperature, batch.top_k, batch.top_p)
        drafts, probs = [], []
        for j in range(g):
            if batch.grammar is not None:  # q is the constrained draft distribution
                logits = batch.grammar.mask(logits)
            if batch.greedy:
                x = logits[:, 0].argmax(-1)  # [B]
            else:
                p = logits_to_probs(logits, *params)  # [B, 1, V]
                x = keyed_race(p, seeds, pos + j)[:, 0]  # [B] draft j at position len + j
                probs.append(p[:, 0])
            drafts.append(x)
            if batch.grammar is not None:
                batch.grammar.advance(x.tolist())
            if j < g - 1:
                one = torch.ones(B, 1, dtype=torch.bool, device=dev)
                logits = self._fit(self.kv.forward(x[:, None], one))
        token_ids = torch.stack(drafts, 1)  # [B, g]
        self._last = (start, g, token_ids.tolist())
        return Proposal(
            token_ids,
            torch.full((B,), g, dtype=torch.long),
            torch.stack(probs, 1) if probs else None,
        )

    def _fit(self, logits: torch.Tensor) -> torch.Tensor:
        """Cut or pad (with -inf) the draft's logits to the target's vocabulary width."""
        V = self.vocab_size
        if V is None or logits.shape[-1] == V:
            return logits
        if logits.shape[-1] > V:
            return logits[..., :V]
        pad = logits.new_full((*logits.shape[:-1], V - logits.shape[-1]), float("-inf"))
        return torch.cat([logits, pad], -1)

    def update(self, accepted: list[int], tokens: list[list[int]]) -> None:
        if self._last is None:  # a step without drafting: the target's tokens wait (more
            for row, toks in zip(self.pending, tokens):  # than one: a grammar's, forced)
                row.extend(toks)
            return
        start, g, drafts = self._last
        # fed this step: pending, then x_1 .. x_{g-1} from start; keep x_j while x_1 .. x_j
        # are the tokens emitted (the accepted drafts, unless the grammar drafted the row
        # instead: grammar.py), and one emitted token at least waits for the next pass
        keep = [min(_agree(d, toks), g - 1, len(toks) - 1) for d, toks in zip(drafts, tokens)]
        self.kv.keep(start, upload(torch.tensor(keep), self.kv.device))
        # all g accepted: x_g was never fed, so it waits with the bonus token
        self.pending = [toks[k:] for k, toks in zip(keep, tokens)]
        self._last = None


def _agree(a: list[int], b: list[int]) -> int:
    """Length of the common prefix of two token lists."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
