"""A free drafter scored while the engine does not draft (shadow.py)."""

import pytest

from specq.schema.generation import Request
from specq.worker.engine import policy, shadow
from specq.worker.engine.batch import Row
from specq.worker.engine.drafters import PromptLookup
from specq.worker.engine.speculative import SpeculativeEngine


def _row(tokens, max_new=50):
    return Row(Request(prompt_token_ids=tokens, max_new_tokens=max_new), tokens, {0}, None)


def test_a_held_proposal_ends_at_its_first_mismatch_or_when_all_of_it_came():
    a, b, c = _row([1, 2, 3, 1, 2]), _row([7, 8, 9]), _row([4, 5, 4, 5, 4])
    shadow.hold(PromptLookup(), [a, b, c], 3)
    assert a.shadow == ([3, 1, 2], 0) and b.shadow == ([], 0) and c.shadow == ([5, 4], 0)
    # a: 3 matches; b proposed nothing; c: 5 matches
    assert shadow.score([a, b, c], [[3], [1], [5]]) == ([0], [0])
    assert a.shadow == ([3, 1, 2], 1) and b.shadow is None
    # a: 1 matches, then a mismatch in the same step; c: all of it came
    assert shadow.score([a, c], [[1, 9], [4, 5]]) == ([3, 2], [2, 2])
    assert a.shadow is None and c.shadow is None


def test_a_proposal_cut_short_by_the_end_of_its_row_is_not_judged():
    row = _row([1, 2, 3, 1, 2], max_new=1)
    shadow.hold(PromptLookup(), [row], 3)
    row.emit([3])  # the row ends: max_new_tokens reached
    assert shadow.score([row], [[3]]) == ([], [])
    assert row.shadow is None


def test_idle_scoring_measures_what_drafting_measures(tiny_models, tiny_tokenizer,
                                                      make_requests, check_greedy,
                                                      monkeypatch):
    """Greedy rows: the same lookup proposals judged by the target's own tokens while the
    engine does not draft give the acceptance that drafting steps measure."""
    requests = make_requests(16, seed=11, max_new=48)
    monkeypatch.setattr(policy, "ACCEPTANCE_DECAY", 1.0)  # no decay: the run's whole MLE

    def alpha(idle: bool) -> float:
        engine = SpeculativeEngine(tiny_models["target"], tiny_tokenizer, PromptLookup(),
                                   max_batch_size=4, draft_length=3, adaptive=idle)
        if idle:  # costs at which drafting never pays, at every batch size the run sees
            # (4, and 1 in its tail: a batch size far from any measured one measures its own)
            for b in (1, 4):
                engine.policy.record_costs(b, {1: [0.1] * 2, 2: [10.0] * 2}, [1.0] * 2)
        check_greedy(requests, engine.generate(requests))
        if idle:
            assert set(engine.policy.history) == {0}
        return engine.policy.alpha

    idle, drafting = alpha(True), alpha(False)
    print(f"alpha idle {idle:.3f} drafting {drafting:.3f}")
    assert idle == pytest.approx(drafting, abs=0.05)
