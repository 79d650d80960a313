"""Draft-length choice: the speedup arithmetic and the choices it leads to."""

import pytest
import torch

from specq.worker.engine import calibration
from specq.worker.engine.batch import KVRows
from specq.worker.engine.drafters import DraftModel, PromptLookup
from specq.worker.engine.policy import (
    CONFIDENCE_DECAY,
    CONFIDENCE_PRIOR,
    HINDSIGHT_FLOOR,
    PLAIN_REFRESH,
    PROBE_GAP,
    Calibration,
    DraftLengthPolicy,
    Pinned,
    Shadowed,
    Widths,
    expected_tokens,
    measured_speedup,
    theorem_speedup,
)
from specq.worker.engine.speculative import SpeculativeEngine
from specq.worker.engine.suffix import SuffixDrafter


def test_speedup_arithmetic():
    # Leviathan Thm 3.8: (1 - a^(g+1)) / ((1 - a)(g c + 1))
    for a, g, c in [(0.8, 4, 0.1), (0.5, 1, 0.0), (0.3, 7, 0.25)]:
        want = (1 - a ** (g + 1)) / ((1 - a) * (g * c + 1))
        assert theorem_speedup(a, g, c) == pytest.approx(want)
    assert expected_tokens(0.0, 5) == 1.0 and expected_tokens(1.0, 3) == 4.0
    # a flat verify cost turns the measured form into the theorem
    assert measured_speedup(0.7, 3, 0.02, 0.1, 0.1) == pytest.approx(theorem_speedup(0.7, 3, 0.2))
    # a verify pass that costs 2x halves the gain
    assert measured_speedup(0.7, 3, 0.0, 0.1, 0.2) == pytest.approx(expected_tokens(0.7, 3) / 2)
    # half the rows proposing: half the expected extra tokens
    assert expected_tokens(0.5, 2, propose_rate=0.5) == pytest.approx(1 + 0.5 * 0.75)


def _feed(policy, g, alpha_hits, t_draft, t_verify_by_n, steps=20):
    for _ in range(steps):
        gg = policy.choose()
        n = gg if gg else 0
        acc = [min(alpha_hits, n)] * 4
        policy.observe(gg, [n] * 4, acc, t_draft * gg, t_verify_by_n(gg + 1), gg + 1)
    return gg


def test_policy_speculates_when_it_pays_and_stops_when_it_does_not():
    good = DraftLengthPolicy(default=4, max_g=8)
    g = _feed(good, 4, alpha_hits=8, t_draft=0.01, t_verify_by_n=lambda n: 0.1 + 0.01 * n)
    assert g >= 4 and good.predicted(g) > 2
    bad = DraftLengthPolicy(default=4, max_g=8)
    g = _feed(bad, 4, alpha_hits=0, t_draft=0.05, t_verify_by_n=lambda n: 0.1 * n)
    assert g == 0 and bad.history.count(0) > 10
    cheap = DraftLengthPolicy(default=4, max_g=8)  # a useless but nearly free draft
    _feed(cheap, 4, alpha_hits=0, t_draft=0.0, t_verify_by_n=lambda n: 0.1 + 0.001 * n,
          steps=30 + 2 * PROBE_GAP)
    assert 4 in list(cheap.history)[2:], "it probes again now and then"
    pinned = Pinned(default=3)
    assert _feed(pinned, 3, 0, 0.05, lambda n: 0.1 * n) == 3


def test_a_stall_does_not_switch_speculation_off_for_good():
    policy = DraftLengthPolicy(default=4, max_g=8)
    _feed(policy, 4, alpha_hits=8, t_draft=0.01, t_verify_by_n=lambda n: 0.1 + 0.01 * n)
    g = policy.choose()
    assert g >= 4
    # one verify pass 10x slower than usual (another process took the CPU)
    policy.observe(g, [g] * 4, [g] * 4, 0.01 * g, 10 * (0.1 + 0.01 * (g + 1)), g + 1)
    assert policy.choose() >= 4
    assert policy.t_verify(g + 1) < 3 * (0.1 + 0.01 * (g + 1))


def test_cheap_probes_come_every_probe_gap_steps():
    """A useless but nearly free draft: each probe costs little, so they come as often as
    PROBE_GAP allows, no more often."""
    policy = DraftLengthPolicy(default=4, max_g=8)
    _feed(policy, 4, alpha_hits=0, t_draft=0.0, t_verify_by_n=lambda n: 0.1 + 0.001 * n,
          steps=400)
    history = list(policy.history)
    settled = history.index(0, 2)  # after the first plain step that acceptance chose
    probes = [i for i, g in enumerate(history) if g and i > settled]
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert len(probes) >= (400 - settled) // (PROBE_GAP + 1) - 1
    assert min(gaps) >= PROBE_GAP and max(gaps) <= PROBE_GAP + 1, gaps


def test_engine_stops_drafting_with_a_useless_draft(tiny_models, tiny_tokenizer, make_requests,
                                                    check_greedy, monkeypatch):
    """An unrelated draft is almost never accepted, so g = 0 wins after the first measured
    drafts. The costs are set, not measured (a draft token at 0.3 of a plain pass, each
    verified token 10 % more), and kept: with the tiny models' millisecond passes, a loaded
    machine's timings could make any acceptance look worth drafting for, and the choice
    would depend on the clock (the unit tests above drive the choice for a useful draft)."""
    requests = make_requests(16, seed=7, max_new=64)
    engine = SpeculativeEngine(tiny_models["target"], tiny_tokenizer,
                               DraftModel(tiny_models["unrelated"]), max_batch_size=4)
    for batch in (1, 4):
        plain = 0.01 * (1 + 0.2 * batch)
        engine.policy.record_costs(
            batch, {n: [plain * (1 + 0.1 * (n - 1))] * 20 for n in range(1, 10)},
            [0.3 * plain] * 20)
    monkeypatch.setattr(engine.policy.costs, "add", lambda *args, **kwargs: None)
    results = engine.generate(requests)
    history = list(engine.policy.history)
    assert engine.policy.alpha < 0.2
    assert history.count(0) / len(history) > 0.9, history
    # the first step drafts on the prior's acceptance of 1/2; after it, plain steps or probes
    assert all(g in (0, engine.policy.default) for g in history[1:]), history
    for r in results:
        assert sum(r.counters.steps_by_draft_length) == r.counters.target_passes - 1
    check_greedy(requests, results)


def test_verify_cost_is_a_line_through_the_widths_measured():
    policy = DraftLengthPolicy(default=4)
    for _ in range(20):
        policy.observe(0, [0], [0], 0.0, 0.10, 1)
        policy.observe(4, [4], [2], 0.01, 0.20, 5)
    policy.observe(2, [2], [1], 0.01, 1.00, 3)  # one odd sample at width 3
    assert policy.t_verify(1) == pytest.approx(0.10)
    assert 0.12 < policy.t_verify(3) < 0.25  # the line, not the odd sample
    assert policy.t_verify(5) == pytest.approx(0.2, rel=0.25)
    assert policy.t_verify(9) > policy.t_verify(5)  # extrapolated, never below a plain step


def test_expensive_probes_are_spaced_out():
    """A draft as costly as the target (c = 1) and never accepted: probing at g = 4 costs
    about five plain steps, so probes come at most every 5 / 0.02 = 250 steps."""
    policy = DraftLengthPolicy(default=4, max_g=8)
    _feed(policy, 4, alpha_hits=0, t_draft=0.1, t_verify_by_n=lambda n: 0.1 * (1 + 0.05 * n),
          steps=600)
    probes = [i for i, g in enumerate(policy.history) if g][1:]
    assert len(probes) <= 3, probes
    assert all(b - a >= 200 for a, b in zip(probes, probes[1:]))


def test_rows_without_proposals_make_plain_steps():
    """Prompt lookup proposing for half the rows, at batch 1: half the steps are plain."""
    policy = DraftLengthPolicy(default=4)
    for i in range(40):
        policy.observe(0, [0], [0], 0.0, 0.10, 1)
        if i % 2:
            policy.observe(4, [4], [2], 0.0, 0.20, 5)
        else:
            policy.observe(4, [0], [0], 0.0, 0.10, 1)
    f, a = policy.propose_rate, policy.alpha
    assert f == pytest.approx(0.5, abs=0.1) and a == pytest.approx(2 / 3, abs=0.05)
    e = expected_tokens(a, 4, f)
    t_step = f * policy.t_verify(5) + (1 - f) * policy.t_verify(1)
    assert policy.predicted(4) == pytest.approx(e * policy.t_verify(1) / t_step)


def _costs(policy, batch, t1, wide, t_draft, n=5):
    policy.record_costs(batch, {1: [t1] * 2, n: [wide] * 2}, [t_draft] * 2)


def test_costs_are_kept_per_batch_size_and_interpolated_between():
    policy = DraftLengthPolicy(default=4)
    _costs(policy, 1, t1=0.05, wide=0.06, t_draft=0.0)  # batch 1: a wide pass is nearly free
    _costs(policy, 64, t1=0.4, wide=2.0, t_draft=0.0)  # batch 64: it costs 5 plain steps
    assert policy.t_verify(5, batch=1) == pytest.approx(0.06)
    assert policy.t_verify(5, batch=64) == pytest.approx(2.0)
    # between two measured batch sizes: on the line between them
    assert policy.t_verify(5, batch=48) == pytest.approx(0.06 + (2.0 - 0.06) * 47 / 63)
    assert policy.t_verify(1, batch=2) == pytest.approx(0.05 + 0.35 / 63)
    assert policy.t_verify(5, batch=100) == pytest.approx(2.0)  # past the largest: its own
    _costs(policy, 16, t1=0.1, wide=0.3, t_draft=0.0)
    assert policy.t_verify(5, batch=40) == pytest.approx(0.3 + 1.7 * 24 / 48)
    # a batch size's own measurements, once complete, replace the line
    _costs(policy, 40, t1=0.2, wide=0.9, t_draft=0.0)
    assert policy.t_verify(5, batch=40) == pytest.approx(0.9)
    policy.forget_data()
    assert policy.choose(batch=1) > 0, "the prior says drafting pays at batch 1"
    policy.forget_data()
    assert policy.choose(batch=64) == 0, "no alpha can pay for 5x verify: no warm-up"


def test_a_batch_size_running_on_a_far_ones_costs_measures_its_own(caplog):
    """A cached table whose only ready batch size is 1 (a wide pass nearly free there) and
    batch 16's plain passes: 16 borrowed batch 1's prices, its plain pass at batch 1's,
    and a prompt-lookup job never drafted nor measured a wide pass at 16. Once batch 16
    ran a few plain passes it measures its own (a step at g = 1, verified whole);
    then it prices drafts by its own costs. A batch size near a ready one (15 by 16) and
    one between two ready ones keep borrowing; one seen only once does too."""
    policy = Shadowed(default=4)
    _costs(policy, 1, t1=0.057, wide=0.09, t_draft=0.0)
    for _ in range(2):  # a step or two at batch 16: too few to tell
        policy.observe(0, [0] * 16, [0] * 16, 0.0, 0.14, 1)
    assert policy.choose(batch=16) == 0 and policy.t_verify(1, batch=16) == pytest.approx(0.057)
    for _ in range(4):
        policy.observe(0, [0] * 16, [0] * 16, 0.0, 0.14, 1)
    with caplog.at_level("INFO", logger="specq.worker.engine.policy"):
        assert policy.choose(batch=16) == 1 and policy.measuring, "measure a wider pass here"
    assert "batch size 16 ran on batch size 1's step costs" in caplog.text  # it shows
    policy.observe(1, [1] * 16, [1] * 16, 0.001, 0.17, 2)  # the measuring step
    assert policy.costs.ready(16)
    assert policy.t_verify(1, batch=16) == pytest.approx(0.14, rel=0.05)
    for _ in range(6):  # batch 15 (the tail) near a ready 16; batch 8 between 1 and 16
        policy.observe(0, [0] * 15, [0] * 15, 0.0, 0.13, 1)
        policy.observe(0, [0] * 8, [0] * 8, 0.0, 0.1, 1)
    assert policy.costs.far_stand_in(15) is None
    assert policy.costs.far_stand_in(8) is None


def test_no_warm_up_nor_early_probe_where_drafting_cannot_pay():
    """Calibrated costs at a large batch, compute bound: a pass over n tokens per row costs
    n plain steps, so the prior (alpha 1/2) predicts a loss at every g, and the first probe
    waits until it costs <= 2 % of the time (4 extra plain steps / 0.02 = 200 steps)."""
    policy = DraftLengthPolicy(default=4)
    _costs(policy, 64, t1=0.4, wide=2.0, t_draft=0.0)
    history = []
    for _ in range(60):
        g = policy.choose(batch=64)
        history.append(g)
        policy.observe(g, [g] * 64, [0] * 64, 0.0, 0.4 * (g + 1), g + 1)
    assert not any(history), history


def test_a_scored_free_drafter_drafts_only_once_its_proposals_show_it_pays():
    """Shadowed (prompt lookup): acceptance is seen at g = 0 for free, so a generation
    starts plain, not on the prior's hope, and drafts once scored proposals say it pays;
    proposals the target would reject keep it plain."""
    for hits, drafts in ((4, True), (0, False)):
        policy = Shadowed(default=4)
        _costs(policy, 4, t1=0.10, wide=0.17, t_draft=0.0)  # a wide pass 1.7x a plain one
        assert policy.choose(batch=4) == 0
        for _ in range(3):  # three plain steps, each row's proposal scored
            policy.observe(0, [0] * 4, [0] * 4, 0.0, 0.10, 1)
            policy.observe_acceptance([4] * 4, [hits] * 4)
        assert (policy.choose(batch=4) > 0) is drafts, policy.snapshot()


def test_forget_data_keeps_costs_and_drops_acceptance():
    policy = DraftLengthPolicy(default=4)
    _feed(policy, 4, alpha_hits=0, t_draft=0.01, t_verify_by_n=lambda n: 0.1 + 0.01 * n)
    assert policy.alpha < 0.2 and policy.history
    policy.forget_data()
    assert policy.alpha == pytest.approx(0.5) and not policy.history and policy.steps == 0
    assert policy.t_verify(5) == pytest.approx(0.15) and policy.t_draft == pytest.approx(0.01)


@pytest.mark.parametrize("kind", ["draft model", "prompt lookup"])
def test_calibration_measures_costs_and_leaves_the_engine_exact(
        kind, tiny_models, tiny_tokenizer, make_requests, check_greedy):
    drafter = DraftModel(tiny_models["near"]) if kind == "draft model" else PromptLookup()
    engine = SpeculativeEngine(tiny_models["target"], tiny_tokenizer, drafter, max_batch_size=8)
    engine.calibrate()
    snap = engine.policy.snapshot()
    assert set(snap["t_verify"]) == {1, 8} and set(snap["t_draft"]) == {1, 8}
    assert all(set(widths) == {1, 2, 5} for widths in snap["t_verify"].values())
    assert all(t > 0 for t in snap["t_draft"].values())
    # a packed model's ragged passes price a token apart from a column from the start
    # (policy.PassFit); a batch of one row has none
    assert snap["pass_fit"][8] is not None and snap["pass_fit"][1] is None
    # the data the calibration showed is forgotten: the acceptance is the regime's prior
    # (a free drafter, scored while g = 0, starts from none at all: policy.Shadowed)
    assert snap["steps"] == 0
    assert engine.policy.alpha == pytest.approx(0.5 if kind == "draft model" else 0.0)
    # the drafter holds no calibration row: generation after it is exact
    requests = make_requests(12, seed=3, max_new=24)
    check_greedy(requests, engine.generate(requests))


@pytest.mark.parametrize("kind", ["draft model", "prompt lookup"])
def test_calibration_runs_a_bounded_number_of_forward_passes(kind, tiny_models, tiny_tokenizer,
                                                             monkeypatch):
    """A worker's start waits for calibration: at each of a few batch sizes, a prefill and
    REPEATS passes at each of three widths of the target, and REPEATS draft steps."""
    target, draft = tiny_models["target"], tiny_models["near"]
    drafter = DraftModel(draft) if kind == "draft model" else PromptLookup()
    engine = SpeculativeEngine(target, tiny_tokenizer, drafter, max_batch_size=300)
    calls = {"target": 0, "draft": 0}
    forward = KVRows.logits

    def counted(kv, *args, **kwargs):  # every pass of either model goes through its KVRows
        calls["target" if kv.model is target else "draft"] += 1
        return forward(kv, *args, **kwargs)

    monkeypatch.setattr(KVRows, "logits", counted)
    engine.calibrate()
    assert calibration.batch_sizes(300) == [1, 16, 256, 300]
    assert calibration.batch_sizes(16) == [1, 16] and calibration.batch_sizes(1) == [1]
    # and at 16, 256 and 300 rows, the ragged shapes of a packed pass
    assert calls["target"] == calibration.forwards(4, 3, ragged_sizes=3) == (
        4 * (1 + 3 * calibration.REPEATS) + 3 * calibration.REPEATS * calibration.SHAPES)
    # a draft model: at each batch size, its prefill then REPEATS proposals of g tokens
    drafts = 4 * (1 + calibration.REPEATS * engine.policy.default)
    assert calls["draft"] == (drafts if kind == "draft model" else 0)
    assert set(engine.policy.snapshot()["t_verify"]) == {1, 16, 256, 300}


def test_calibration_is_a_no_op_for_a_pinned_g(tiny_models, tiny_tokenizer):
    engine = SpeculativeEngine(tiny_models["target"], tiny_tokenizer,
                               DraftModel(tiny_models["near"]), adaptive=False)
    engine.calibrate()
    assert engine.policy.snapshot()["t_verify"] == {}


@pytest.mark.parametrize("g", [0, 3])
def test_a_warm_calibration_runs_its_passes_for_a_pinned_g_and_records_nothing(
        g, tiny_models, tiny_tokenizer, make_requests, check_greedy, monkeypatch):
    """A benchmark warms every engine alike (bench/runner.py): no speculation (g = 0, no
    drafter) and a fixed g run the calibration's target passes (and draft steps, with a
    drafter), their policies left as they were, and the output after it is exact."""
    target = tiny_models["target"]
    drafter = DraftModel(tiny_models["near"]) if g else None
    engine = SpeculativeEngine(target, tiny_tokenizer, drafter, max_batch_size=16,
                               draft_length=g, adaptive=False)
    calls = {"target": 0, "draft": 0}
    forward = KVRows.logits

    def counted(kv, *args, **kwargs):
        calls["target" if kv.model is target else "draft"] += 1
        return forward(kv, *args, **kwargs)

    monkeypatch.setattr(KVRows, "logits", counted)
    assert engine.calibrate(warm=True) == [1, 16]
    widths = len({1, 2, g + 1})
    assert calls["target"] == calibration.forwards(2, widths, ragged_sizes=1)
    assert calls["draft"] == (2 * (1 + calibration.REPEATS * g) if g else 0)
    snap = engine.policy.snapshot()
    assert snap["t_verify"] == {} and snap["t_draft"] == {} and engine.policy.default == g
    requests = make_requests(8, seed=5, max_new=12)
    check_greedy(requests, engine.generate(requests))


def test_verify_cost_between_calibrated_widths_is_interpolated():
    """On a CPU, 1 -> 2 tokens per row costs more than 2 -> 5: no single line fits."""
    policy = DraftLengthPolicy(default=4)
    policy.record_costs(1, {1: [0.10] * 2, 2: [0.16] * 2, 5: [0.19] * 2, 9: [0.27] * 2})
    assert policy.t_verify(2) == pytest.approx(0.16)
    assert policy.t_verify(3) == pytest.approx(0.17)
    assert policy.t_verify(7) == pytest.approx(0.23)
    assert policy.t_verify(11) == pytest.approx(0.31)  # the last slope goes on
    wide_only = DraftLengthPolicy(default=4)
    wide_only.record_costs(1, {3: [0.2] * 2, 5: [0.3] * 2})
    assert wide_only.t_verify(1) == pytest.approx(0.1)  # extrapolated down, no division by 0


def test_a_plain_step_now_and_then_keeps_its_cost_fresh_while_drafting_pays():
    policy = DraftLengthPolicy(default=4, max_g=8)
    _feed(policy, 4, alpha_hits=8, t_draft=0.01, t_verify_by_n=lambda n: 0.1 + 0.01 * n,
          steps=200)
    plain = [i for i, g in enumerate(policy.history) if g == 0]
    assert len(plain) <= 200 / PLAIN_REFRESH + 2, "a plain step costs the drafting gain: rarely"
    assert max(b - a for a, b in zip(plain, plain[1:])) <= PLAIN_REFRESH + 1


def test_history_is_bounded():
    policy = DraftLengthPolicy(default=4)
    for _ in range(3000):
        policy.observe(0, [0], [0], 0.0, 0.1, 1)
    assert policy.steps == 3000 and len(policy.history) < 3000
    assert len(policy.snapshot()["g_history"]) == len(policy.history)


def _costed(batch=4):
    """A scored drafter's policy whose target pass over n tokens per row costs 0.1 + 0.02 n
    (n >= 2) and 0.1 for n = 1, at this batch size."""
    policy = Widths(default=4, max_g=8)
    policy.record_costs(batch, {1: [0.10] * 2, 2: [0.14] * 2, 5: [0.20] * 2}, [0.0] * 2)
    policy.choose(batch=batch)
    return policy


def test_calibration_learns_what_a_confidence_is_worth():
    cal = Calibration()
    assert cal(0.95) == pytest.approx(0.95) and cal(0.05) == pytest.approx(0.05)  # the prior
    for _ in range(300):  # drafts at 0.3 that the target takes 9 times in 10
        for k in range(10):
            cal.add([0.3, 0.3, 0.3], 3 if k else 1)  # judged: 3 accepted, or 1 then a miss
    assert cal(0.35) == pytest.approx(28 / 29, abs=0.02)  # 28 of each 29 judged accepted
    assert cal(0.95) == pytest.approx(0.95), "other bins keep what they knew"
    cal.add([0.9, 0.9, 0.9], 0)  # the first judged and rejected: the others never judged
    assert cal.judged[9] == pytest.approx(CONFIDENCE_PRIOR * CONFIDENCE_DECAY + 1)


def test_calibration_checks_its_bins_out_of_sample():
    """Each verdict is weighed against what the bins predicted before learning from it:
    while they promised more than the target gave, every calibrated acceptance is scaled
    down (a bin never judged included), never below HINDSIGHT_FLOOR of itself; once the
    bins predict what the target gives, the scale returns to 1; it never scales up."""
    cal = Calibration()
    assert cal.hindsight == 1.0
    for k in range(8):  # single drafts at 0.75 that the target takes one time in two
        cal.add([0.75], k % 2)
    assert 0.6 < cal.hindsight < 0.95
    # promised: each verdict's bin rate before it, from the prior 0.75 down; given: 4 of 8
    assert cal(0.95) == pytest.approx(0.95 * cal.hindsight)  # a bin never judged, scaled
    assert cal(0.75) == pytest.approx(cal._rate(0.75) * cal.hindsight)
    for k in range(400):  # the bin has learnt: its predictions hold
        cal.add([0.75], k % 2)
    assert cal.hindsight > 0.9 and cal._rate(0.75) == pytest.approx(0.5, abs=0.05)

    sure = Calibration()
    for _ in range(50):  # drafts at 0.35 the target always takes: more than promised
        sure.add([0.35, 0.35], 2)
    assert sure.hindsight == 1.0 and sure(0.95) == pytest.approx(0.95)

    wrong = Calibration()
    for _ in range(200):  # sure drafts always refused: the scale stops at its floor
        wrong.add([0.95, 0.95], 0)
        assert wrong.hindsight >= HINDSIGHT_FLOOR
    assert wrong.hindsight == HINDSIGHT_FLOOR
    wrong.predicted = wrong.realized = 0.0  # a record decayed to nothing predicts nothing
    assert wrong.hindsight == 1.0

    policy = Widths(default=4, max_g=8)  # the budget's survivals are the scaled ones
    policy.calibration = cal
    assert policy.survivals([2], [[]], [[0.95, 0.95]]) == [
        pytest.approx([0.95 * cal.hindsight, (0.95 * cal.hindsight) ** 2])]


def test_width_goes_wide_on_sure_drafts_and_plain_on_guesses():
    policy = _costed()
    sure, guess = [0.95] * 8, [0.05] * 8
    assert policy.width([sure] * 4) == 8  # every extra token pays for its column
    assert policy.width([guess] * 4) == 0
    # a wide pass costs for all 4 rows: two sure rows pay for it, one does not
    assert policy.width([sure, sure, guess, guess]) == 8
    assert policy.width([sure, guess, guess, guess]) == 0
    assert policy.width([[0.95] * 3 + [0.15] * 5] * 4) == 3  # cut where confidence drops
    assert policy.width([[], [], [], []]) == 0  # nothing proposed: a plain pass
    # the drafter proposes at max_g; the step's budget keeps what pays (policy.allot)
    assert policy.choose(batch=4, confidence=[sure] * 4) == 8
    none = [[] for _ in range(4)]
    assert policy.allot([8] * 4, none, [sure] * 4, packed=False) == [8] * 4
    # the calibration, not the drafter's word: its sure drafts turn out wrong
    for _ in range(50):
        policy.observe_confidence([([0.95] * 8, 0)] * 4)
    policy.choose(batch=4, confidence=[sure] * 4)
    assert policy.allot([8] * 4, none, [sure] * 4, packed=False) == [0] * 4


def test_the_widths_verdicts_teach_the_calibration_even_at_g_0(tiny_models, tiny_tokenizer,
                                                               make_requests, check_greedy):
    """A scored drafter whose drafts are always wrong: the engine learns it from the plain
    steps' verdicts on each row's first draft token and keeps to g = 0; exact all along."""

    class Wrong(SuffixDrafter):
        def propose(self, batch, g):
            prop = super().propose(batch, g)
            B = len(batch.tokens)
            prop.token_ids[:] = tiny_tokenizer.vocab_size - 1  # a token the target never picks
            prop.num_draft[:] = g
            prop.confidence = torch.full((B, g), 0.99)
            return prop

    requests = make_requests(12, seed=5, max_new=40)
    engine = SpeculativeEngine(tiny_models["target"], tiny_tokenizer, Wrong(),
                               max_batch_size=4, draft_length=4)
    for b in range(1, 5):  # costs fixed, not timed: a busy machine must not decide the test
        engine.policy.record_costs(b, {1: [0.10] * 2, 2: [0.14] * 2, 5: [0.20] * 2}, [0.0] * 2)
    engine.policy.costs.add = lambda *args, **kwargs: None
    check_greedy(requests, engine.generate(requests))
    history = list(engine.policy.history)
    assert history.count(0) > 0.8 * len(history)
    assert engine.policy.calibration(0.99) < 0.2


def test_costs_taken_on_a_busy_machine_do_not_keep_a_scored_drafter_off():
    """Shadowed (prompt lookup) calibrated while another job held the CPU: a wide pass
    measured at 5x a plain one, though it costs 1.2x once the machine is quiet. The
    scored proposals are good, so probes re-measure the wide pass and drafting resumes
    within a few hundred steps; with useless proposals it never probes."""
    for hits, drafts in ((4, True), (0, False)):
        policy = Shadowed(default=4)
        _costs(policy, 4, t1=0.10, wide=0.50, t_draft=0.0)
        history = []
        for _ in range(300):
            g = policy.choose(batch=4)
            history.append(g)
            n = min(g, 4)
            policy.observe(g, [n] * 4, [min(hits, n)] * 4, 0.0, 0.10 + 0.005 * g, g + 1)
            if g == 0:
                policy.observe_acceptance([4] * 4, [hits] * 4)
        assert (sum(1 for g in history[-100:] if g) > 50) is drafts, history
        assert any(history) is drafts


def _scored_run(policy, batch, sure, steps, pass_seconds):
    """``steps`` steps of a scored drafter (confidence 0.9 on 8 tokens a row) whose drafts
    the target takes all (``sure``) or none of, as drafting.Scored drives its policy: g from
    choose, the budget's cut (allot), then what the pass cost and what the target said.
    Returns the draft tokens each step verified."""
    conf = [[0.9] * 8 for _ in range(batch)]
    none = [[] for _ in range(batch)]
    verified = []
    for _ in range(steps):
        g = policy.choose(batch=batch, confidence=conf)
        kept = policy.allot([g] * batch, none, conf, packed=True)
        accepted = kept if sure else [0] * batch
        verified.append(sum(kept))
        policy.observe(g if any(kept) else 0, kept, accepted, 0.0,
                       pass_seconds(sum(kept)), max(kept) + 1, carried=sum(kept))
        # a row that verified nothing judges its first token all the same (drafting.verdicts)
        policy.observe_confidence([(c[:k], a) if k else (c[:1], int(sure))
                                   for c, k, a in zip(conf, kept, accepted)])
    return verified


def test_costs_taken_on_a_busy_machine_do_not_keep_a_scored_budget_plain():
    """A scored drafter (the suffix drafter: policy.Widths) whose costs came from a cache
    taken while another job held the CPU: a pass of two tokens a row at 5x a plain one. The
    budget keeps nothing at that price, so no wide pass would ever measure it again; probes
    of one token a row do, and once they show a token costs a twentieth of a plain pass the
    budget verifies the sure drafts. Drafts the target never takes are not probed for."""
    for sure in (True, False):
        policy = Widths(default=4, max_g=8)
        policy.record_costs(4, {1: [0.10] * 2, 2: [0.50] * 2, 5: [0.60] * 2}, [0.0] * 2)
        verified = _scored_run(policy, 4, sure, 400,
                               pass_seconds=lambda carried: 0.10 + 0.005 * carried)
        if sure:
            assert sum(verified[-100:]) > 100 * 4, verified
        else:
            assert sum(verified[100:]) <= 4 * 5, verified  # a few probes while learning
