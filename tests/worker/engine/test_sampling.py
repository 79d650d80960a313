"""Temperature / top-k / top-p and the position-keyed uniforms."""

import pytest
import torch
from scipy.stats import chisquare

from specq.worker.engine import sampling
from specq.worker.engine.sampling import (
    SAMPLE,
    keyed_race,
    keyed_uniform,
    logits_to_probs,
    sample,
)


def test_greedy_rows_are_one_hot_and_sampled_rows_are_softmax():
    logits = torch.tensor([[[1.0, 3.0, 2.0]], [[1.0, 3.0, 2.0]]])
    probs = logits_to_probs(logits, torch.tensor([0.0, 2.0]), torch.tensor([0, 0]),
                            torch.tensor([1.0, 1.0]))
    assert probs[0, 0].tolist() == [0.0, 1.0, 0.0]
    assert torch.allclose(probs[1, 0], (logits[1, 0] / 2).softmax(-1))


def test_top_k_and_top_p_keep_the_right_tokens():
    logits = torch.log(torch.tensor([[[0.1, 0.4, 0.2, 0.3]]])).expand(3, 1, 4)
    probs = logits_to_probs(logits, torch.ones(3), torch.tensor([2, 0, 3]),
                            torch.tensor([1.0, 0.6, 0.8]))
    assert torch.allclose(probs[0, 0], torch.tensor([0, 4 / 7, 0, 3 / 7]))
    assert torch.allclose(probs[1, 0], torch.tensor([0, 4 / 7, 0, 3 / 7]))  # 0.4+0.3 >= 0.6
    # k=3 renormalises first, then p 0.8
    assert torch.allclose(probs[2, 0], torch.tensor([0, 4 / 9, 2 / 9, 3 / 9]))


def test_top_p_0_keeps_the_likeliest_token_alone():
    """OpenAI and HF take top_p 0: the first token of the sorted distribution stays."""
    logits = torch.log(torch.tensor([[[0.1, 0.4, 0.2, 0.3]]])).expand(2, 1, 4)
    probs = logits_to_probs(logits, torch.tensor([1.0, 2.0]), torch.tensor([0, 3]),
                            torch.tensor([0.0, 0.0]))
    assert torch.equal(probs[:, 0], torch.tensor([[0.0, 1.0, 0.0, 0.0]] * 2))


def test_keyed_uniforms_depend_only_on_seed_and_position():
    seeds = torch.tensor([7, 7, 8])
    pos = torch.tensor([[0, 1, 2], [0, 1, 2], [0, 1, 2]])
    u = keyed_uniform(seeds, pos, SAMPLE)
    assert torch.equal(u[0], u[1]) and not torch.equal(u[0], u[2])
    assert torch.equal(keyed_uniform(seeds[:1], pos[:1, 1:], SAMPLE), u[:1, 1:])
    big = keyed_uniform(torch.arange(1000), torch.arange(100)[None].expand(1000, 100), SAMPLE)
    assert 0 <= big.min() and big.max() < 1 and abs(big.mean() - 0.5) < 0.005


def test_inverse_cdf_sampling_never_picks_a_zero_probability_token():
    probs = torch.tensor([0.0, 0.5, 0.0, 0.5, 0.0]).expand(10_000, 5)
    toks = sample(probs, torch.rand(10_000, dtype=torch.float64))
    assert set(toks.tolist()) == {1, 3}
    assert sample(probs[:1], torch.tensor([0.0])).item() == 1


P = torch.tensor([0.05, 0.40, 0.25, 0.20, 0.10, 0.0])
Q = torch.tensor([0.30, 0.10, 0.25, 0.05, 0.25, 0.05])


def test_keyed_race_follows_the_distribution_and_depends_only_on_seed_and_position():
    N = 100_000
    seeds, pos = torch.arange(N), torch.full((N, 1), 17)
    tokens = keyed_race(P.expand(N, 1, 6), seeds, pos)[:, 0]  # [N]
    counts = torch.bincount(tokens, minlength=6).double()
    assert counts[5] == 0, "a zero-probability token was drawn"
    assert chisquare(counts[:5].numpy(), (P[:5].double() * N).numpy()).pvalue > 1e-3
    # the same (seed, position): the same draw, whatever else is in the batch
    again = keyed_race(P.expand(3, 2, 6), seeds[[5, 5, 9]], torch.tensor([[17, 18]] * 3))
    assert again[0, 0] == again[1, 0] == tokens[5] and again[2, 0] == tokens[9]


def test_two_distributions_raced_with_one_noise_agree_as_the_bound_says():
    """Daliri et al. (arXiv 2408.07978): P(draws agree) >= (1 - TV) / (1 + TV); each draw
    still follows its own distribution."""
    N = 100_000
    seeds, pos = torch.arange(N), torch.zeros(N, 1, dtype=torch.long)
    p = keyed_race(P.expand(N, 1, 6), seeds, pos)[:, 0]
    q = keyed_race(Q.expand(N, 1, 6), seeds, pos)[:, 0]
    tv = float((P - Q).abs().sum() / 2)
    agree = float((p == q).double().mean())
    assert (1 - tv) / (1 + tv) - 0.01 < agree <= 1 - tv + 0.01, (agree, tv)
    counts = torch.bincount(q, minlength=6).double()
    assert chisquare(counts.numpy(), (Q.double() * N).numpy()).pvalue > 1e-3


def _nucleus(logits: torch.Tensor, k: int, p: float) -> int:
    """How many tokens top-k then top-p keep, by a sort of the whole row in float64 (the
    reference); -1 where the cut is a near-tie (the mass before it within 1e-6 of p)."""
    ranked = logits.double().sort(descending=True).values
    if k:
        ranked = ranked[:k]
    probs = ranked.softmax(-1)
    before = probs.cumsum(-1) - probs
    if p >= 1.0:
        return len(ranked)
    if len(before) > 1 and (before[1:] - p).abs().min() < 1e-6:  # the first always stays
        return -1
    return max(1, int((before < p).sum()))


@pytest.mark.parametrize("candidates", [(8, 64), ()])
def test_top_k_and_top_p_find_the_cut_a_full_sort_finds(candidates, monkeypatch):
    """The cut is looked for among a row's likeliest first (sampling.CANDIDATES, small
    here so every stage runs; none: one sort, as on a GPU): rows whose nucleus is short,
    long, past every stage, top-k beyond the first stage, both, neither; the kept tokens
    are a float64 sort's, the probabilities their renormalised ones, and a row's alone
    equal to the batch's."""
    monkeypatch.setattr(sampling, "CANDIDATES", candidates)
    V, gen = 300, torch.Generator().manual_seed(5)
    sharp = torch.randn(40, V, generator=gen) * torch.linspace(0.2, 6.0, 40)[:, None]
    top_k = torch.tensor([0, 3, 50, 200, 0, 7, 299, 0] * 5)
    top_p = torch.tensor([0.9, 1.0, 0.99, 0.5, 0.999, 0.0, 0.95, 0.7] * 5)
    t = torch.ones(40)
    probs = logits_to_probs(sharp[:, None], t, top_k, top_p)[:, 0]  # [40, V]
    near = 0
    for m in range(40):
        want = _nucleus(sharp[m], int(top_k[m]), float(top_p[m]))
        if want < 0:
            near += 1
            continue
        kept = probs[m] > 0
        assert int(kept.sum()) == want, m
        ref = sharp[m].masked_fill(~kept, float("-inf")).softmax(-1)
        assert torch.allclose(probs[m], ref, atol=1e-6), m
        alone = logits_to_probs(sharp[m : m + 1, None], t[:1], top_k[m : m + 1],
                                top_p[m : m + 1])[0, 0]
        assert torch.equal(alone, probs[m]), m
    assert near <= 2
