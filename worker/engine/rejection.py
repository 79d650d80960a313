"""Speculative rejection sampling as a pure tensor function.

Leviathan et al. 2023 (arXiv 2211.17192), Algorithm 1; Chen et al. 2023 (arXiv 2302.01318).

Glossary, per row:
- draft tokens x_1..x_n (n = num_draft, at most g), proposed with draft_probs q;
- accepted: the longest prefix with u_i < p(x_i) / q(x_i), p = target_probs;
- recovered: at the first rejection i, a token from norm(max(0, p_i - q_i));
- bonus: when all n are accepted, a token from p_{n+1}.
Output tokens = accepted + (recovered or bonus): 1 to n + 1 of them, so the output
follows p exactly. A drafter without a distribution (prompt lookup) is a point mass
q = one_hot(x); greedy rows have one-hot p, which reduces the test to x_i == argmax.

accept_matching is the coupled form: the target draws its own token y_i at every slot
first (its argmax, or a sample keyed by seed and position), and a draft token is accepted
while x_i == y_i; the output is y_1..y_k+1, what the target alone would emit, whatever was
drafted. For a point-mass draft this is Algorithm 1 in law and in acceptance (P(y = x) =
p(x)); for a draft model it needs x drawn with the noise y is drawn with (keyed_race).
"""

from __future__ import annotations

import torch

from specq.worker.engine.sampling import sample


def rejection_sample(
    draft_token_ids: torch.Tensor,
    num_draft: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    accept_uniforms: torch.Tensor,
    sample_uniforms: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept or reject each row's draft and emit the tokens that follow the target.

    draft_token_ids: [B, g] int64 (entries at or past num_draft are ignored)
    num_draft:       [B] int64, 0 <= num_draft <= g
    draft_probs:     [B, g, V] float, or None for point-mass drafts
    target_probs:    [B, g + 1, V] float
    accept_uniforms: [B, g] in [0, 1)
    sample_uniforms: [B, g + 1] in [0, 1); slot num_accepted draws the recovered/bonus token
    returns (output_token_ids [B, g + 1], -1 past each row's end; num_accepted [B])
    """
    B, g = draft_token_ids.shape
    rows = torch.arange(B, device=target_probs.device)
    x = draft_token_ids.clamp(min=0)  # [B, g]
    p_x = target_probs[:, :g].gather(-1, x[..., None])[..., 0].double()  # [B, g]
    if draft_probs is None:
        q_x = torch.ones_like(p_x)
    else:
        q_x = draft_probs.gather(-1, x[..., None])[..., 0].double()
    in_draft = torch.arange(g, device=x.device)[None, :] < num_draft[:, None]  # [B, g]
    accept = (accept_uniforms.double() * q_x < p_x) & in_draft
    num_accepted = accept.long().cumprod(1).sum(1)  # [B]

    p_k = target_probs[rows, num_accepted].float()  # [B, V]
    rejected = num_accepted < num_draft  # [B]
    if g > 0:  # for every row (those that accepted all keep p_k): asking which is a sync
        k = num_accepted.clamp(max=g - 1)
        if draft_probs is None:
            q_k = torch.zeros_like(p_k).scatter_(-1, x[rows, k][:, None], 1.0)
        else:
            q_k = draft_probs[rows, k].float()
        residual = (p_k - q_k).clamp_(min=0)
        empty = residual.sum(-1, keepdim=True) <= 0  # p == q: cannot reject, kept for safety
        residual = torch.where(empty, p_k, residual)
        p_k = torch.where(rejected[:, None], residual, p_k)
    final = sample(p_k, sample_uniforms[rows, num_accepted])  # [B]

    out = torch.full((B, g + 1), -1, dtype=torch.long, device=x.device)
    out[:, :g] = torch.where(accept.long().cumprod(1).bool(), x, -1)
    out[rows, num_accepted] = final
    return out, num_accepted


def accept_matching(
    draft_token_ids: torch.Tensor, num_draft: torch.Tensor, target_token_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept each draft token while it equals the target's own token at its slot (the
    argmax for greedy rows: rejection_sample with one-hot p, without probabilities).

    draft_token_ids: [B, g]; num_draft: [B]; target_token_ids: [B, g + 1] (one per slot)
    returns (output_token_ids [B, g + 1], num_accepted [B]) as rejection_sample does
    """
    B, g = draft_token_ids.shape
    rows = torch.arange(B, device=draft_token_ids.device)
    in_draft = torch.arange(g, device=rows.device)[None, :] < num_draft[:, None]
    accept = ((draft_token_ids == target_token_ids[:, :g]) & in_draft).long().cumprod(1)
    num_accepted = accept.sum(1)
    out = torch.full((B, g + 1), -1, dtype=torch.long, device=rows.device)
    out[:, :g] = torch.where(accept.bool(), draft_token_ids, -1)
    out[rows, num_accepted] = target_token_ids[rows, num_accepted]
    return out, num_accepted
