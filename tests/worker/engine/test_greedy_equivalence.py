"""Greedy speculative output equals target-only greedy `generate`, at every batch size."""

import logging

import pytest

from specq.worker.engine import packed, speculative
from specq.worker.engine.batch import LAZY_SHARE, MIN_WASTE, WASTE_SHARE, KVRows
from specq.worker.engine.drafters import DraftModel, NoDraft, PromptLookup
from specq.worker.engine.speculative import SpeculativeEngine
from specq.worker.engine.suffix import SuffixDrafter

log = logging.getLogger(__name__)
BATCH_SIZES = [1, 2, 7, 16]


def _drafter(name, models):
    if name == "none":
        return NoDraft()
    if name == "prompt_lookup":
        return PromptLookup()
    if name == "suffix":
        return SuffixDrafter()
    return DraftModel(models[name])


@pytest.mark.parametrize("drafter", ["near", "noisy", "unrelated", "prompt_lookup", "suffix",
                                     "none"])
def test_greedy_equals_target_generate(drafter, tiny_models, tiny_tokenizer, make_requests,
                                       check_greedy):
    mix = make_requests(24, seed=1)
    ties, accepted, proposed = 0, {}, {}
    for bs in BATCH_SIZES:
        # one row at a time, each request runs alone whatever the mix: a third of it says
        # as much (and costs half the test)
        requests = mix[:8] if bs == 1 else mix
        engine = SpeculativeEngine(tiny_models["target"], tiny_tokenizer,
                                   _drafter(drafter, tiny_models), max_batch_size=bs,
                                   draft_length=4, adaptive=False)
        results = engine.generate(requests)
        ties += check_greedy(requests, results)
        adaptive = SpeculativeEngine(tiny_models["target"], tiny_tokenizer,
                                     _drafter(drafter, tiny_models), max_batch_size=bs)
        ties += check_greedy(requests, adaptive.generate(requests))
        accepted[bs] = sum(r.counters.accepted for r in results)
        proposed[bs] = sum(r.counters.proposed for r in results)
    log.warning("drafter %s: near-tie divergences %d; accepted/proposed per batch size %s",
                drafter, ties, {bs: f"{accepted[bs]}/{proposed[bs]}" for bs in BATCH_SIZES})
    assert ties <= 2
    if drafter == "near":  # the drafts really were used, and mostly accepted
        assert all(accepted[bs] > 0.7 * proposed[bs] for bs in BATCH_SIZES)
    if drafter in ("noisy", "prompt_lookup", "suffix"):
        assert all(0 < accepted[bs] < proposed[bs] for bs in BATCH_SIZES)


@pytest.mark.parametrize("g", [1, 2, 7])
def test_draft_lengths(g, tiny_models, tiny_tokenizer, make_requests, check_greedy):
    requests = make_requests(12, seed=2)
    engine = SpeculativeEngine(tiny_models["target"], tiny_tokenizer,
                               DraftModel(tiny_models["noisy"]), max_batch_size=5,
                               draft_length=g, adaptive=False)
    assert check_greedy(requests, engine.generate(requests)) <= 1


def test_long_runs_compact_the_caches(tiny_models, tiny_tokenizer, make_requests, check_greedy,
                                      monkeypatch):
    """Many rejected columns force compaction mid-run; output stays exact. Transformers'
    forward: the packed one writes over a row's rejected columns (test below)."""
    monkeypatch.setenv(packed.ENV, "0")
    requests = make_requests(6, seed=3, max_new=200)
    for r in requests:
        r.max_new_tokens = 150 + int(r.id) * 10
    engine = SpeculativeEngine(tiny_models["target"], tiny_tokenizer,
                               DraftModel(tiny_models["unrelated"]), max_batch_size=3,
                               draft_length=6)
    assert check_greedy(requests, engine.generate(requests)) <= 1


@pytest.mark.parametrize("packing", [False, True])
def test_the_target_cache_compacts_early_without_a_sync_of_its_own(
        packing, tiny_models, tiny_tokenizer, make_requests, check_greedy, greedy_reference,
        monkeypatch):
    """The step reads the target cache's waste with its tokens (the one sync): that cache
    never counts its waste itself, compacts once the waste reaches WASTE_SHARE of it (the
    lazy bar, half, would have let holes pile up), and the output stays exact. Through the
    packed forward, where each row's next pass writes over its rejected columns, the target
    cache never has holes to compact."""
    monkeypatch.setenv(packed.ENV, "1" if packing else "0")
    target = tiny_models["target"]
    counted, gathered = [], []
    count, gather = KVRows.waste, KVRows._gather
    monkeypatch.setattr(KVRows, "waste", lambda kv: counted.append(kv.model) or count(kv))

    def spy(kv, waste):
        gathered.append((kv.model, waste, kv.length))
        return gather(kv, waste)

    monkeypatch.setattr(KVRows, "_gather", spy)
    requests = make_requests(6, seed=3, max_new=120)
    engine = SpeculativeEngine(target, tiny_tokenizer, DraftModel(tiny_models["unrelated"]),
                               max_batch_size=3, draft_length=4, adaptive=False)
    assert check_greedy(requests, engine.generate(requests)) <= 1
    assert target not in counted and counted  # the draft model's cache counts (lazily)
    mine = [(w, n) for m, w, n in gathered if m is target]
    if packing:
        assert not mine
        return
    assert mine and all(w >= max(MIN_WASTE, int(n * WASTE_SHARE)) for w, n in mine), mine
    assert any(w < n * LAZY_SHARE for w, n in mine), mine  # earlier than the lazy bar


def test_refills_wait_for_a_group_and_share_its_prefill(tiny_models, tiny_tokenizer,
                                                        make_requests, check_greedy,
                                                        monkeypatch):
    """Rows finishing one by one: with admit_group 3 the waiting requests join three at a
    time, in fewer prefills than one per row, the batch never below max - 3 + 1 rows
    while requests wait, and the output is the same (the group alone: no refill waits for
    a row sure to end, REFILL_HOLD, test below). Refills prefilled in a pass of their own,
    as a draft model's or transformers' forward has them (not joining the running pass:
    test_join.py)."""
    requests = [r.model_copy(update={"max_new_tokens": r.max_new_tokens + 1})  # none ends
                for r in make_requests(30, seed=9, max_new=24)]  # at its prefill
    sizes: dict[int, list[int]] = {}
    monkeypatch.setattr(speculative, "REFILL_HOLD", 10**9)

    def run(group: int) -> SpeculativeEngine:
        sizes[group] = []
        engine = SpeculativeEngine(tiny_models["target"], tiny_tokenizer, PromptLookup(),
                                   max_batch_size=8, draft_length=2, adaptive=False,
                                   admit_group=group, join_refills=False,
                                   on_step=lambda step: sizes[group].append(len(step.accepted)))
        check_greedy(requests, engine.generate(requests))
        return engine

    one, grouped = run(1), run(3)
    print(f"admissions: group 1 {one.admissions}, group 3 {grouped.admissions}")
    assert grouped.admissions < 0.6 * one.admissions
    full_until = len(sizes[3]) - max(r.max_new_tokens for r in requests)  # waiting ran out
    assert min(sizes[3][:full_until]) >= 8 - 3 + 1
    assert SpeculativeEngine(tiny_models["target"], tiny_tokenizer, max_batch_size=16
                             ).admit_group == 4  # by default a quarter of the batch


def test_a_refill_waits_for_a_row_sure_to_end_within_a_few_steps(
        tiny_models, tiny_tokenizer, make_requests, check_greedy, greedy_reference,
        monkeypatch):
    """Rows whose ends are a step apart (max_new_tokens 10, 11, 12, ...: as speculation
    staggers rows that would end together): a lone place waits for the row sure to end
    next (REFILL_HOLD), so the refills go two at a time, the batch is never more than one
    row short while requests wait, and the output is the same."""
    candidates = [r.model_copy(update={"max_new_tokens": 13})
                  for r in make_requests(48, seed=4, max_new=8)]
    long = [r for r in candidates if len(greedy_reference(r)) == 13]  # no EOS in 13 tokens
    requests = [r.model_copy(update={"max_new_tokens": 10 + i % 4})
                for i, r in enumerate(long[:16])]
    assert len(requests) == 16
    sizes: list[int] = []

    def run() -> SpeculativeEngine:
        sizes.clear()
        engine = SpeculativeEngine(tiny_models["target"], tiny_tokenizer, NoDraft(),
                                   max_batch_size=4, draft_length=0, join_refills=False,
                                   on_step=lambda step: sizes.append(len(step.accepted)))
        out = engine.generate(requests)
        assert not any(r.finish_reason == "stop" for r in out)  # every end is its length
        check_greedy(requests, out)
        return engine

    held = run()
    waiting_until = len(sizes) - 13  # the last refill's rows run at most 13 steps
    assert held.admit_group == 1 and min(sizes[:waiting_until]) >= 4 - 1, sizes
    monkeypatch.setattr(speculative, "REFILL_HOLD", 10**9)  # no hold: a refill a place
    alone = run()
    print(f"admissions: held {held.admissions}, a place each {alone.admissions}")
    assert alone.admissions >= 13 and held.admissions <= 0.6 * alone.admissions


def test_one_token_rows_share_a_prefill_within_its_token_bound(tiny_models, tiny_tokenizer,
                                                              make_requests, check_greedy,
                                                              monkeypatch):
    """Requests of one new token take no place, so many of them join one prefill past the
    batch's places; the rows past a batch's worth hold at most ONE_TOKEN_TOKENS prompt tokens
    per place, and each answer is the target's own first greedy token."""
    requests = make_requests(40, seed=4)
    for req in requests:
        req.max_new_tokens = 1
    tokens = {req.id: len(req.prompt_token_ids) for req in requests}
    engine = SpeculativeEngine(tiny_models["target"], tiny_tokenizer, max_batch_size=4)
    assert check_greedy(requests, engine.generate(requests)) == 0
    assert engine.admissions == 1  # 40 short prompts: one pass, not ten

    per_place = -(-sum(sorted(tokens.values())[-5:]) // 4)  # the 5 longest fit 4 places
    monkeypatch.setattr(speculative, "ONE_TOKEN_TOKENS", per_place)
    bound = 4 * per_place
    groups: list[list] = []
    engine = SpeculativeEngine(tiny_models["target"], tiny_tokenizer, max_batch_size=4)
    assert check_greedy(requests, engine.generate(requests, on_admit=groups.append)) == 0
    assert [i for g in groups for i in g] == [req.id for req in requests]  # in order, once
    assert all(sum(tokens[i] for i in g[4:]) <= bound for g in groups)
    assert all(len(g) > 4 for g in groups[:-1])  # every full prefill went past the batch
    assert engine.admissions == len(groups) < 40 // 4


def test_a_row_its_first_token_ends_never_joins_the_batch(tiny_models, tiny_tokenizer,
                                                           make_requests, check_greedy):
    """Requests of one new token (labelling jobs) end at their prefill: they take no place
    in the batch's cache and the draft model never prefills them, while the longer
    requests admitted with them run on, greedy exactly as the target alone."""
    requests = make_requests(20, seed=3)
    for b, req in enumerate(requests):
        if b % 3 != 2:  # two in three: one token
            req.max_new_tokens = 1
    drafter = DraftModel(tiny_models["near"])
    admitted: list[int] = []
    admit = drafter.admit

    def counting(prompts, first_tokens):
        admitted.append(len(prompts))
        admit(prompts, first_tokens)

    drafter.admit = counting
    engine = SpeculativeEngine(tiny_models["target"], tiny_tokenizer, drafter,
                               max_batch_size=8, draft_length=3, adaptive=False)
    widest = []
    engine.on_step = lambda step: widest.append(len(engine.rows))
    results = engine.generate(requests)
    assert check_greedy(requests, results) == 0
    went_on = sum(1 for r in results if r.counters.new_tokens > 1)  # EOS may end one too
    assert 0 < went_on < len(requests) // 2
    assert sum(admitted) == went_on  # the drafter saw only the rows that went on
    assert max(widest) <= went_on
