"""The rejection sampler as a pure function on a five-token vocabulary."""

import torch
from scipy.stats import chisquare

from specq.worker.engine.rejection import accept_matching, rejection_sample

P = torch.tensor([0.05, 0.40, 0.25, 0.20, 0.10])  # target
Q = torch.tensor([0.30, 0.10, 0.25, 0.05, 0.30])  # draft, deliberately unlike P


def test_first_token_follows_target_by_enumeration():
    """Every draft token x (weight q(x)) x a grid of both uniforms: the emitted mass is p."""
    M = 400
    grid = (torch.arange(M, dtype=torch.float64) + 0.5) / M
    x, ua, us = torch.meshgrid(torch.arange(5.0, dtype=torch.float64), grid, grid, indexing="ij")
    x, ua, us = x.reshape(-1).long(), ua.reshape(-1), us.reshape(-1)
    B = x.numel()
    weight = Q[x].double() / M / M  # [B]
    out, accepted = rejection_sample(
        draft_token_ids=x[:, None],
        num_draft=torch.ones(B, dtype=torch.long),
        draft_probs=Q.expand(B, 1, 5),
        target_probs=torch.stack([P, P]).expand(B, 2, 5),
        accept_uniforms=ua[:, None],
        sample_uniforms=torch.stack([us, us], 1),
    )
    mass = torch.zeros(5, dtype=torch.float64).index_add_(0, out[:, 0], weight)
    assert torch.allclose(mass, P.double(), atol=3 / M), mass
    # acceptance probability is sum_x min(p, q) (Leviathan eq. 1)
    accept_mass = weight[accepted == 1].sum()
    assert abs(accept_mass - torch.minimum(P, Q).sum()) < 2 / M


def _chi2_ok(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(tokens, minlength=probs.numel()).double()
    return chisquare(counts.numpy(), (probs.double() * counts.sum()).numpy()).pvalue


def test_each_position_follows_target_over_many_samples():
    """g = 3 with a model draft: emitted token i (when emitted) follows p_i."""
    gen = torch.Generator().manual_seed(0)
    B, g = 200_000, 3
    target = torch.stack([P, P.flip(0), torch.full((5,), 0.2), P])  # [g + 1, V]
    draft = torch.stack([Q, Q.flip(0), Q])  # [g, V]
    x = torch.multinomial(draft, B, replacement=True, generator=gen).T  # [B, g]
    out, accepted = rejection_sample(
        x, torch.full((B,), g), draft.expand(B, g, 5), target.expand(B, g + 1, 5),
        torch.rand(B, g, generator=gen, dtype=torch.float64),
        torch.rand(B, g + 1, generator=gen, dtype=torch.float64),
    )
    for i in range(g + 1):
        emitted = out[:, i] >= 0
        assert emitted.sum() > 1000
        assert _chi2_ok(out[emitted, i], target[i]) > 1e-3, i
    assert ((out >= 0).sum(1) == accepted + 1).all()


def test_point_mass_draft_follows_target():
    """Prompt lookup proposes without a distribution: q is a point mass at x."""
    gen = torch.Generator().manual_seed(1)
    B = 200_000
    x = torch.full((B, 2), 1)  # always proposes token 1
    out, accepted = rejection_sample(
        x, torch.full((B,), 2), None, P.expand(B, 3, 5),
        torch.rand(B, 2, generator=gen, dtype=torch.float64),
        torch.rand(B, 3, generator=gen, dtype=torch.float64),
    )
    assert _chi2_ok(out[:, 0], P) > 1e-3
    assert abs((accepted >= 1).double().mean() - P[1]) < 0.005


def test_greedy_rows_accept_exactly_the_argmax_prefix():
    target = torch.zeros(2, 4, 5)
    target[:, torch.arange(4), torch.tensor([3, 1, 4, 0])] = 1.0  # one-hot argmax 3, 1, 4, 0
    drafts = torch.tensor([[3, 1, 2], [3, 1, 4]])
    out, accepted = rejection_sample(
        drafts, torch.tensor([3, 3]), None, target,
        torch.rand(2, 3, dtype=torch.float64), torch.rand(2, 4, dtype=torch.float64),
    )
    assert accepted.tolist() == [2, 3]
    assert out.tolist() == [[3, 1, 4, -1], [3, 1, 4, 0]]


def test_rows_with_fewer_drafts_get_a_bonus_from_the_target():
    target = torch.zeros(2, 3, 5)
    target[:, torch.arange(3), torch.tensor([2, 2, 2])] = 1.0
    out, accepted = rejection_sample(
        torch.tensor([[2, 2], [2, 2]]), torch.tensor([0, 1]), None, target,
        torch.rand(2, 2, dtype=torch.float64), torch.rand(2, 3, dtype=torch.float64),
    )
    assert accepted.tolist() == [0, 1]
    assert out.tolist() == [[2, -1, -1], [2, 2, -1]]


def test_greedy_fast_path_equals_the_general_sampler():
    gen = torch.Generator().manual_seed(3)
    B, g, V = 500, 4, 5
    target_ids = torch.randint(0, V, (B, g + 1), generator=gen)
    drafts = torch.where(torch.rand(B, g, generator=gen) < 0.7, target_ids[:, :g],
                         torch.randint(0, V, (B, g), generator=gen))
    num = torch.randint(0, g + 1, (B,), generator=gen)
    one_hot = torch.nn.functional.one_hot(target_ids, V).float()
    want = rejection_sample(drafts, num, None, one_hot, torch.rand(B, g, dtype=torch.float64),
                            torch.rand(B, g + 1, dtype=torch.float64))
    got = accept_matching(drafts, num, target_ids)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
