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
