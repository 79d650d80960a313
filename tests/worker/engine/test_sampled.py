"""Sampled speculative output follows target-only sampling; seeds reproduce across batches."""

import pytest
import torch
from scipy.stats import chisquare

from specq.schema.generation import Request
from specq.worker.engine.drafters import DraftModel, NoDraft, PromptLookup
from specq.worker.engine.policy import DraftLengthPolicy
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


def _samples(engine, n, params, max_new=2, seeded=True):
    reqs = [Request(id=i, prompt_token_ids=PROMPT, max_new_tokens=max_new,
                    seed=10_000 + i if seeded else None, **params) for i in range(n)]
    return engine.generate(reqs)


@pytest.mark.parametrize("seeded", [True, False], ids=["seeded-race", "unseeded-algorithm-1"])
def test_sampled_speculative_tokens_follow_the_target(seeded, tiny_models, tiny_tokenizer,
                                                      fixed_entropy):
    """The second token comes from a draft/verify step; its law is the target's, both
    where the draft races the target (seeded rows) and where Algorithm 1 judges it."""
    params = dict(temperature=1.0, top_k=6, top_p=0.95)
    exact = _exact_second_token(tiny_models["target"], params)
    engine = SpeculativeEngine(tiny_models["target"], tiny_tokenizer,
                               DraftModel(tiny_models["noisy"]), max_batch_size=64,
                               draft_length=3)
    results = _samples(engine, 4000, params, seeded=seeded)
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
                               max_batch_size=64, draft_length=4, adaptive=False)  # drafts
    results = _samples(engine, 3000, params)  # every step, whatever a busy machine times
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


class _Cycling(DraftLengthPolicy):
    """A policy that changes g every step, 0 included: the worst case for reproducibility."""

    def choose(self, batch=None):
        return self.steps * 5 % 7


def _drafter(kind, tiny_models):
    # the noisy draft: the near one agrees with the target's draws almost always
    return DraftModel(tiny_models["noisy"]) if kind == "draft model" else PromptLookup()


# the probe of each drafter: the tiny target copies little of its prompt when it samples
# hotly, so prompt lookup's probe runs cool (still sampled) on a prompt of repeated tokens
PROBES = {
    "draft model": dict(prompt="abcabcabd abcabcabd abc", temperature=0.8, top_p=0.95),
    "prompt lookup": dict(prompt_token_ids=[17, 90, 4, 233, 61, 8, 150, 42] * 4,
                          temperature=0.1),
}


@pytest.mark.parametrize("kind", list(PROBES))
def test_a_seeded_request_gives_the_same_text_whatever_g(kind, tiny_models, tiny_tokenizer):
    """Adaptive draft length, every fixed g from 0 to 6 and a g changing every step give
    one text, at batch 1 and 3 (the probe between a greedy and an unseeded sampled row):
    each sampled token is the target's own keyed draw, whatever was drafted."""
    probe = Request(id="probe", max_new_tokens=48, seed=4321, **PROBES[kind])
    neighbours = [Request(id="greedy", prompt="abcabc abc", max_new_tokens=20),
                  Request(id="unseeded", prompt="xyzxyz", max_new_tokens=30, temperature=1.0)]
    texts, accepted, proposed = {}, 0, 0
    for B, batch in [(1, [probe]), (3, [neighbours[0], probe, neighbours[1]])]:
        for g in [None, "cycling", *range(7)]:
            engine = SpeculativeEngine(tiny_models["target"], tiny_tokenizer,
                                       _drafter(kind, tiny_models), max_batch_size=B,
                                       draft_length=4 if g in (None, "cycling") else g,
                                       adaptive=g is None, max_draft_length=6)
            if g == "cycling":
                engine.policy = _Cycling(default=4, max_g=6)
            result = next(r for r in engine.generate(batch) if r.id == "probe")
            texts[B, g] = result.token_ids
            accepted += result.counters.accepted
            proposed += result.counters.proposed
    assert len(set(map(tuple, texts.values()))) == 1, texts
    # drafts were judged both ways: accepted ones and rejected ones
    assert len(texts[1, 0]) > 10 and 10 < accepted < proposed - 10, (accepted, proposed)


def test_prompt_lookup_and_plain_decoding_sample_the_same_seeded_text(tiny_models,
                                                                      tiny_tokenizer):
    """Point-mass drafts draw nothing themselves: a seeded request's text is the plain
    target's, with or without prompt lookup."""
    probe = Request(id=0, prompt="abcabcabd abcabcabd abc", max_new_tokens=40,
                    temperature=0.8, seed=99)
    outs = [SpeculativeEngine(tiny_models["target"], tiny_tokenizer, drafter,
                              draft_length=4).generate([probe])[0].token_ids
            for drafter in (PromptLookup(), NoDraft())]
    assert outs[0] == outs[1]
