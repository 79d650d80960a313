"""Temperature / top-k / top-p and the position-keyed uniforms."""

import torch
from scipy.stats import chisquare

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
