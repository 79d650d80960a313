"""A job-level suffix drafter: drafts from the job's own finished sequences.

Offline jobs repeat themselves: an extraction job answers every prompt with the same
JSON skeleton, a synthesis job renders one template many times. SuffixDecoding (Oliaro
et al. 2024, arXiv 2411.04975) drafts from an index over the job's earlier outputs: it
matches the end of the row's text against everything indexed, and follows the most
frequent continuation, scoring a draft by its expected accepted length.

Here the index is an n-gram table over the job's finished rows (prompt + output, one
sequence each): for each n in NGRAMS, the n tokens ending at a position -> the positions
they end at, oldest first. The occurrences of the row's last n tokens (the newest
MAX_CANDIDATES) are followed token by token: the next draft token is the continuation
most of them share (the newest on a tie), and only those that share it go on. Each token's
probability is that share, smoothed by the rule of succession, (agree + 1) / (seen + 2),
so one lone occurrence is not taken for a certainty; the draft's score is the sum of the
running products, its expected number of accepted tokens. A draft stops where the product
falls below MIN_PATH_PROB. The per-token probabilities go with the proposal
(``Proposal.confidence``): the adaptive policy learns what they are worth and cuts each
step's drafts where more would not pay (policy.py: Calibration).

Each row also has prompt lookup's draft (its own tokens: the longest match of up to 3
tokens), followed and scored the same way over the row's own occurrences; the higher score
wins, prompt lookup on a tie. A row with nothing in the job index drafts what prompt
lookup would.

The job index outlives a generation (a worker runs a job chunk by chunk) and is keyed by
job; rows that end normally add to it, rows that fail or are dropped add nothing. Memory
is bounded by ``max_tokens`` indexed tokens over all jobs: the least recently used jobs
go first, then the current job's oldest sequences.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Hashable
from typing import NamedTuple

import torch

from specq.worker.engine.drafters import DraftInputs, Proposal, padded

log = logging.getLogger(__name__)

NGRAMS = (1, 2, 4, 8)  # match lengths tried in the job index; the best-scored draft wins
LOOKUP_NGRAMS = (3, 2, 1)  # prompt lookup's match lengths over the row's own tokens
MAX_CANDIDATES = 32  # newest occurrences of a match followed: bounds a proposal's cost
MIN_PATH_PROB = 0.1  # a job-index draft stops where its running probability falls below
MAX_TOKENS = 1 << 17  # tokens indexed over all jobs (a few hundred bytes each at most)
END = -1  # closes each indexed sequence: no continuation runs past it


class Draft(NamedTuple):
    """Draft tokens and each one's probability given those before it."""

    tokens: list[int]
    probs: list[float]

    @property
    def score(self) -> float:
        """Expected accepted tokens: sum over j of prod_{i <= j} probs[i]."""
        score, path = 0.0, 1.0
        for p in self.probs:
            path *= p
            score += path
        return score


NO_DRAFT = Draft([], [])


def follow(tokens: list[int], base: int, ends: list[int], g: int,
           min_prob: float = 0.0) -> Draft:
    """The most frequent continuation of up to g tokens after the occurrences ``ends``.

    tokens[i - base] is the token at absolute position i; ends are the positions where
    the matched tokens end, newest first (ties go to the newest). Token j's probability
    is (agree_j + 1) / (seen_j + 2) over the occurrences still followed.
    """
    draft, probs = Draft([], [])
    path, limit = 1.0, len(tokens) + base
    for _ in range(g):
        counts: dict[int, int] = {}
        for e in ends:
            t = tokens[e + 1 - base] if e + 1 < limit else END
            if t != END:
                counts[t] = counts.get(t, 0) + 1
        if not counts:
            break
        best = max(counts, key=counts.__getitem__)  # the first seen of the most frequent
        p = (counts[best] + 1) / (len(ends) + 2)
        if path * p < min_prob:
            break
        path *= p
        draft.append(best)
        probs.append(p)
        ends = [e + 1 for e in ends if e + 1 < limit and tokens[e + 1 - base] == best]
    return Draft(draft, probs)


def lookup(seq: list[int], g: int) -> Draft:
    """Prompt lookup over the row's own tokens, followed and scored like the job index:
    the newest MAX_CANDIDATES occurrences of its longest matching last n tokens (n in
    LOOKUP_NGRAMS).

    One scan back over the occurrences of the last token (list.index in C over the
    reversed tokens, as drafters.PromptLookup), each extended back to its match length; it
    stops once MAX_CANDIDATES matches of the longest length are found. The scorer proposes
    at every step, plain ones too: at 64 rows of 2,000 tokens of English a proposal took
    6.3 ms with a scan in Python over every token, 4.9 ms with this one."""
    N = len(seq)
    top = min(max(LOOKUP_NGRAMS), N - 1)  # a match of n tokens needs n + 1 of them
    if top < min(LOOKUP_NGRAMS):
        return NO_DRAFT
    last, rev = seq[-1], seq[-2::-1]  # rev[i] = seq[N - 2 - i]
    hits: list[tuple[int, int]] = []  # (end, match length), newest first
    longest, i = 0, 0
    while longest < MAX_CANDIDATES:
        try:
            i = rev.index(last, i)
        except ValueError:
            break
        end, m = N - 2 - i, 1
        while m < top and end - m >= 0 and seq[end - m] == seq[N - 1 - m]:
            m += 1
        hits.append((end, m))
        longest += m == top
        i += 1
    for n in LOOKUP_NGRAMS:
        if n <= top and (ends := [e for e, m in hits if m >= n]):
            return follow(seq, 0, ends[:MAX_CANDIDATES], g)
    return NO_DRAFT


class JobIndex:
    """The n-gram table over one job's finished sequences, oldest evicted first."""

    def __init__(self) -> None:
        self.tokens: list[int] = []  # the sequences, each closed by END
        self.base = 0  # absolute position of tokens[0]
        self.lengths: list[int] = []  # of the sequences held, oldest first (END included)
        self.table: dict[tuple[int, ...], list[int]] = {}  # n-gram -> end positions

    @property
    def size(self) -> int:
        """Tokens held, END markers included."""
        return len(self.tokens)

    def add(self, seq: list[int]) -> None:
        start = self.base + len(self.tokens)
        self.tokens += seq
        self.tokens.append(END)
        self.lengths.append(len(seq) + 1)
        for j in range(len(seq)):
            for n in NGRAMS:
                if n > j + 1:
                    break
                self.table.setdefault(tuple(seq[j - n + 1 : j + 1]), []).append(start + j)

    def evict_oldest(self) -> None:
        """Drop the oldest sequence: its positions are the oldest of every list."""
        length = self.lengths.pop(0)
        seq = self.tokens[: length - 1]
        drops: dict[tuple[int, ...], int] = {}
        for j in range(len(seq)):
            for n in NGRAMS:
                if n > j + 1:
                    break
                key = tuple(seq[j - n + 1 : j + 1])
                drops[key] = drops.get(key, 0) + 1
        for key, k in drops.items():
            ends = self.table[key]
            if k == len(ends):
                del self.table[key]
            else:
                del ends[:k]
        del self.tokens[:length]
        self.base += length

    def propose(self, seq: list[int], g: int) -> Draft:
        """The best-scored draft over the match lengths in NGRAMS."""
        best, best_score = NO_DRAFT, 0.0
        for n in NGRAMS:
            if len(seq) < n:
                break
            ends = self.table.get(tuple(seq[-n:]))
            if not ends:
                break  # a longer match cannot occur where a shorter one does not
            draft = follow(self.tokens, self.base, ends[: -MAX_CANDIDATES - 1 : -1], g,
                           MIN_PATH_PROB)
            if draft.tokens and draft.score >= best_score:  # a tie goes to the longer match
                best, best_score = draft, draft.score
        return best


class SuffixDrafter:
    """Per row, the better-scored of the job index's draft and prompt lookup's (a point
    mass, no model). Keeps no per-row state: ``reset`` forgets nothing of the index."""

    name = "suffix"
    free = True  # costs little next to a target pass: may propose while g = 0 (shadow.py)
    scored = True  # its proposals carry per-token confidence (Proposal.confidence)
    races = False

    def __init__(self, max_tokens: int = MAX_TOKENS) -> None:
        self.max_tokens = max_tokens
        self.jobs: OrderedDict[Hashable, JobIndex] = OrderedDict()  # least recent first
        self.job: Hashable = None
        self.use_job(None)

    @property
    def index(self) -> JobIndex:
        return self.jobs[self.job]

    @property
    def size(self) -> int:
        """Tokens indexed over all jobs."""
        return sum(j.size for j in self.jobs.values())

    def use_job(self, job: Hashable) -> None:
        """Rows from now on belong to this job (None: a job of no name)."""
        self.job = job
        if job not in self.jobs:
            self.jobs[job] = JobIndex()
        self.jobs.move_to_end(job)

    def finish(self, tokens: list[int]) -> None:
        """A row ended normally: index its prompt and output, then evict to the bound."""
        if len(tokens) + 1 > self.max_tokens:
            return  # would evict everything, itself included
        self.index.add(tokens)
        size = self.size
        while size > self.max_tokens:
            oldest = next(iter(self.jobs))
            if oldest != self.job:
                size -= self.jobs.pop(oldest).size
                log.debug("suffix index: job %s evicted", oldest)
            else:
                before = self.index.size
                self.index.evict_oldest()
                size -= before - self.index.size

    def propose(self, batch: DraftInputs, g: int) -> Proposal:
        drafts = []
        for seq in batch.tokens:
            own, job = lookup(seq, g), self.index.propose(seq, g)
            drafts.append(job if job.score > own.score else own)
        return Proposal(padded([d.tokens for d in drafts], g, torch.long),
                        torch.tensor([len(d.tokens) for d in drafts], dtype=torch.long),
                        None, padded([d.probs for d in drafts], g, torch.float32))

    def admit(self, prompts: list[list[int]], first_tokens: list[int]) -> None: ...
    def select(self, rows: torch.Tensor) -> None: ...
    def update(self, accepted: list[int], tokens: list[list[int]]) -> None: ...
    def compact(self) -> None: ...
    def reset(self) -> None: ...
