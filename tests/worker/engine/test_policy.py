"""Draft-length choice: the speedup arithmetic and the choices it leads to."""

import pytest

from worker.engine.drafters import DraftModel
from worker.engine.policy import (
    DraftLengthPolicy,
    expected_tokens,
    measured_speedup,
    theorem_speedup,
)
from worker.engine.speculative import SpeculativeEngine


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
          steps=40)
    assert 4 in cheap.history[2:], "it probes again now and then"
    pinned = DraftLengthPolicy(default=3, adaptive=False)
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


def test_probing_stays_frequent_enough():
    policy = DraftLengthPolicy(default=4, max_g=8, probe_every=4, max_probe_every=16)
    _feed(policy, 4, alpha_hits=0, t_draft=0.0, t_verify_by_n=lambda n: 0.1 + 0.001 * n,
          steps=400)
    gaps = [i for i, g in enumerate(policy.history) if g]
    assert max(b - a for a, b in zip(gaps, gaps[1:])) <= 17


def test_engine_stops_drafting_with_a_useless_draft(tiny_models, tiny_tokenizer, make_requests,
                                                    check_greedy):
    """An unrelated draft is never accepted: whatever the timings, g = 0 wins (the choice
    for a useful draft depends on measured costs, so the unit tests above drive it)."""
    requests = make_requests(16, seed=7, max_new=64)
    engine = SpeculativeEngine(tiny_models["target"], tiny_tokenizer,
                               DraftModel(tiny_models["unrelated"]), max_batch_size=4)
    results = engine.generate(requests)
    history = engine.policy.history
    assert history.count(0) / len(history) > 0.5, history
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
