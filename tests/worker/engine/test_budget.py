"""The step's draft budget (budget.py): survivals and a verify pass's price -> per-row counts."""

import itertools
import json
import random

import pytest

from specq.worker.engine import budget
from specq.worker.engine.batch import KVRows
from specq.worker.engine.budget import NEGLIGIBLE, Packed, Padded, TwoPart, chain, verify_cost
from specq.worker.engine.drafters import DraftModel, PromptLookup
from specq.worker.engine.policy import CostTable, DraftLengthPolicy, PassFit, Pinned, Widths
from specq.worker.engine.speculative import SpeculativeEngine
from specq.worker.engine.suffix import SuffixDrafter


def rate(survivals, kept, cost):
    """Expected tokens per second of a step that keeps these counts under a packed price."""
    tokens = cost.batch + sum(sum(row[:k]) for row, k in zip(survivals, kept))
    return tokens / (cost.plain + cost.per_token * sum(kept))


def test_packed_ranks_every_rows_tokens_and_keeps_while_survival_beats_the_cost():
    # B = 4, a plain pass 1 s, a draft token 0.1 s: a token pays while its survival beats
    # 0.1 x the step's tokens per second (4 at first, rising as good tokens join)
    cost = Packed(plain=1.0, per_token=0.1, batch=4)
    survivals = [[0.9, 0.8, 0.3], [0.5], [], [0.35]]
    assert cost.allot(survivals) == [2, 1, 0, 0]
    # the same tokens, cheaper: all of them pay
    assert Packed(1.0, 0.01, 4).allot(survivals) == [3, 1, 0, 1]


def test_a_step_where_nothing_clears_the_bar_is_plain():
    assert Packed(1.0, 0.2, 4).allot([[0.6, 0.3]] * 4) == [0] * 4
    assert Padded([1.0, 2.0, 2.5], 4).allot([[0.6, 0.3]] * 4) == [0] * 4
    assert Packed(1.0, 0.2, 2).allot([[], []]) == [0, 0]


def test_forced_tokens_survive_and_are_kept_where_guesses_are_not():
    forced, guess = chain([1.0] * 5), chain([0.3] * 5)
    assert Packed(1.0, 0.1, 8).allot([forced, guess] + [[]] * 6) == [5, 0, 0, 0, 0, 0, 0, 0]


@pytest.mark.parametrize("seed", range(40))
def test_packed_allotment_is_the_best_of_every_prefix_choice(seed):
    """The greedy ranking gives the most expected tokens per second of any choice of
    prefixes (brute force over small batches)."""
    rng = random.Random(seed)
    B = rng.randint(1, 3)
    survivals = [chain([rng.random() ** 0.5 for _ in range(rng.randint(0, 3))])
                 for _ in range(B)]
    cost = Packed(plain=1.0, per_token=rng.uniform(0.01, 0.5), batch=B)
    best = max(rate(survivals, kept, cost)
               for kept in itertools.product(*(range(len(r) + 1) for r in survivals)))
    assert rate(survivals, cost.allot(survivals), cost) == pytest.approx(best)


@pytest.mark.parametrize("seed", range(20))
def test_padded_takes_the_width_with_the_most_tokens_per_second(seed):
    rng = random.Random(seed)
    B = rng.randint(1, 4)
    survivals = [chain([rng.random() for _ in range(rng.randint(0, 4))]) for _ in range(B)]
    seconds = [1.0]
    for _ in range(4):
        seconds.append(seconds[-1] + rng.uniform(0.0, 0.5))
    cost = Padded(seconds, B)
    kept = cost.allot(survivals)

    def per_second(w):
        return (B + sum(sum(r[:w]) for r in survivals)) / seconds[w]

    w = max(range(max(map(len, survivals)) + 1), key=lambda w: (per_second(w), -w))
    assert max(kept) <= w
    for row, k in zip(survivals, kept):
        # each row keeps its first w tokens but a tail that cannot survive
        assert k == min(w, len(row)) or row[k] < NEGLIGIBLE


def test_padded_trims_only_what_cannot_survive():
    cost = Padded([1.0, 1.5, 1.6, 1.7], 2)
    sure, hopeless = chain([0.9] * 3), chain([0.005] * 3)
    assert cost.allot([sure, hopeless]) == [3, 0]
    assert cost.allot([sure, chain([0.5] * 3)]) == [3, 3]  # a paid-for column costs nothing
    # past the widths measured, the last slope goes on
    assert Padded([1.0, 1.5], 1).pass_seconds(3) == pytest.approx(2.5)


def test_the_price_follows_the_verify_pass():
    seconds = [1.0, 1.4, 1.6]
    assert isinstance(verify_cost(seconds, 4, packed=False), Padded)
    packed = verify_cost(seconds, 4, packed=True)
    assert isinstance(packed, Packed)
    assert (packed.plain, packed.per_token) == (1.0, pytest.approx(0.1))  # 0.4 s / 4 tokens


def _policy(cls=DraftLengthPolicy, batch=4):
    policy = cls(default=4, max_g=8)
    policy.record_costs(batch, {1: [0.10] * 2, 2: [0.14] * 2, 5: [0.20] * 2}, [0.0] * 2)
    policy.choose(batch=batch)
    policy.measuring = False  # as after a choice the estimates made
    return policy


def test_survival_is_one_for_forced_calibrated_for_scored_and_alpha_else():
    policy = _policy()
    a = policy.alpha
    # row 0: two scored tokens, then forced ones, then a follower's; row 1: unscored
    got = policy.survivals([5, 2], [[2, 3], []], [[0.95, 0.95, 0.5], []])
    q = policy.calibration(0.95)
    assert got[0] == pytest.approx([q, q * q, q * q, q * q, q * q * a])
    assert got[1] == pytest.approx([a, a * a])


def test_the_policy_spends_the_budget_and_a_pinned_one_keeps_every_token():
    sure = [0.95] * 8
    none = [[] for _ in range(4)]
    widths = _policy(Widths)
    # packed: the sure row's tokens pay, the rows that guess keep nothing
    got = widths.allot([8, 8, 8, 8], none, [sure, [0.05] * 8, [0.05] * 8, [0.05] * 8],
                       packed=True)
    assert got[0] >= 4 and got[1:] == [0, 0, 0]
    # a step chosen to measure is verified whole
    widths.measuring = True
    assert widths.allot([8, 8], none[:2], [[0.05] * 8] * 2, packed=True) == [8, 8]
    pinned = _policy(Pinned)
    assert pinned.allot([3, 0, 5], [[], [], []], [[], [], []], packed=True) == [3, 0, 5]


@pytest.mark.parametrize("drafter", ["noisy", "suffix", "prompt_lookup"])
def test_rows_cut_by_the_budget_stay_lossless(drafter, monkeypatch, tiny_models, tiny_tokenizer,
                                              make_requests, check_greedy):
    """Drafts asked for at g = 4 and cut row by row by a packed price: greedy output is
    still the target's. A draft model drafts g and verifies fewer, its cache kept in step
    with what was verified (drafters.DraftModel.update)."""
    monkeypatch.setattr(KVRows, "packed", True)
    monkeypatch.setattr(budget, "verify_cost",
                        lambda seconds, batch, packed, step: Packed(1.0, 0.08, batch))
    made = {"noisy": lambda: DraftModel(tiny_models["noisy"]), "suffix": SuffixDrafter,
            "prompt_lookup": PromptLookup}[drafter]()
    engine = SpeculativeEngine(tiny_models["target"], tiny_tokenizer, made, max_batch_size=5)
    policy = engine.policy
    cuts, allot = [], policy.allot

    def choose(batch=None, confidence=None):  # a policy that asks for 4 and trusts it
        policy._batch, policy.measuring = batch or policy._batch, False
        return 4

    def spy(num, *args, **kwargs):
        kept = allot(num, *args, **kwargs)
        cuts.append(kept != list(num))
        return kept

    policy.choose, policy.allot = choose, spy  # type: ignore[method-assign]
    requests = make_requests(12, seed=3)
    assert check_greedy(requests, engine.generate(requests)) <= 2
    assert any(cuts), "the budget never cut a row: the test shows nothing"


def two_part_rate(survivals, kept, cost):
    tokens = cost.batch + sum(sum(r[:k]) for r, k in zip(survivals, kept))
    seconds = (cost.plain + cost.per_token * sum(kept)
               + cost.per_column * max(kept, default=0))
    return tokens / seconds


def test_two_part_prices_a_lone_wide_row_by_its_columns():
    """A column costs all rows: one row's guess does not pay for it, eight rows' do."""
    cost = TwoPart(plain=1.0, per_token=0.01, per_column=0.05, batch=8)
    guess = chain([0.3, 0.3])
    assert cost.allot([guess] + [[]] * 7) == [0] * 8  # 8.3 tokens in 1.06 s: below 8 in 1
    assert Packed(1.0, 0.01, 8).allot([guess] + [[]] * 7)[0] == 2  # tokens alone: kept
    assert cost.allot([guess] * 8) == [1] * 8  # 10.4 tokens in 1.13 s; a second column no
    assert cost.allot([chain([0.95] * 4)] * 8) == [4] * 8  # sure drafts go wide


@pytest.mark.parametrize("seed", range(40))
def test_two_part_allotment_is_near_the_best_of_every_prefix_choice(seed):
    rng = random.Random(seed)
    B = rng.randint(1, 3)
    survivals = [chain([rng.random() ** 0.5 for _ in range(rng.randint(0, 3))])
                 for _ in range(B)]
    cost = TwoPart(plain=1.0, per_token=rng.uniform(0.01, 0.3),
                   per_column=rng.uniform(0.0, 0.3), batch=B)
    best = max(two_part_rate(survivals, kept, cost)
               for kept in itertools.product(*(range(len(r) + 1) for r in survivals)))
    assert two_part_rate(survivals, cost.allot(survivals), cost) >= 0.98 * best


def test_the_pass_fit_waits_for_ragged_passes_then_finds_every_part():
    """A pass's first draft, its tokens and its columns, each priced apart."""
    fit = PassFit(batch=8)

    def seconds(carried, width):
        return 0.1 + 0.01 * (carried > 0) + 0.002 * carried + 0.004 * (width - 1)

    for n in (1, 2, 5) * 4:  # full widths: a token and a column cannot be told apart
        fit.add(8 * (n - 1), n, seconds(8 * (n - 1), n))
    assert fit.solve() is None
    for carried, width in [(1, 2), (3, 2), (2, 3), (4, 5), (1, 5), (6, 3)] * 2:
        fit.add(carried, width, seconds(carried, width))
    assert fit.solve() == pytest.approx((0.1, 0.01, 0.002, 0.004), rel=1e-6)
    fit.add(2, 3, 50.0)  # a stall: capped at STALL_CLIP times the fit's own prediction
    assert fit.solve()[0] < 0.2


def test_a_drafting_steps_host_work_is_paid_by_all_its_tokens_together():
    """Drafts that pay for their own verify tokens but not for the host work a drafting step
    adds (the accept test, cache upkeep) make a plain step; more of them, or surer ones,
    pay for it together."""
    few = [[0.5], [], [], []]  # one token of even odds: B = 4, plain 1 s, a token 0.1 s
    for cost in (Packed(1.0, 0.1, 4), TwoPart(1.0, 0.1, 0.0, 4), Padded([1.0, 1.1], 4)):
        assert cost.allot(few) == [1, 0, 0, 0]
        cost.step = 0.2  # host seconds a drafting step adds: 0.5 token cannot pay 0.3 s
        assert cost.allot(few) == [0, 0, 0, 0]
        assert cost.allot([[0.9, 0.9]] * 4) != [0, 0, 0, 0]


def test_the_policy_learns_a_drafting_steps_host_work_per_batch_size():
    policy = DraftLengthPolicy(default=4)
    for _ in range(5):
        policy.observe(0, [0] * 4, [0] * 4, 0.0, 0.1, 1, carried=0, t_host=0.002)
        policy.observe(4, [4] * 4, [1] * 4, 0.0, 0.2, 5, carried=16, t_host=0.006)
    assert policy.costs.drafting_step(4) == pytest.approx(0.004)
    assert policy.costs.drafting_step(8) == 0.0  # not measured at 8 rows: not charged


def test_the_pass_fit_stays_ready_through_a_plain_spell():
    """Plain passes say nothing of a token against a column, and once decayed the fit's
    readiness with them: the budget priced drafts by the one-slope fallback (no column)
    exactly after a spell of plain steps, and drafted what the fit had refused."""
    fit = PassFit(batch=8)
    for carried, width in [(1, 2), (3, 2), (2, 3), (4, 5), (1, 5), (6, 3)] * 2:
        fit.add(carried, width, 0.1 + 0.002 * carried + 0.004 * (width - 1))
    ready = fit.solve()
    assert ready is not None
    for _ in range(200):
        fit.add(0, 1, 0.1)
    assert fit.solve() == pytest.approx(ready, rel=1e-3)


def test_a_batch_size_without_a_fit_borrows_a_near_ones_slopes():
    """Rows end and the batch shrinks mid-job: the shrunk batch prices a token as the full
    one did, a column by its own rows, on its own plain pass; a far batch size borrows
    nothing."""
    policy = DraftLengthPolicy(default=4)
    for carried, width in [(1, 2), (3, 2), (2, 3), (4, 5), (1, 5), (6, 3)] * 2:
        policy.costs.add_shape(16, carried, width, 0.1 + 0.002 * carried + 0.004 * (width - 1),
                               weight=1.0)
    policy.observe(0, [0] * 16, [0] * 16, 0.0, 0.1, 1, carried=0)
    policy.observe(0, [0] * 8, [0] * 8, 0.0, 0.06, 1, carried=0)
    assert policy.costs.pass_fit(16) == pytest.approx((0.1, 0.0, 0.002, 0.004), abs=1e-9)
    assert policy.costs.pass_fit(8) == pytest.approx((0.06, 0.0, 0.002, 0.002), abs=1e-9)
    policy.observe(0, [0] * 4, [0] * 4, 0.0, 0.05, 1, carried=0)
    assert policy.costs.pass_fit(4) is None


def _calibrated_at_16(policy: DraftLengthPolicy) -> None:
    for carried, width in [(1, 2), (3, 2), (2, 3), (4, 5), (1, 5), (6, 3)] * 2:
        policy.costs.add_shape(16, carried, width, 0.1 + 0.002 * carried + 0.004 * (width - 1),
                               weight=1.0)
    policy.observe(0, [0] * 16, [0] * 16, 0.0, 0.1, 1, carried=0)


def test_a_borrowed_fit_learns_its_own_batch_sizes_price():
    """A job of 24 rows on a worker calibrated at 16 and 64 rows priced a draft token at
    16 rows' price for good: its steps taught nothing. Its first step moves the fit it
    borrows to its own batch size, at the borrowed price; its steps then refine that one,
    and the calibrated fit stays as calibration and its own steps made it."""
    policy = DraftLengthPolicy(default=4)
    _calibrated_at_16(policy)
    at_16 = policy.costs.pass_fit(16)
    policy.observe(0, [0] * 24, [0] * 24, 0.0, 0.15, 1, carried=0)
    assert 24 in policy.costs.passes
    assert policy.costs.pass_fit(24) == pytest.approx((0.15, 0.0, 0.002, 0.006), abs=1e-6)

    def seconds(carried, width):  # 24 rows: a token twice as dear, a column as at 16
        return 0.15 + 0.004 * carried + 0.004 * (width - 1)

    for _ in range(10):
        for carried, width in [(1, 2), (5, 2), (12, 3), (20, 5), (3, 5), (24, 2)]:
            policy.observe(4, [0] * 24, [0] * 24, 0.0, seconds(carried, width), width,
                           carried=carried)
        policy.observe(0, [0] * 24, [0] * 24, 0.0, 0.15, 1, carried=0)
    assert policy.costs.pass_fit(24) == pytest.approx((0.15, 0.0, 0.004, 0.004), rel=0.1,
                                                      abs=1e-3)
    assert policy.costs.pass_fit(16) == pytest.approx(at_16, rel=1e-9)
    # a batch size that only a moved fit is near, not a calibrated one, borrows nothing
    policy.observe(0, [0] * 48, [0] * 48, 0.0, 0.3, 1, carried=0)
    assert policy.costs.pass_fit(48) is None and 48 not in policy.costs.passes


def test_a_moved_fit_is_kept_with_its_origin():
    policy = DraftLengthPolicy(default=4)
    _calibrated_at_16(policy)
    policy.observe(0, [0] * 24, [0] * 24, 0.0, 0.15, 1, carried=0)
    table = CostTable.from_state(json.loads(json.dumps(policy.costs.state())), max_weight=50.0)
    assert table.pass_fit(24) == pytest.approx(policy.costs.pass_fit(24), rel=1e-6)
    table.add(48, {1: [0.3]})
    assert table.pass_fit(48) is None


def test_the_steps_alone_make_no_fit_and_a_kept_one_of_theirs_is_dropped():
    """At a batch size calibration did not time (a job's tail of a few rows) a fit of the
    steps' noisy passes priced a pass's first draft at 17 ms, then 18, 93 and 112 beside a
    60 ms plain pass as the demo ran five times on its kept table, and refused every draft
    there: no drafting pass came to mend it. Such a batch size prices drafts by its own
    widths (budget.Packed), or borrows a calibrated fit near it; a cached table that holds
    a fit of the steps' alone is read without it."""
    policy = DraftLengthPolicy(default=4)
    rng = random.Random(0)
    for _ in range(40):  # stalls on the drafting passes: 'a first draft costs a pass'
        carried = rng.randint(1, 6)
        policy.observe(4, [0] * 2, [0] * 2, 0.0, 0.06 + 0.05 + 0.002 * carried, 5,
                       carried=carried)
        policy.observe(0, [0] * 2, [0] * 2, 0.0, 0.06, 1, carried=0)
    assert 2 not in policy.costs.passes and policy.costs.pass_fit(2) is None
    state = policy.costs.state()
    noisy = PassFit(batch=2)
    for carried, width in [(1, 2), (3, 4), (2, 3), (6, 5), (1, 5), (4, 3)] * 2:
        noisy.add(carried, width, 0.16 + 0.002 * carried)
        noisy.add(0, 1, 0.06)
    assert noisy.solve() is not None
    state["passes"]["2"] = noisy.state()
    assert CostTable.from_state(json.loads(json.dumps(state)), max_weight=2.0).pass_fit(2) is None
    # with drafts likely to survive, the widths' price verifies them (the fit refused all)
    policy.observe(4, [4] * 2, [4] * 2, 0.0, 0.062, 5, carried=8)
    policy.observe(4, [4] * 2, [4] * 2, 0.0, 0.062, 5, carried=8)
    policy.measuring = False
    assert policy.allot([4, 4], [[], []], [[], []], packed=True) != [0, 0]


def test_calibrations_shapes_price_a_pass_at_the_steps_own_level():
    """Calibration's passes (short context, maybe a quieter machine) say what a token and
    a column cost beside its own plain pass; the steps' plain passes say what a plain pass
    costs now. Calibration's passes stay through any number of steps."""
    fit = PassFit(batch=16)
    for carried, width in [(0, 1), (16, 2), (64, 5), (8, 9), (16, 5), (8, 2)]:
        fit.add(carried, width, 0.05 + 0.012 * (carried > 0) + 0.002 * carried
                + 0.001 * (width - 1), weight=3.0, calibrated=True)
    assert fit.solve() == pytest.approx((0.05, 0.012, 0.002, 0.001), rel=1e-6)
    for _ in range(500):
        fit.add(0, 1, 0.08)
    assert fit.solve() == pytest.approx((0.08, 0.012, 0.002, 0.001), rel=1e-6)


def test_the_pass_fit_is_kept_with_the_cost_table():
    """A worker's next start reads the two-part price from the calibration cache
    (worker/costs.py), calibration's shapes whole, the steps' passes as a start."""
    policy = DraftLengthPolicy(default=4)
    for carried, width in [(8, 9), (16, 5), (8, 2)]:
        policy.costs.add_shape(16, carried, width, 0.1 + 0.002 * carried + 0.004 * (width - 1),
                               weight=3.0)
    policy.record_costs(16, {1: [0.1] * 2, 2: [0.136] * 2, 5: [0.244] * 2}, [0.0] * 2)
    for _ in range(100):
        policy.observe(0, [0] * 16, [0] * 16, 0.0, 0.12, 1, carried=0)
    saved = json.loads(json.dumps(policy.costs.state()))
    table = CostTable.from_state(saved, max_weight=2.0)
    assert table.pass_fit(16) == pytest.approx(policy.costs.pass_fit(16), rel=1e-6)
    assert table.passes[16].xtx[0][0] == pytest.approx(2.0)


def test_a_lone_row_is_priced_by_its_passes_whole_curve():
    """At batch 1 a packed pass over w + 1 tokens is the table's own: the budget reads the
    whole curve, steps and all. Priced by its first slope (1 -> 2 tokens, 0.7 ms here) a
    token looked free and the budget verified 4 drafts where 2 paid best (on a CPU a pass
    of 4 tokens cost 49 ms against 37 for 3: docs/benchmarks.md)."""
    policy = Widths(default=4, max_g=8)
    policy.record_costs(1, {1: [0.0324] * 2, 2: [0.0331] * 2, 3: [0.0374] * 2,
                            4: [0.0493] * 2, 5: [0.0504] * 2}, [0.0001] * 2)
    policy.choose(batch=1)
    policy.measuring = False
    conf = [0.65] * 8  # survivals 0.65, 0.42, 0.27, 0.18, ... (the bins' prior)
    survivals = policy.survivals([8], [[]], [conf])[0]
    kept = policy.allot([8], [[]], [conf], packed=True)
    seconds = [policy.t_verify(n, 1) for n in range(1, 6)]

    def rate(w):
        return (1 + sum(survivals[:w])) / seconds[w]

    assert kept == [max(range(5), key=rate)] == [2]
    # two rows: a ragged pass is not one row's curve, and the first slope prices it still
    policy.record_costs(2, {1: [0.04] * 2, 2: [0.06] * 2}, [0.0001] * 2)
    policy.choose(batch=2)
    policy.measuring = False
    two = policy.survivals([8, 8], [[], []], [[0.95] * 8] * 2)
    seconds2 = [policy.t_verify(n, 2) for n in range(1, 10)]
    assert policy.allot([8, 8], [[], []], [[0.95] * 8] * 2, packed=True) == Packed.from_widths(
        seconds2, 2).allot(two)


# -- a draining batch (budget.drain): no request waits, the job ends with its last row ----


def drain_net(survivals, remaining, kept, cost, fixed, per_row):
    """Seconds an allotment saves over its price, exactly: the expected steps the job no
    longer runs (its longest row's remaining work, over every outcome of the accept test)
    at ``fixed`` each, and each accepted token's row share."""
    rows = [row[:k] for row, k in zip(survivals, kept)]
    plain_left = max(remaining) - 1
    saved = 0.0
    for accepted in itertools.product(*(range(len(row) + 1) for row in rows)):
        chance = 1.0
        for row, a in zip(rows, accepted):
            chance *= (([1.0] + row)[a]) - (row[a] if a < len(row) else 0.0)
        left = max(r - 1 - a for r, a in zip(remaining, accepted))
        saved += chance * (plain_left - left)
    return fixed * saved + per_row * sum(sum(row) for row in rows) - cost.extra(kept)


def test_rows_that_end_together_drain_plain_where_tokens_per_second_drafted():
    """Sixteen rows run to one limit, drafts of survival 0.6 then 0.36: while requests
    wait, a row that gains ends sooner and takes the next one, and the budget keeps its
    first tokens; once none waits a step is saved only if all sixteen gain (0.6^16), and
    each token's own row share costs what it saves: a plain step."""
    cost = TwoPart(plain=0.1, per_token=0.002, per_column=0.001, batch=16)
    survivals = [chain([0.6, 0.6])] * 16
    assert any(cost.allot(survivals))
    assert budget.drain(cost, survivals, [20] * 16, fixed=0.068, per_row=0.002) == [0] * 16


def test_a_draining_batch_drafts_its_longest_row():
    """One row has 30 tokens to go, the others 10: each token the long row gains is a step
    the job no longer runs (the pass's fixed part); the short rows' tokens save only their
    own share of a pass, less than they cost to verify."""
    cost = TwoPart(plain=0.1, per_token=0.004, per_column=0.001, batch=4)
    survivals = [chain([0.7] * 4)] * 4
    kept = budget.drain(cost, survivals, [30, 10, 10, 10], fixed=0.04, per_row=0.004)
    assert kept[0] >= 2 and kept[1:] == [0, 0, 0]
    # two longest rows: a step is saved only if both gain; still worth it at 0.7 each
    kept = budget.drain(cost, survivals, [30, 30, 10, 10], fixed=0.04, per_row=0.004)
    assert kept[0] == kept[1] >= 1 and kept[2:] == [0, 0]
    # a row one token from its limit gains nothing whatever its drafts
    assert budget.drain(cost, survivals, [1, 1, 1, 1], fixed=0.04, per_row=0.004) == [0] * 4


@pytest.mark.parametrize("seed", range(40))
def test_drain_saves_what_the_best_allotment_saves(seed):
    """Against every allotment of small batches, scored exactly (every accept outcome):
    drain's choice (the longest rows' tokens depth by depth, then others' tokens one by
    one) saves what the best saves (500 seeds checked so when it was written), a row's
    share priced at most a token's (``drain``)."""
    rng = random.Random(seed)
    B = rng.randint(2, 3)
    survivals = [chain([rng.random() ** 0.5 for _ in range(rng.randint(0, 3))])
                 for _ in range(B)]
    remaining = [rng.randint(1, 6) for _ in range(B)]
    cost = TwoPart(plain=0.1, per_token=rng.uniform(0.001, 0.02),
                   per_column=rng.uniform(0.0, 0.01), batch=B, step=rng.uniform(0.0, 0.01))
    fixed, share = rng.uniform(0.01, 0.1), rng.uniform(0.001, 0.02)
    per_row = min(share, cost.token)
    usable = [row[:max(0, r - 1)] for row, r in zip(survivals, remaining)]
    best = max(drain_net(survivals, remaining, list(kept), cost, fixed, per_row)
               for kept in itertools.product(*(range(len(r) + 1) for r in usable)))
    got = drain_net(survivals, remaining, budget.drain(cost, survivals, remaining, fixed,
                                                       share), cost, fixed, per_row)
    assert got >= 0.0
    assert got == pytest.approx(best, rel=1e-9, abs=1e-12)


def test_a_rows_share_dearer_than_a_token_pays_for_no_draft_alone():
    """A row in a plain pass is one token of it: where its share, measured apart, came out
    dearer than the token's price, drafts of any survival short of 1 are not kept for the
    share alone (a draining batch of 64 kept 224 drafts at a share of 2.0 ms beside a
    token's 1.5, promised 0.94 each, and the target took 79); the pass's fixed part, a
    step the job no longer runs, still pays for the longest row's, and for sure tokens in
    every row."""
    cost = TwoPart(plain=0.15, per_token=0.0015, per_column=0.0, batch=64)
    likely = [chain([0.94] * 4)] * 64
    assert budget.drain(cost, likely, [20] * 64, fixed=0.02, per_row=0.002) == [0] * 64
    assert budget.drain(cost, likely, [20] * 64, fixed=0.02, per_row=0.001) == [0] * 64
    kept = budget.drain(cost, likely, [30] + [20] * 63, fixed=0.02, per_row=0.002)
    assert kept[0] > 0 and kept[1:] == [0] * 63
    sure = [[1.0] * 4] * 64  # a grammar's forced tokens in every row: steps the job saves
    assert budget.drain(cost, sure, [20] * 64, fixed=0.02, per_row=0.002) == [4] * 64
    assert Padded([0.1, 0.164], 64).token == pytest.approx(0.001)


def test_the_policy_drains_once_no_request_waits():
    """policy.allot with ``remaining`` prices the step as a draining batch: the pass's
    fixed part and a row's share from the plain passes at batch 1 and here."""
    policy = Widths(default=4, max_g=8)
    policy.record_costs(1, {1: [0.03] * 2, 2: [0.032] * 2}, [0.0001] * 2)
    policy.record_costs(8, {1: [0.06] * 2, 2: [0.10] * 2}, [0.0001] * 2)
    policy.choose(batch=8)
    policy.measuring = False
    none, conf = [[] for _ in range(8)], [[0.8] * 4] * 8
    assert policy.allot([4] * 8, none, conf, packed=True) != [0] * 8
    assert policy.allot([4] * 8, none, conf, packed=True, remaining=[5] * 8) == [0] * 8
    kept = policy.allot([4] * 8, none, conf, packed=True, remaining=[9] + [5] * 7)
    assert kept[0] > 0 and kept[1:] == [0] * 7


def test_a_draining_batch_fills_a_width_its_longest_rows_paid_for():
    """Tokens of other rows inside the columns the longest rows' depth pays for cost a
    token each; one that would widen the pass costs its column too. A sure token that
    widens is refused; a sure one inside the width is kept (it costs a token of the pass
    and saves its row one), a likely one not (a row's share is at most a token's)."""
    cost = TwoPart(plain=0.1, per_token=0.002, per_column=0.003, batch=4)
    # forced, the longest, forced, a guess
    survivals = [[1.0] * 4, chain([0.9, 0.9]), [1.0], [0.95]]
    kept = budget.drain(cost, survivals, [10, 30, 10, 10], fixed=0.05, per_row=0.004)
    assert kept == [2, 2, 1, 0]


def _told_remaining(tiny_models, tiny_tokenizer) -> tuple[SpeculativeEngine, list]:
    """An engine of 4 rows with the suffix drafter, and per step its budget priced, the
    ``remaining`` the engine told it (None: the batch was not draining), filled as it runs."""
    engine = SpeculativeEngine(tiny_models["target"], tiny_tokenizer, SuffixDrafter(),
                               max_batch_size=4)
    told, allot = [], engine.policy.allot

    def spy(num, *args, **kwargs):
        told.append(kwargs.get("remaining", args[4] if len(args) > 4 else None))
        return allot(num, *args, **kwargs)

    engine.policy.allot = spy  # type: ignore[method-assign]
    return engine, told


def test_the_engine_drains_only_where_rows_run_to_their_limit(tiny_models, tiny_tokenizer,
                                                              make_requests):
    """A job whose rows end at their max_new_tokens: once no request waits, the budget
    is told each row's remaining tokens (budget.drain). A job whose rows end at their EOS
    first: never (a limit does not say which row ends last)."""
    engine, told = _told_remaining(tiny_models, tiny_tokenizer)
    requests = [r.model_copy(update={"max_new_tokens": 12}) for r in make_requests(7, seed=5)]
    results = engine.generate(requests, job="to the limit")
    assert all(r.finish_reason == "length" for r in results)
    draining = [t for t in told if t is not None]
    assert draining and told[-1] is not None and told[0] is None
    assert all(len(t) <= 3 for t in draining)  # the last wave: 7 requests, 4 places
    # the same prompts, their 4th token taken for an end of sequence: they end first
    engine.eos_ids = engine.eos_ids | {r.token_ids[3] for r in results}
    told.clear()
    ended = engine.generate(requests, job="to the end")
    assert all(r.finish_reason == "stop" for r in ended) and told
    assert all(t is None for t in told)


def test_a_job_that_starts_full_drains_as_the_rows_before_it_ended(tiny_models, tiny_tokenizer,
                                                                   make_requests):
    """All of a job's rows start together (no request waits) and none has ended yet: the
    rows the engine ran before say how rows end. On an engine that never saw a row end,
    tokens per second; after a job whose rows ran to their limit, the next job drains from
    its first step; once the job's own rows end, theirs decide."""
    engine, told = _told_remaining(tiny_models, tiny_tokenizer)
    requests = [r.model_copy(update={"max_new_tokens": 12}) for r in make_requests(4, seed=7)]
    first = engine.generate(requests, job="first")
    assert all(r.finish_reason == "length" for r in first)
    assert told and told[0] is None  # nothing known of how rows end: tokens per second
    told.clear()
    engine.generate(requests, job="second")
    assert told and all(t is not None for t in told)  # drained from its first step
    # a job whose rows end at their EOS: its first chunk priced by the earlier rows, its
    # next chunk (a worker's next generation of the same job) by its own ends
    engine.eos_ids = engine.eos_ids | {r.token_ids[3] for r in first}
    told.clear()
    ended = engine.generate(requests, job="third")
    assert all(r.finish_reason == "stop" for r in ended)
    assert told and all(t is not None for t in told)
    told.clear()
    engine.generate(requests, job="third")
    assert told and all(t is None for t in told)
