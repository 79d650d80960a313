"""Per-request counters add up, whatever the drafter."""

import pytest

from specq.worker.engine.drafters import DraftModel, NoDraft, PromptLookup
from specq.worker.engine.speculative import SpeculativeEngine


@pytest.mark.parametrize("drafter", ["noisy", "prompt_lookup", "none"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_counters_are_consistent(drafter, temperature, tiny_models, tiny_tokenizer,
                                 make_requests):
    d = {"none": NoDraft(), "prompt_lookup": PromptLookup()}.get(drafter) or DraftModel(
        tiny_models[drafter])
    g = 4
    requests = make_requests(20, seed=5, temperature=temperature)
    results = SpeculativeEngine(tiny_models["target"], tiny_tokenizer, d, max_batch_size=6,
                                draft_length=g, adaptive=False).generate(requests)
    for req, res in zip(requests, results):
        c = res.counters
        assert c.new_tokens == len(res.token_ids) >= 1
        assert len(res.token_ids) <= req.max_new_tokens
        assert res.finish_reason == ("length" if len(res.token_ids) == req.max_new_tokens
                                     and res.token_ids[-1] != 2 else "stop")
        assert 0 <= c.accepted <= c.proposed <= g * c.draft_steps
        assert sum(c.accepted_by_position) == c.accepted
        assert sum(c.steps_by_draft_length) == c.target_passes - 1  # all steps but the prefill
        # per row: its steps by the drafts it verified, each step once, every draft counted
        hist = c.steps_by_drafts_verified
        assert sum(hist) == c.target_passes - 1
        assert not hist or hist[-1] > 0
        assert sum(n * k for n, k in enumerate(hist)) == c.proposed
        assert sum(hist[1:]) == c.draft_steps
        assert c.verified_per_token == (c.target_passes + c.proposed) / c.new_tokens
        assert all(a >= b for a, b in zip(c.accepted_by_position, c.accepted_by_position[1:]))
        # each target pass emits one token of its own (the last may be cut by a limit)
        assert c.accepted + c.target_passes - 1 <= c.new_tokens <= c.accepted + c.target_passes
        assert c.draft_time >= 0 and c.verify_time > 0
        if drafter == "none":
            assert c.proposed == 0 and c.target_passes == c.new_tokens
            assert c.acceptance_rate is None and c.mean_acceptance_length is None
        elif c.draft_steps:
            assert c.mean_acceptance_length == 1 + c.accepted / c.draft_steps
    if drafter != "none":
        assert sum(r.counters.proposed for r in results) > 0


def test_the_steps_on_step_sees_add_up_to_the_counters(tiny_models, tiny_tokenizer,
                                                       make_requests):
    steps = []
    engine = SpeculativeEngine(tiny_models["target"], tiny_tokenizer,
                               DraftModel(tiny_models["near"]), max_batch_size=4,
                               draft_length=3, adaptive=False, on_step=steps.append)
    results = engine.generate(make_requests(12, seed=2, max_new=24))
    counters = [r.counters for r in results]
    assert sum(len(s.num_draft) for s in steps) == sum(c.target_passes - 1 for c in counters)
    assert sum(sum(s.num_draft) for s in steps) == sum(c.proposed for c in counters)
    assert sum(sum(s.accepted) for s in steps) >= sum(c.accepted for c in counters)
    assert sum(s.t_draft for s in steps) == pytest.approx(sum(c.draft_time for c in counters))
    for s in steps:
        assert s.g == 3 and s.verify_tokens == 4
        assert [len(t) for t in s.tokens] == [k + 1 for k in s.accepted]
        assert 0 < s.t_draft and 0 < s.t_verify and s.t_draft + s.t_verify <= s.t_step
    # each request's first token comes from its prefill, the others from steps (the last
    # step of a request may be cut short by its limit)
    emitted = sum(len(t) for s in steps for t in s.tokens)
    assert sum(c.new_tokens for c in counters) <= len(results) + emitted
