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
probability is that share, smoothed toward a prior worth two occurrences that grows with
the match's length, (agree + 2 PRIOR[n]) / (seen + 2): one lone occurrence is not taken
for a certainty, and one after a match of 8 tokens is trusted more than one after a
single token. The draft's score is the sum of the running products, its expected number
of accepted tokens; a draft stops where the product falls below MIN_PATH_PROB. The
per-token probabilities go with the proposal (``Proposal.confidence``): the adaptive
policy learns what they are worth and cuts each step's drafts where more would not pay
(policy.py: Calibration).

The batch's running rows are indexed for each other the same way (``Siblings``: their
outputs so far, caught up at every proposal): rows that rewrite one passage or fill one
template run side by side, and at batch 16 half of a job's rows, at 64 all of them, start
before any row has finished. Each row also has prompt lookup's draft (its own tokens: the
longest match of up to 3 tokens), followed and scored the same way over the row's own
occurrences. The highest score wins: the job index's over prompt lookup's, the running
rows' over both, the earlier on a tie. A row with nothing in either index drafts what
prompt lookup would.

The job index outlives a generation (a worker runs a job chunk by chunk) and is keyed by
job; rows that end normally add to it, rows that fail or are dropped add nothing. Memory
is bounded by ``max_tokens`` indexed tokens over all jobs: the least recently used jobs
go first, then the current job's oldest sequences.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from typing import NamedTuple

import torch

from specq.worker.engine.drafters import DraftInputs, Proposal, padded

log = logging.getLogger(__name__)

NGRAMS = (1, 2, 4, 8)  # match lengths tried in the job index; the best-scored draft wins
LOOKUP_NGRAMS = (3, 2, 1)  # prompt lookup's match lengths over the row's own tokens
MAX_CANDIDATES = 32  # newest occurrences of a match followed: bounds a proposal's cost
# occurrences of a match looked at in the running rows, the row's own and gone rows' among
# them: a row that repeats one token for thousands of steps is not scanned whole each step
MAX_SCANNED = 4 * MAX_CANDIDATES
MIN_PATH_PROB = 0.1  # a job-index draft stops where its running probability falls below
MAX_TOKENS = 1 << 17  # tokens indexed over all jobs (a few hundred bytes each at most)
INDEXED_FROM = 512  # a row this long keeps a RowIndex: a scan of its tokens costs more
END = -1  # closes each indexed sequence: no continuation runs past it
# The prior of a continuation's probability after a match of n tokens, worth two
# occurrences: a longer match is likelier to go on as before. Replayed over the four
# workloads at batch 16, the first draft token after a 1-token match was accepted at
# 0.03-0.33, after 2 tokens at 0.2-1.0, after 4 or 8 at 0.4-1.0, where one lone
# occurrence gave each the same 2/3 (docs/benchmarks.md, History, 2026-12-06 third session)
PRIOR = {1: 0.25, 2: 0.55, 3: 0.7, 4: 0.8, 8: 0.9}


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


def follow(occurrences: list[tuple[list[int], int]], g: int, min_prob: float = 0.0,
           prior: float = 0.5) -> Draft:
    """The most frequent continuation of up to g tokens after the ``occurrences``.

    Each occurrence is (tokens, i): the matched tokens end at tokens[i]; newest first (ties
    go to the newest). A list's end and END end its continuation. Token j's probability is
    (agree_j + 2 prior) / (seen_j + 2) over the occurrences still followed.
    """
    draft, probs = Draft([], [])
    path, lone = 1.0, (1 + 2 * prior) / 3
    for step in range(g):
        if len(occurrences) == 1:  # one occurrence left (the common case): its own
            # continuation, each token at (1 + 2 prior) / (1 + 2), read off in one slice
            tokens, i = occurrences[0]
            for t in tokens[i + 1 : i + 1 + g - step]:
                if t == END or path * lone < min_prob:
                    break
                path *= lone
                draft.append(t)
                probs.append(lone)
            break
        counts: dict[int, int] = {}
        for tokens, i in occurrences:
            t = tokens[i + 1] if i + 1 < len(tokens) else END
            if t != END:
                counts[t] = counts.get(t, 0) + 1
        if not counts:
            break
        best = max(counts, key=counts.__getitem__)  # the first seen of the most frequent
        p = (counts[best] + 2 * prior) / (len(occurrences) + 2)
        if path * p < min_prob:
            break
        path *= p
        draft.append(best)
        probs.append(p)
        occurrences = [(tokens, i + 1) for tokens, i in occurrences
                       if i + 1 < len(tokens) and tokens[i + 1] == best]
    return Draft(draft, probs)


def best_over_ngrams(seq: list[int], g: int,
                     occurring: Callable[[tuple[int, ...]], list[tuple[list[int], int]]]
                     ) -> Draft:
    """The best-scored draft over the match lengths in NGRAMS, each followed from
    ``occurring(last n tokens)``; a tie goes to the longer match. A longer match ends
    where a shorter one does, so none is looked for past a length with no occurrence."""
    best, best_score = NO_DRAFT, 0.0
    for n in NGRAMS:
        if len(seq) < n:
            break
        occurrences = occurring(tuple(seq[-n:]))
        if not occurrences:
            break
        draft = follow(occurrences, g, MIN_PATH_PROB, PRIOR[n])
        if draft.tokens and draft.score >= best_score:
            best, best_score = draft, draft.score
    return best


def lookup(seq: list[int], g: int, index: RowIndex | None = None) -> Draft:
    """Prompt lookup over the row's own tokens, followed and scored like the job index:
    the newest MAX_CANDIDATES occurrences of its longest matching last n tokens (n in
    LOOKUP_NGRAMS).

    The occurrences of the last token are taken newest first, each extended back to its
    match length, until MAX_CANDIDATES matches of the longest length are found: from the
    row's ``index`` (RowIndex.occurrences: those of its last two tokens where they occur
    earlier), else by one scan back (list.index in C over the reversed tokens, as
    drafters.PromptLookup). The scorer proposes at every step, plain ones too: at 64 rows
    of 2,000 tokens of English a proposal took 6.3 ms with a scan in Python over every
    token, 4.9 ms with the scan in C, 3.6 ms with the rows' indexes (docs/benchmarks.md)."""
    N = len(seq)
    top = min(max(LOOKUP_NGRAMS), N - 1)  # a match of n tokens needs n + 1 of them
    if top < min(LOOKUP_NGRAMS):
        return NO_DRAFT
    last = seq[-1]
    hits: list[tuple[int, int]] = []  # (end, match length), newest first
    longest = 0
    for end in _scan(seq) if index is None else index.occurrences(seq):
        if seq[end] != last:  # a list changed in place under its index: not a match
            continue
        m = 1
        while m < top and end - m >= 0 and seq[end - m] == seq[N - 1 - m]:
            m += 1
        hits.append((end, m))
        longest += m == top
        if longest == MAX_CANDIDATES:
            break
    for n in LOOKUP_NGRAMS:
        if n <= top and (ends := [e for e, m in hits if m >= n]):
            return follow([(seq, e) for e in ends[:MAX_CANDIDATES]], g, prior=PRIOR[n])
    return NO_DRAFT


def _scan(seq: list[int]) -> Iterator[int]:
    """The earlier positions of seq's last token, newest first: list.index in C."""
    last, rev, i = seq[-1], seq[-2::-1], 0  # rev[i] = seq[N - 2 - i]
    while True:
        try:
            i = rev.index(last, i)
        except ValueError:
            return
        yield len(seq) - 2 - i
        i += 1


def _before(positions: list[int], N: int) -> Iterator[int]:
    """The positions before N - 1 of an ascending list, newest first."""
    k = len(positions) - 1
    while k >= 0 and positions[k] >= N - 1:
        k -= 1
    while k >= 0:
        yield positions[k]
        k -= 1


class RowIndex:
    """Where each token and each pair of tokens of one row end, kept up to date as the row
    grows: its lookup visits only the occurrences that can match, not every token
    (``lookup``). Built for rows of INDEXED_FROM tokens and more (a scan of fewer costs
    less than the dictionaries it would keep), caught up with the row at each proposal.
    It is bound to the first list it is handed (the engine hands each row's own list at
    every step, grown in place); another list (a grammar's one-row continuation of it) is
    scanned, not indexed."""

    def __init__(self) -> None:
        self.seq: list[int] | None = None  # the row's tokens, as the batch hands them
        self.ones: dict[int, list[int]] = {}  # token -> where it is, ascending
        self.pairs: dict[tuple[int, int], list[int]] = {}  # two tokens -> where they end
        self.n = 0  # tokens of the row indexed

    def catch_up(self, seq: list[int]) -> RowIndex | None:
        """Index seq's tokens past those indexed; None for a list it is not bound to."""
        if self.seq is None:
            self.seq = seq
        elif seq is not self.seq:
            return None
        if self.n > len(seq):  # shortened: indexed afresh
            self.ones, self.pairs, self.n = {}, {}, 0
        for i in range(self.n, len(seq)):
            self.ones.setdefault(seq[i], []).append(i)
            if i:
                self.pairs.setdefault((seq[i - 1], seq[i]), []).append(i)
        self.n = len(seq)
        return self

    def occurrences(self, seq: list[int]) -> Iterator[int]:
        """The earlier ends of seq's last two tokens, newest first, where there are any (the
        longest match is then 2 tokens or more, 2 is a length lookup tries, and only they
        can make it); else those of its last token (every match is then 1 token)."""
        N = len(seq)
        if N >= 3 and 2 in LOOKUP_NGRAMS:
            pairs = _before(self.pairs.get((seq[-2], seq[-1]), []), N)
            first = next(pairs, None)
            if first is not None:
                yield first
                yield from pairs
                return
        yield from _before(self.ones.get(seq[-1], []), N)


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
        def occurring(gram: tuple[int, ...]) -> list[tuple[list[int], int]]:
            ends = self.table.get(gram, [])
            return [(self.tokens, e - self.base) for e in ends[: -MAX_CANDIDATES - 1 : -1]]

        return best_over_ngrams(seq, g, occurring)


class _Running:
    """One running row of the batch as Siblings indexes it: its output starts at
    ``start``; ``n``: its tokens indexed so far; ``seq``: the list it is bound to."""

    __slots__ = ("start", "n", "seq", "live")

    def __init__(self, start: int, live: bool = True) -> None:
        self.start = start
        self.n = start
        self.seq: list[int] | None = None
        self.live = live


class Siblings:
    """The outputs of the batch's running rows, indexed for each other as the job index
    holds its finished rows: rows that rewrite one passage, fill one template or answer
    with one skeleton run side by side, and a row a few tokens ahead drafts for the rows
    behind it (half a job's rows at batch 16, all of them at 64, have no finished row yet).

    n-gram (n in NGRAMS, within a row's output) -> (row, where it ends), oldest first.
    Each row is caught up with its own list at every proposal (``catch_up``, bound to the
    first list as RowIndex is), so an occurrence's continuation is read off the row as it
    stands. A row that leaves is marked gone and its occurrences skipped until they are
    half of those held; then the table is built again from the rows still running. At
    most ``max_tokens`` output tokens are held."""

    def __init__(self, max_tokens: int = MAX_TOKENS) -> None:
        self.max_tokens = max_tokens
        self.rows: list[_Running] = []  # per batch row, in order
        self.table: dict[tuple[int, ...], list[tuple[_Running, int]]] = {}
        self.held = 0  # output tokens indexed, gone rows' included
        self.gone = 0  # of them, gone rows'

    def admit(self, prompts: list[list[int]]) -> None:
        self.rows += [_Running(len(p)) for p in prompts]

    def select(self, rows: list[int]) -> None:
        # a row never admitted (a caller out of step) is never indexed
        kept = [self.rows[b] if b < len(self.rows) else _Running(0, live=False) for b in rows]
        staying = {id(r) for r in kept}
        for r in self.rows:
            if id(r) not in staying:
                self._leave(r)
        self.rows = kept
        self._tidy()

    def reset(self) -> None:
        self.rows, self.table, self.held, self.gone = [], {}, 0, 0

    def catch_up(self, seqs: list[list[int]]) -> list[_Running | None]:
        """Index each row's tokens past those indexed; per row, its _Running, None where
        the list is not the row's own (another batch, a grammar's one-row continuation)."""
        if len(seqs) != len(self.rows):
            return [None] * len(seqs)
        own: list[_Running | None] = []
        for b, (r, seq) in enumerate(zip(self.rows, seqs)):
            if r.live and r.seq is None:
                r.seq = seq
            if not r.live or seq is not r.seq:
                own.append(None)
                continue
            if r.n > len(seq):  # shortened: its occurrences go, and it is indexed afresh
                self._leave(r)
                r = self.rows[b] = _Running(r.start)
                r.seq = seq
            self._index(r)
            own.append(r)
        self._tidy()
        return own

    def propose(self, seq: list[int], g: int, own: _Running | None) -> Draft:
        """The best-scored draft over the match lengths in NGRAMS, followed in the other
        running rows (not ``own``) where they go on past the match."""
        def occurring(gram: tuple[int, ...]) -> list[tuple[list[int], int]]:
            found: list[tuple[list[int], int]] = []
            for r, e in self.table.get(gram, [])[: -MAX_SCANNED - 1 : -1]:  # newest first
                if r.live and r is not own and r.seq is not None and e + 1 < len(r.seq):
                    found.append((r.seq, e))
                    if len(found) == MAX_CANDIDATES:
                        break
            return found

        return best_over_ngrams(seq, g, occurring)

    def _index(self, r: _Running) -> None:
        assert r.seq is not None
        seq, table = r.seq, self.table
        end = min(len(seq), r.n + max(0, self.max_tokens - (self.held - self.gone)))
        for j in range(r.n, end):
            for n in NGRAMS:
                if j - n + 1 < r.start:
                    break
                table.setdefault(tuple(seq[j - n + 1 : j + 1]), []).append((r, j))
        self.held += end - r.n
        r.n = end

    def _leave(self, r: _Running) -> None:
        if r.live:
            r.live = False
            self.gone += r.n - r.start

    def _tidy(self) -> None:
        """Build the table again once gone rows hold half of it."""
        if self.gone * 2 <= self.held:
            return
        live = [r for r in self.rows if r.live]
        self.table, self.held, self.gone = {}, 0, 0
        for r in live:
            r.n = r.start
            if r.seq is not None:
                self._index(r)


class SuffixDrafter:
    """Per row, the best-scored of prompt lookup's draft, the job index's and the running
    rows' (a point mass, no model). Its per-row state, in the batch's order (``admit``,
    ``select``, ``reset``): a RowIndex for each long row, a speed-up only (a proposal for
    rows not in step with them, another batch, a grammar's one-row continuation or a list
    that is not the row's own, scans instead), and each row's place in ``running``.
    ``reset`` forgets the rows, nothing of the job index."""

    name = "suffix"
    free = True  # costs little next to a target pass: may propose while g = 0 (shadow.py)
    scored = True  # its proposals carry per-token confidence (Proposal.confidence)
    races = False
    admits_unseen = True  # a row's index is built from its tokens when a proposal needs it

    def __init__(self, max_tokens: int = MAX_TOKENS) -> None:
        self.max_tokens = max_tokens
        self.jobs: OrderedDict[Hashable, JobIndex] = OrderedDict()  # least recent first
        self.job: Hashable = None
        self.use_job(None)
        self.rows: list[RowIndex] = []  # per batch row, in order
        self.running = Siblings(max_tokens)  # the batch's running rows, for each other

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
        rows = self.rows if len(self.rows) == len(batch.tokens) else [None] * len(batch.tokens)
        running = self.running.catch_up(batch.tokens)
        for seq, row, me in zip(batch.tokens, rows, running):
            index = row.catch_up(seq) if row is not None and len(seq) >= INDEXED_FROM else None
            own, job = lookup(seq, g, index), self.index.propose(seq, g)
            best = job if job.score > own.score else own
            sibling = self.running.propose(seq, g, me)
            drafts.append(sibling if sibling.score > best.score else best)
        return Proposal(padded([d.tokens for d in drafts], g, torch.long),
                        torch.tensor([len(d.tokens) for d in drafts], dtype=torch.long),
                        None, padded([d.probs for d in drafts], g, torch.float32))

    def admit(self, prompts: list[list[int]], first_tokens: list[int]) -> None:
        self.rows += [RowIndex() for _ in prompts]
        self.running.admit(prompts)

    def select(self, rows: torch.Tensor) -> None:
        kept = rows.tolist()
        # a row it never admitted (a caller out of step) starts an index afresh
        self.rows = [self.rows[b] if b < len(self.rows) else RowIndex() for b in kept]
        self.running.select(kept)

    def update(self, accepted: list[int], tokens: list[list[int]]) -> None: ...
    def compact(self) -> None: ...

    def reset(self) -> None:
        self.rows = []
        self.running.reset()
