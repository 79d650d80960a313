"""Sampled speculative output follows target-only sampling; seeds reproduce across batches."""

import pytest
import torch
from scipy.stats import chisquare

from specq.configs.generation import Request
from specq.worker.engine.drafters import DraftModel, NoDraft, PromptLookup
from specq.worker.engine.speculative import SpeculativeEngine
from specq.worker.engine.suffix import SuffixDrafter

PROMPT = [40, 41, 42, 43, 44, 45, 46, 40, 41, 42]


def _exact_second_token(target, params) -> torch.Tensor:
    """P(token 2) = sum_t1 p(t1) p(t2 | t1), by enumerating t1 (one batched forward)."""
    from specq.worker.engine.sampling import logits_to_probs

    t, k, p = (torch.tensor([params[x]]) for x in ("temperature", "top_k", "top_p"))
    with torch.no_grad():
        first = logits_to_probs(target(torch.tensor([PROMPT])).logits[:, -1:], t, k, p)[0, 0]
        support = first.nonzero()[:, 0]
        seqs = torch.cat([torch.tensor([PROMPT]).expand(len(support), -1), support[:, None]], 1)
        n = len(support)
        second = logits_to_probs(target(seqs).logits[:, -1:], t.expand(n), k.expand(n),
                                 p.expand(n))[:, 0]
    return (first[support, None] * second).sum(0)


def _goodness_of_fit(tokens: torch.Tensor, exact: torch.Tensor) -> float:
    """Chi-square p-value of tokens against the exact law; off-support tokens fail outright."""
    counts = torch.bincount(tokens, minlength=exact.numel()).double()
    keep = exact > 0
    assert counts[~keep].sum() == 0, "a token the target cannot produce was emitted"
    e = exact[keep].double()
    return chisquare(counts[keep].numpy(), (e / e.sum() * counts.sum()).numpy()).pvalue


def _samples(engine, n, params, max_new=2):
    reqs = [Request(id=i, prompt_token_ids=PROMPT, max_new_tokens=max_new, seed=10_000 + i,
                    **params) for i in range(n)]
    return engine.generate(reqs)


def test_sampled_speculative_tokens_follow_the_target(tiny_models, tiny_tokenizer):
    """The second token comes from a draft/verify step; its law is the target's."""
    params = dict(temperature=1.0, top_k=6, top_p=0.95)
    exact = _exact_second_token(tiny_models["target"], params)
    engine = SpeculativeEngine(tiny_models["target"], tiny_tokenizer,
                               DraftModel(tiny_models["noisy"]), max_batch_size=64,
                               draft_length=3)
    results = _samples(engine, 4000, params)
    second = torch.tensor([r.token_ids[1] for r in results if len(r.token_ids) > 1])
    pvalue = _goodness_of_fit(second, exact)
    accepted = sum(r.counters.accepted for r in results)
    proposed = sum(r.counters.proposed for r in results)
    assert 0.1 * proposed < accepted < 0.95 * proposed  # both accept and recover paths ran
    assert pvalue > 1e-3, pvalue


@pytest.mark.parametrize("make", [PromptLookup, SuffixDrafter, NoDraft])
def test_point_mass_sampling_matches_plain_sampling(tiny_models, tiny_tokenizer, make):
    """Point-mass drafts (prompt lookup; the suffix drafter, whose job index fills with
    the rows sampled before): the target's law (chi-square against the exact one)."""
    params = dict(temperature=0.8, top_k=5, top_p=1.0)
    exact = _exact_second_token(tiny_models["target"], params)
    drafter = make()
    engine = SpeculativeEngine(tiny_models["target"], tiny_tokenizer, drafter,
                               max_batch_size=64, draft_length=4)
    results = _samples(engine, 3000, params)
    second = torch.tensor([r.token_ids[1] for r in results if len(r.token_ids) > 1])
    assert _goodness_of_fit(second, exact) > 1e-3, drafter.name
    if make is SuffixDrafter:
        assert sum(r.counters.accepted for r in results) > 0


def test_seed_gives_the_same_text_whatever_the_batch(tiny_models, tiny_tokenizer):
    probe = Request(id="probe", prompt="the seeded one", max_new_tokens=40, temperature=0.9,
                    top_p=0.9, seed=1234)
    neighbours = [Request(id=i, prompt="x" * (i + 1), max_new_tokens=5 + 3 * i,
                          temperature=0.7, seed=i) for i in range(15)]
    outs = []
    for bs, batch in [(1, [probe]), (7, neighbours[:6] + [probe]),
                      (16, [probe] + neighbours[::-1])]:
        engine = SpeculativeEngine(tiny_models["target"], tiny_tokenizer,
                                   DraftModel(tiny_models["noisy"]), max_batch_size=bs,
                                   draft_length=4)
        outs.append(next(r for r in engine.generate(batch) if r.id == "probe").token_ids)
    assert outs[0] == outs[1] == outs[2]
    unseeded = [Request(id=i, prompt="the seeded one", max_new_tokens=40, temperature=0.9)
                for i in range(2)]
    a, b = SpeculativeEngine(tiny_models["target"], tiny_tokenizer).generate(unseeded)
    assert a.token_ids != b.token_ids  # no seed: fresh randomness per request
