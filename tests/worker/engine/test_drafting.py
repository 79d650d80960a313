"""The drafting seam: a regime chosen once from the drafter's declared capabilities, and
the refill group following the batch size."""

import pytest
import torch

from specq.worker.engine import drafting, policy
from specq.worker.engine.drafters import DraftModel, NoDraft, PromptLookup, Proposal
from specq.worker.engine.speculative import SpeculativeEngine, Step
from specq.worker.engine.suffix import SuffixDrafter


@pytest.mark.parametrize("make,adaptive,regime,lengths", [
    (lambda m: DraftModel(m["near"]), True, drafting.Drafting, policy.DraftLengthPolicy),
    (lambda m: PromptLookup(), True, drafting.ShadowedDrafting, policy.Shadowed),
    (lambda m: SuffixDrafter(), True, drafting.Scored, policy.Widths),
    (lambda m: PromptLookup(), False, drafting.Drafting, policy.Pinned),
    (lambda m: NoDraft(), True, drafting.Drafting, policy.Pinned),
])
def test_the_regime_follows_the_drafters_capabilities(tiny_models, tiny_tokenizer, make,
                                                      adaptive, regime, lengths):
    engine = SpeculativeEngine(tiny_models["target"], tiny_tokenizer, make(tiny_models),
                               adaptive=adaptive)
    assert type(engine.drafting) is regime and type(engine.policy) is lengths
    assert engine.policy.adapts == (lengths is not policy.Pinned)
    if isinstance(engine.drafter, NoDraft):
        assert engine.policy.choose(batch=4) == 0  # the null object never drafts


def test_the_refill_group_follows_the_batch_size(tiny_models, tiny_tokenizer):
    """After an out-of-memory halving (worker/attempts.py sets max_batch_size), refills
    still come while rows run: a group larger than the batch would wait for it to empty."""
    engine = SpeculativeEngine(tiny_models["target"], tiny_tokenizer, max_batch_size=16)
    assert engine.admit_group == 4
    engine.max_batch_size = 2
    assert engine.admit_group == 1
    fixed = SpeculativeEngine(tiny_models["target"], tiny_tokenizer, max_batch_size=16,
                              admit_group=6)
    fixed.max_batch_size = 4
    assert fixed.admit_group == 4


def test_a_row_the_budget_cut_to_nothing_is_judged_on_its_first_token():
    """In a drafting step, a scored row whose drafts the budget dropped still teaches the
    calibration: its first draft token against the token the target emitted there."""
    full = Proposal(torch.tensor([[5, 6, 7], [8, 9, 10], [11, 12, 13]]),
                    torch.tensor([3, 3, 3]), None,
                    torch.tensor([[0.9, 0.8, 0.7], [0.2, 0.1, 0.1], [0.3, 0.3, 0.3]]))
    step = Step(g=3, num_draft=[2, 0, 0], accepted=[1, 0, 0], t_draft=0.0, t_verify=0.0,
                verify_tokens=3, tokens=[[5, 4], [8], [1]])
    judged = drafting.verdicts(full, step)
    assert [(pytest.approx(c), k) for c, k in judged] == [
        ([0.9, 0.8], 1),  # two verified, the first accepted
        ([0.2], 1),       # cut: its first draft was the token the target emitted
        ([0.3], 0),       # cut: it was not
    ]


class _Counting(SuffixDrafter):
    """A scored drafter that counts its proposals."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def propose(self, batch, g):
        self.calls += 1
        return super().propose(batch, g)


def _proposals(scored: drafting.Scored, drafter: _Counting, gains: list[float],
               kept: list[bool], share: float) -> list[bool]:
    """Drive ``scored`` one step per gain: the steps in which the drafter proposed."""
    inputs = drafting.DraftInputs([[1, 2, 3, 1, 2]], torch.zeros(1, dtype=torch.long),
                                  torch.zeros(1), torch.zeros(1), torch.ones(1), greedy=True)
    out = []
    for gain, keep in zip(gains, kept):
        before = drafter.calls
        scored.propose(inputs, [None])
        proposed = drafter.calls > before
        out.append(proposed)
        if proposed:  # what the budget would have said of the step (policy.allot)
            scored.policy.gain = gain
            step = Step(g=2 if keep else 0, num_draft=[2 if keep else 0], accepted=[0],
                        t_draft=share, t_verify=1.0 - share, verify_tokens=1, tokens=[[7]],
                        t_step=1.0)
            scored._full = None  # its verdicts are another test's
            scored._weigh(step)
    return out


def test_a_drafter_whose_drafts_are_never_kept_rests_ever_longer():
    """Proposals the budget keeps none of, worth nothing against their cost: after
    IDLE_AFTER of them the drafter skips 1 step, then 2, 4, up to IDLE_REST; a step that
    verifies its tokens ends the rest."""
    drafter = _Counting()
    scored = drafting.Scored(drafter, policy.Widths(default=4, max_g=8))
    steps = 4 + 1 + 1 + 2 + 1 + 4 + 1 + 8 + 1 + 8
    proposed = _proposals(scored, drafter, [0.0] * steps, [False] * steps, share=0.02)
    rests = "".join("p" if p else "." for p in proposed)
    assert rests == "pppp" + "." + "p" + ".." + "p" + "...." + "p" + "." * 8 + "p" + "." * 8
    # a step that keeps its drafts ends the run of idle proposals: the count starts again
    scored.rest = 0
    proposed = _proposals(scored, drafter, [0.001, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
                          [True, False, False, False, False, False, False], share=0.02)
    assert proposed == [True] * 5 + [False] + [True]


def test_a_drafter_worth_more_than_it_costs_never_rests():
    """At batch 1 a kept draft saves a good part of a pass: a step that keeps drafts now
    and then keeps the worth above the drafter's cost, and runs of empty proposals (no
    lookup found) do not make it rest, however long."""
    drafter = _Counting()
    scored = drafting.Scored(drafter, policy.Widths(default=4, max_g=8))
    kept = ([True] + [False] * 9) * 4
    gains = [0.4 if k else 0.0 for k in kept]
    assert all(_proposals(scored, drafter, gains, kept, share=0.006))
    assert scored.worth > scored.cost


def test_an_engine_rests_a_drafter_the_budget_never_keeps_and_stays_exact(
        tiny_models, tiny_tokenizer, make_requests, check_greedy):
    """A scored drafter always wrong, the costs fixed (a busy machine must not decide the
    test): once the calibration has learnt it, the budget keeps none of its drafts, and the
    drafter proposes in ever fewer steps, never more than IDLE_REST apart; the output is the
    target's own."""

    class Wrong(SuffixDrafter):
        def propose(self, batch, g):
            prop = super().propose(batch, g)
            prop.token_ids[:] = tiny_tokenizer.vocab_size - 1  # a token the target never picks
            prop.num_draft[:] = g
            prop.confidence = torch.full((len(batch.tokens), g), 0.99)
            return prop

    requests = make_requests(12, seed=5, max_new=60)
    engine = SpeculativeEngine(tiny_models["target"], tiny_tokenizer, Wrong(),
                               max_batch_size=4, draft_length=4)
    for b in range(1, 5):
        engine.policy.record_costs(b, {1: [0.10] * 2, 2: [0.14] * 2, 5: [0.20] * 2}, [0.0] * 2)
    engine.policy.costs.add = lambda *args, **kwargs: None
    steps: list[Step] = []
    engine.on_step = steps.append
    check_greedy(requests, engine.generate(requests))
    proposing = [i for i, s in enumerate(steps) if s.judged]  # a rested step judges none
    assert len(proposing) < 0.6 * len(steps)
    assert max(b - a for a, b in zip(proposing, proposing[1:])) <= drafting.IDLE_REST + 1
    assert engine.drafting.worth < engine.drafting.cost


def test_a_new_generation_proposes_from_its_first_step():
    """A rest belongs to the rows it was earned on: the engine's next generation (perhaps
    another job's) has its drafter propose at once."""
    drafter = _Counting()
    scored = drafting.Scored(drafter, policy.Widths(default=4, max_g=8))
    _proposals(scored, drafter, [0.0] * 6, [False] * 6, share=0.02)
    assert scored.rest
    scored.reset()
    assert _proposals(scored, drafter, [0.0] * 4, [False] * 4, share=0.02) == [True] * 4
