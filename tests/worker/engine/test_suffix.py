"""The job-level suffix drafter: its index (matching, scoring, eviction, the memory bound)
and the engine carrying it from one generation of a job to the next."""

from __future__ import annotations

import random

import pytest
import torch

from specq.schema.generation import Request
from specq.worker.engine import suffix
from specq.worker.engine.drafters import DraftInputs, PromptLookup
from specq.worker.engine.speculative import SpeculativeEngine
from specq.worker.engine.suffix import (
    END,
    LOOKUP_NGRAMS,
    MAX_CANDIDATES,
    MAX_SCANNED,
    NGRAMS,
    PRIOR,
    JobIndex,
    RowIndex,
    Siblings,
    SuffixDrafter,
    follow,
    lookup,
)


def _inputs(*seqs: list[int]) -> DraftInputs:
    B = len(seqs)
    zeros = torch.zeros(B, dtype=torch.long)
    return DraftInputs([list(s) for s in seqs], zeros, zeros.float(), zeros, torch.ones(B),
                       greedy=True)


def _consistent(index: JobIndex) -> None:
    """Every position in the table lies in what is held and ends its n-gram."""
    for key, ends in index.table.items():
        assert ends == sorted(ends)
        for e in ends:
            i = e - index.base
            assert len(key) - 1 <= i < index.size
            assert index.tokens[i - len(key) + 1 : i + 1] == list(key)
    assert index.size == sum(index.lengths)
    assert index.tokens.count(END) == len(index.lengths)


def test_frequency_weighted_continuation():
    index = JobIndex()
    for seq in ([1, 2, 3, 4, 5], [1, 2, 3, 4, 6], [1, 2, 3, 4, 5]):
        index.add(seq)
    # (2, 3) ends 3 times, always followed by 4 (3 of 3), then 5 twice of 3; each share
    # smoothed by two occurrences at the prior of a match of 2 tokens
    draft = index.propose([9, 2, 3], 4)
    assert draft.tokens == [4, 5]  # then END: nothing follows
    first, second = (3 + 2 * PRIOR[2]) / 5, (2 + 2 * PRIOR[2]) / 5
    assert draft.probs == pytest.approx([first, second])
    assert draft.score == pytest.approx(first + first * second)
    assert index.propose([9, 9, 7], 4) == ([], [])  # no match anywhere
    _consistent(index)


def test_a_tie_goes_to_the_newest_and_a_weak_path_stops():
    index = JobIndex()
    index.add([1, 2, 7])
    index.add([1, 2, 8])
    assert index.propose([2], 1)[0] == [8]
    index = JobIndex()
    for last in range(20):  # twenty different continuations: each 2/22, under MIN_PATH_PROB
        index.add([5, 6, last])
    assert index.propose([5, 6], 3) == ([], [])


def test_longer_matches_win_ties_and_only_the_newest_candidates_count():
    index = JobIndex()
    for i in range(MAX_CANDIDATES + 10):  # old rows continue 1, 2 with 3; new ones with 4
        index.add([1, 2, 3 if i < 10 else 4])
    draft, _ = index.propose([1, 2], 1)
    assert draft == [4]
    ends = index.table[(1, 2)]
    assert len(ends) == MAX_CANDIDATES + 10


def test_own_lookup_is_prompt_lookup_where_matches_are_unique():
    pl = PromptLookup()
    gen = random.Random(0)
    for _ in range(50):
        seq = gen.sample(range(1000), 30)
        seq += seq[gen.randrange(0, 25):][:gen.randrange(1, 5)]  # one repeat, unique tokens
        want = pl.lookup(seq, 4)
        assert lookup(seq, 4)[0] == want


def _unfold_lookup(seq: list[int], g: int, max_ngram: int, min_ngram: int) -> list[int]:
    """Prompt lookup as it was written first, in torch ops: every window of n tokens
    compared at once, the last hit taken."""
    t = torch.tensor(seq)
    N = t.shape[0]
    for n in range(max_ngram, min_ngram - 1, -1):
        if N <= n:
            continue
        hits = (t[:-1].unfold(0, n, 1) == t[-n:]).all(1).nonzero()
        if hits.numel():
            start = int(hits[-1]) + n
            return t[start : start + g].tolist()
    return []


@pytest.mark.parametrize("ngrams", [(3, 1), (2, 1), (3, 2), (4, 4)])
def test_prompt_lookups_scan_finds_what_every_window_compared_finds(ngrams):
    """The list scan (one pass back over the last token's occurrences) against the windows
    compared all at once: the same continuation for any sequence, repeats and overlaps
    included (a vocabulary of 4 tokens repeats everything), any length from 0."""
    gen = random.Random(1)
    pl = PromptLookup(*ngrams)
    for _ in range(3000):
        seq = [gen.randrange(gen.choice([2, 4, 50])) for _ in range(gen.randrange(0, 40))]
        g = gen.randrange(0, 6)
        assert pl.lookup(seq, g) == _unfold_lookup(seq, g, *ngrams), seq


def _every_token_lookup(seq: list[int], g: int) -> tuple[list[int], list[float]]:
    """The row's own lookup as it was written first: every earlier occurrence of the last
    token found by a scan in Python, then filtered by each match length."""
    N = len(seq)
    if N < 2:
        return [], []
    hits = [i for i in range(N - 2, -1, -1) if seq[i] == seq[-1]]  # newest first
    for n in LOOKUP_NGRAMS:
        if N <= n:
            continue
        ends = [i for i in hits if i >= n - 1 and seq[i - n + 1 : i + 1] == seq[-n:]]
        if ends:
            return follow([(seq, e) for e in ends[:MAX_CANDIDATES]], g, prior=PRIOR[n])
    return [], []


def test_own_lookups_scan_and_index_find_what_every_token_compared_finds():
    """The scan back over the last token's occurrences, and a RowIndex's list of them (each
    stopping at MAX_CANDIDATES of the longest match), against every token compared: the
    same draft and probabilities for any sequence, short ones, repeats and overlaps
    included (2 tokens: far more than MAX_CANDIDATES matches of every length)."""
    gen = random.Random(2)
    for _ in range(3000):
        seq = [gen.randrange(gen.choice([2, 4, 50])) for _ in range(gen.randrange(0, 300))]
        g = gen.randrange(0, 9)
        want = tuple(_every_token_lookup(seq, g))
        assert tuple(lookup(seq, g)) == want, seq
        assert tuple(lookup(seq, g, RowIndex().catch_up(seq))) == want, seq


def test_the_rows_indexes_follow_the_batch_and_never_change_a_proposal():
    """Rows past INDEXED_FROM tokens keep a RowIndex in the batch's order (admit, select);
    every proposal equals a stateless drafter's as the rows grow by steps of any length,
    leave and join, and where a caller is out of step (another batch, another list in a
    row's place: scanned) nothing but the scan's drafts come out. (The running rows'
    drafts for each other are held off here: the stateless drafter has no rows.)"""
    gen = random.Random(4)
    kept, plain = SuffixDrafter(), SuffixDrafter()
    kept.running = Siblings(max_tokens=0)
    done = [gen.randrange(20) for _ in range(600)]
    for d in (kept, plain):
        d.finish(done)

    def text(n: int) -> list[int]:
        return [gen.randrange(gen.choice([3, 20, 300])) for _ in range(n)]

    def propose(d: SuffixDrafter, rows: list[list[int]]) -> tuple:
        z = torch.zeros(len(rows), dtype=torch.long)
        p = d.propose(DraftInputs(rows, z, z.float(), z, torch.ones(len(rows)), greedy=True),
                      8)
        return p.token_ids.tolist(), p.num_draft.tolist(), p.confidences

    rows = [text(gen.randrange(400, 700)) for _ in range(5)]
    kept.admit(rows, [r[-1] for r in rows])
    for step in range(60):
        assert propose(kept, rows) == propose(plain, rows)
        for r in rows:
            r += text(gen.randrange(1, 9))
        if step % 7 == 3:  # two rows leave, the rest in another order; one joins
            order = [len(rows) - 1, 0, 2]
            kept.select(torch.tensor(order))
            rows = [rows[b] for b in order] + [text(gen.randrange(300, 900))]
            kept.admit(rows[-1:], [rows[-1][-1]])
        if step % 11 == 5:  # another list in a row's place: scanned, not indexed
            bound = kept.rows[0].seq is not None
            rows[0] = list(rows[0][:-1]) + [rows[0][-1] + 1]
            assert (kept.rows[0].catch_up(rows[0]) is None) == bound
    assert sum(len(r.ones) > 0 for r in kept.rows) >= 1  # the long rows were indexed
    other = [text(800) for _ in range(len(rows) + 1)]  # a batch of another size
    assert propose(kept, other) == propose(plain, other)
    kept.reset()
    assert kept.rows == []


def _follow_counting_every_token(tokens: list[int], base: int, ends: list[int], g: int,
                                 min_prob: float) -> tuple[list[int], list[float]]:
    """``follow`` as it was written first: the occurrences counted at every token, one
    left or many."""
    draft: list[int] = []
    probs: list[float] = []
    path, limit = 1.0, len(tokens) + base
    for _ in range(g):
        counts: dict[int, int] = {}
        for e in ends:
            t = tokens[e + 1 - base] if e + 1 < limit else END
            if t != END:
                counts[t] = counts.get(t, 0) + 1
        if not counts:
            break
        best = max(counts, key=counts.__getitem__)
        p = (counts[best] + 1) / (len(ends) + 2)
        if path * p < min_prob:
            break
        path *= p
        draft.append(best)
        probs.append(p)
        ends = [e + 1 for e in ends if e + 1 < limit and tokens[e + 1 - base] == best]
    return draft, probs


def test_follow_reads_a_lone_occurrence_as_counting_would():
    """One occurrence left is read off in one slice: the same draft and probabilities as
    counting at every token, up to END, the end of the tokens, g or MIN_PATH_PROB."""
    gen = random.Random(5)
    for _ in range(5000):
        base = gen.randrange(0, 50)
        tokens = [END if gen.random() < 0.05 else gen.randrange(gen.choice([2, 3, 20]))
                  for _ in range(gen.randrange(1, 80))]
        ends = sorted(gen.sample(range(base, base + len(tokens)),
                                 min(len(tokens), gen.randrange(1, 6))), reverse=True)
        g, min_prob = gen.randrange(0, 9), gen.choice([0.0, 0.1, 0.3])
        want = _follow_counting_every_token(tokens, base, ends, g, min_prob)
        assert tuple(follow([(tokens, e - base) for e in ends], g, min_prob)) == want


def test_the_drafter_takes_the_better_scored_draft_per_row():
    d = SuffixDrafter()
    for _ in range(5):
        d.finish([1, 2, 3, 4, 5, 6])
    # row 0: the job index knows (3, 4) -> 5 6 five times; its own tokens: 3 4 -> 9 once
    # row 1: nothing in the index; its own tokens repeat 7 8 -> 9
    prop = d.propose(_inputs([3, 4, 9, 3, 4], [7, 8, 9, 7, 8]), 3)
    assert prop.num_draft.tolist() == [2, 3]
    assert prop.token_ids[0, :2].tolist() == [5, 6]
    assert prop.token_ids[1].tolist() == [9, 7, 8]
    assert prop.probs is None  # point masses
    # each token's smoothed share after a match of 2 tokens: row 0 follows 5 occurrences,
    # row 1 its one
    row0, row1 = prop.confidences
    assert row0 == pytest.approx([(5 + 2 * PRIOR[2]) / 7] * 2)
    assert row1 == pytest.approx([(1 + 2 * PRIOR[2]) / 3] * 3)


def test_a_longer_match_is_followed_with_more_confidence():
    """One earlier occurrence each: after a match of 3 tokens the continuation is trusted
    more than after a match of 1 (PRIOR grows with the match's length), in the row's own
    lookup as in the job index."""
    assert list(PRIOR.values()) == sorted(PRIOR.values()) and set(NGRAMS) <= set(PRIOR)
    long, short = lookup([5, 6, 7, 9, 5, 6, 7], 1), lookup([1, 2, 3, 7, 9, 4, 5, 6, 7], 1)
    assert long.tokens == short.tokens == [9]
    assert long.probs == pytest.approx([(1 + 2 * PRIOR[3]) / 3])
    assert short.probs == pytest.approx([(1 + 2 * PRIOR[1]) / 3])
    index = JobIndex()
    index.add([1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert index.propose([0, 1, 2, 3, 4, 5, 6, 7], 1).probs == pytest.approx(
        [(1 + 2 * PRIOR[4]) / 3])  # 8 tokens do not match; 4 do
    assert index.propose([0, 0, 0, 7], 1).probs == pytest.approx([(1 + 2 * PRIOR[1]) / 3])


def test_eviction_keeps_the_table_exact():
    index = JobIndex()
    gen = random.Random(1)
    seqs = [[gen.randrange(6) for _ in range(gen.randrange(1, 12))] for _ in range(20)]
    for s in seqs:
        index.add(s)
    for k in range(19):
        index.evict_oldest()
        _consistent(index)
        fresh = JobIndex()
        for s in seqs[k + 1 :]:
            fresh.add(s)
        assert [len(v) for v in index.table.values()] == [len(fresh.table[key]) for key in
                                                          index.table]
        assert index.table.keys() == fresh.table.keys()
        assert index.propose(seqs[-1][:3], 4) == fresh.propose(seqs[-1][:3], 4)


def test_memory_is_bounded_over_many_jobs():
    """A worker serving job after job: the index never holds more than max_tokens, the
    least recently used job goes first, and the current job keeps its newest rows."""
    cap = 300
    d = SuffixDrafter(max_tokens=cap)
    gen = random.Random(2)
    for job in range(40):
        d.use_job(job)
        for _ in range(gen.randrange(1, 12)):
            d.finish([gen.randrange(50) for _ in range(gen.randrange(1, 40))])
            assert d.size <= cap
        for index in d.jobs.values():
            _consistent(index)
    assert list(d.jobs)[-1] == 39 and 0 not in d.jobs
    d.use_job("big")
    rows = [[7] * 30 + [i] for i in range(20)]  # 20 rows of 32 tokens: only the newest fit
    for row in rows:
        d.finish(row)
    assert list(d.jobs) == ["big"] and d.size <= cap
    assert d.index.tokens[-32:-1] == rows[-1]
    d.finish(list(range(cap)))  # longer than the bound: not indexed, nothing evicted
    assert d.index.tokens[-32:-1] == rows[-1]


def _requests(n: int, offset: int = 0, max_new: int = 24) -> list[Request]:
    """Prompts sharing a long prefix: the tiny target's outputs repeat from row to row."""
    return [Request(id=i, prompt_token_ids=[5, 6, 7, 8, 9, 10] * 3 + [20 + (i + offset) % 7],
                    max_new_tokens=max_new) for i in range(n)]


def _accepted(results) -> int:
    return sum(r.counters.accepted for r in results)


def test_the_index_carries_across_generations_of_a_job_only(tiny_models, tiny_tokenizer,
                                                            check_greedy):
    drafter = SuffixDrafter()
    engine = SpeculativeEngine(tiny_models["target"], tiny_tokenizer, drafter,
                               max_batch_size=3, draft_length=4, adaptive=False)
    first, second = _requests(6), _requests(6, offset=3)
    a1 = engine.generate(first, job="a")
    assert drafter.jobs["a"].size == sum(len(r.prompt_token_ids) + len(x.token_ids) + 1
                                         for r, x in zip(first, a1))
    a2 = engine.generate(second, job="a")  # the second chunk of job a
    b1 = engine.generate(second, job="b")  # the same prompts as another job's first chunk
    for reqs, results in ((first, a1), (second, a2), (second, b1)):
        assert check_greedy(reqs, results) == 0
    assert set(drafter.jobs) == {None, "a", "b"}
    assert _accepted(a2) > _accepted(b1)  # job a's chunk drafts from its first chunk
    fresh = SpeculativeEngine(tiny_models["target"], tiny_tokenizer, SuffixDrafter(),
                              max_batch_size=3, draft_length=4, adaptive=False)
    same = fresh.generate(second, job="b")  # job b knew nothing of job a
    assert [r.counters.accepted for r in same] == [r.counters.accepted for r in b1]


class _Failing(SuffixDrafter):
    """Fails on its n-th proposal, as a device fault would strike mid-generation."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.left = n

    def propose(self, batch, g):
        self.left -= 1
        if self.left == 0:
            raise RuntimeError("injected fault")
        return super().propose(batch, g)


def test_rows_of_a_failed_generation_add_nothing(tiny_models, tiny_tokenizer):
    drafter = _Failing(12)
    engine = SpeculativeEngine(tiny_models["target"], tiny_tokenizer, drafter,
                               max_batch_size=3, draft_length=2, adaptive=False)
    finished = []
    requests = [r.model_copy(update={"max_new_tokens": 4 + 6 * i}) for i, r in
                enumerate(_requests(6))]
    with pytest.raises(RuntimeError, match="injected"):
        engine.generate(requests, on_result=finished.append, job="j")
    assert 0 < len(finished) < len(requests)
    by_id = {r.id: r for r in requests}
    assert drafter.jobs["j"].size == sum(
        len(by_id[x.id].prompt_token_ids) + len(x.token_ids) + 1 for x in finished)
    assert drafter.running.rows and drafter.running.table  # the rows running at the fault
    engine.reset()  # as the worker does after a fault: rows go, the job's index stays
    assert drafter.jobs["j"].size > 0
    assert (drafter.running.rows, drafter.running.table, drafter.running.held) == ([], {}, 0)


@pytest.mark.parametrize("bs", [1, 3])
def test_greedy_with_a_warm_index_equals_the_target(bs, tiny_models, tiny_tokenizer,
                                                    make_requests, check_greedy):
    """Drafts from the job index (not only prompt lookup's), with refill, stay exact."""
    drafter = SuffixDrafter()
    for adaptive in (False, True):
        engine = SpeculativeEngine(tiny_models["target"], tiny_tokenizer, drafter,
                                   max_batch_size=bs, draft_length=4, adaptive=adaptive)
        engine.generate(_requests(5), job="warm")
        requests = make_requests(8, seed=4) + _requests(5, offset=2)
        results = engine.generate(requests, job="warm")
        assert check_greedy(requests, results) <= 1
        if not adaptive:  # (the adaptive engine may judge drafting not worth it here)
            assert _accepted(results[8:]) > 0


@pytest.mark.parametrize("bs", [1, 3])
def test_the_engine_keeps_each_rows_index_in_step(bs, monkeypatch, tiny_models, tiny_tokenizer,
                                                  make_requests, check_greedy):
    """Every row indexed (INDEXED_FROM 1): through refills, rows that end apart and a second
    generation, every row's index stays bound to that row's own list (the rows' order
    kept), each proposal equals what the scan proposes from the same job index, and greedy
    output stays the target's."""
    monkeypatch.setattr(suffix, "INDEXED_FROM", 1)
    drafter, twin = SuffixDrafter(), SuffixDrafter()
    twin.jobs = drafter.jobs  # the same job index; no rows of its own: it scans
    drafter.running = Siblings(max_tokens=0)  # the running rows' drafts: the test below
    real, in_step = drafter.propose, []

    def checked(batch: DraftInputs, g: int):
        twin.job = drafter.job
        got, want = real(batch, g), twin.propose(batch, g)
        assert got.token_ids.tolist() == want.token_ids.tolist()
        assert got.num_draft.tolist() == want.num_draft.tolist()
        assert got.confidences == want.confidences
        # every row's index bound to that row's own list
        in_step.append(all(r.seq is s for r, s in zip(drafter.rows, batch.tokens))
                       and len(drafter.rows) == len(batch.tokens))
        return got

    monkeypatch.setattr(drafter, "propose", checked)
    engine = SpeculativeEngine(tiny_models["target"], tiny_tokenizer, drafter,
                               max_batch_size=bs, draft_length=4, adaptive=False)
    for job in range(2):
        requests = make_requests(7, seed=job) + _requests(4, offset=job, max_new=16 + 4 * job)
        results = engine.generate(requests, job="rows")
        assert check_greedy(requests, results) <= 1
    assert in_step and all(in_step) and _accepted(results) > 0


def _live_table(sib: Siblings) -> dict[tuple[int, ...], list[tuple[int, int]]]:
    """The table's live occurrences as (batch row, position), sorted: what any order of
    indexing the same rows must hold."""
    where = {id(r): b for b, r in enumerate(sib.rows)}
    out: dict[tuple[int, ...], list[tuple[int, int]]] = {}
    for key, occ in sib.table.items():
        live = sorted((where[id(r)], e) for r, e in occ if r.live)
        if live:
            out[key] = live
    return out


def test_running_rows_indexed_step_by_step_hold_what_a_fresh_index_holds():
    """Rows that grow by steps of any length, leave, join, and one cut short: the
    incremental table's live occurrences equal those of a table built afresh on the rows
    as they stand, only outputs indexed (never a prompt's n-grams), gone rows' occurrences
    dropped when they are half the table."""
    gen = random.Random(6)
    sib = Siblings()

    def text(n: int) -> list[int]:
        return [gen.randrange(gen.choice([3, 20])) for _ in range(n)]

    prompts = [text(gen.randrange(1, 30)) for _ in range(4)]
    rows = [p + text(1) for p in prompts]
    sib.admit(prompts)
    for step in range(80):
        sib.catch_up(rows)
        fresh = Siblings()
        fresh.admit(prompts)
        fresh.catch_up(rows)
        assert _live_table(sib) == _live_table(fresh)
        assert sib.held - sib.gone == sum(len(r) - len(p) for r, p in zip(rows, prompts))
        assert sib.gone * 2 <= sib.held or step == 0
        for r in rows:
            r += text(gen.randrange(1, 6))
        if step % 9 == 4:  # two rows leave, the rest reordered; two join
            order = list(range(len(rows)))[2:][::-1]
            sib.select(order)
            rows, prompts = [rows[b] for b in order], [prompts[b] for b in order]
            new = [text(gen.randrange(1, 30)) for _ in range(2)]
            sib.admit(new)
            prompts += new
            rows += [p + text(1) for p in new]
        if step % 13 == 7:  # a row cut short in place (a stop string's tail taken back)
            del rows[0][len(prompts[0]) + 1 :]


def test_a_row_drafts_what_a_running_row_ahead_of_it_wrote_never_its_own():
    """Two rows fill one template side by side: the one behind drafts the rest of the
    skeleton from the one ahead; a row alone in the batch gets nothing from itself, and a
    row that left is followed no more."""
    d = SuffixDrafter()
    prompts = [[90, 91], [92, 93]]
    d.admit(prompts, [1, 1])
    ahead = prompts[0] + [1, 2, 3, 4, 5, 6]
    behind = prompts[1] + [1, 2]
    prop = d.propose(DraftInputs([ahead, behind], *(torch.zeros(2),) * 4, greedy=True), 3)
    assert prop.num_draft.tolist() == [0, 3]
    assert prop.token_ids[1].tolist() == [3, 4, 5]
    # one occurrence after a match of 2 tokens (1, 2)
    assert prop.confidences[1] == pytest.approx([(1 + 2 * PRIOR[2]) / 3] * 3)
    d.select(torch.tensor([1]))  # the row ahead left (failed: nothing in the job index)
    behind += [3]
    prop = d.propose(DraftInputs([behind], *(torch.zeros(1),) * 4, greedy=True), 3)
    assert prop.num_draft.tolist() == [0]


def test_running_rows_index_at_most_max_tokens_of_output():
    sib = Siblings(max_tokens=10)
    rows = [[7] + list(range(8)), [8] + list(range(8))]
    sib.admit([[7], [8]])
    sib.catch_up(rows)
    assert sib.held == 10 and [r.n for r in sib.rows] == [9, 3]
    sib.select([1])  # the first leaves: its 8 go, the second is indexed on
    sib.catch_up(rows[1:])
    assert sib.held - sib.gone == 8 and sib.rows[0].n == 9


@pytest.mark.parametrize("bs", [2, 4])
def test_the_engine_keeps_the_running_rows_index_in_step(bs, monkeypatch, tiny_models,
                                                         tiny_tokenizer, make_requests,
                                                         check_greedy):
    """Through refills, rows that end apart and a second generation, every running row is
    bound to that row's own list, its output start is its prompt's length, the table holds
    what a table built afresh on the rows holds, rows draft from each other, and greedy
    output stays the target's."""
    drafter = SuffixDrafter()
    real, checks, drafted = drafter.propose, [], []
    prompts: set[tuple[int, ...]] = set()

    def checked(batch: DraftInputs, g: int):
        got = real(batch, g)
        sib = drafter.running
        if len(sib.rows) == len(batch.tokens):
            assert all(tuple(seq[: r.start]) in prompts for r, seq in zip(sib.rows, batch.tokens))
            fresh = Siblings()
            fresh.admit([seq[: r.start] for r, seq in zip(sib.rows, batch.tokens)])
            fresh.catch_up(batch.tokens)
            checks.append(all(r.seq is seq for r, seq in zip(sib.rows, batch.tokens))
                          and _live_table(sib) == _live_table(fresh))
            drafted.append(sum(sib.propose(seq, g, r).tokens != []
                               for r, seq in zip(sib.rows, batch.tokens)))
        return got

    monkeypatch.setattr(drafter, "propose", checked)
    engine = SpeculativeEngine(tiny_models["target"], tiny_tokenizer, drafter,
                               max_batch_size=bs, draft_length=4, adaptive=False)
    for job in range(2):
        requests = _requests(6, offset=job, max_new=16 + 4 * job) + make_requests(3, seed=job)
        prompts.clear()
        prompts.update(tuple(r.prompt_token_ids or ()) for r in requests)
        results = engine.generate(requests, job=f"siblings {job}")
        assert check_greedy(requests, results) <= 1
    assert checks and all(checks) and sum(drafted) > 0


def test_a_row_repeating_itself_is_not_scanned_whole_at_every_proposal():
    """The running rows' occurrences of a match are looked at newest first, MAX_SCANNED of
    them: a row that repeated one token more often than that hides an older sibling's
    occurrence from itself (a draft forgone: its own lookup has the repeat anyway), and the
    scan stays bounded however long the row repeats."""
    def sibling_draft(repeats: int) -> list[int]:
        d = SuffixDrafter()
        d.admit([[90], [91]], [5, 5])
        sibling, looping = [90, 5, 6], [91] + [5] * repeats  # the sibling indexed first
        d.propose(DraftInputs([sibling, looping], *(torch.zeros(2),) * 4, greedy=True), 2)
        return d.running.propose(looping, 2, d.running.rows[1]).tokens

    assert sibling_draft(10) == [6]  # its own 5s skipped, the sibling's 5 -> 6 found
    assert sibling_draft(MAX_SCANNED + 10) == []  # the newest MAX_SCANNED are its own
