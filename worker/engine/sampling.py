"""Logits to probabilities (temperature, top-k, top-p) and seeded, position-keyed sampling.

Randomness is a pure function of (request seed, token position, stream): the uniform a
row draws for position t does not depend on the batch it shares or its slot, so a seeded
request gives the same text at any batch size. Two samplers read it: inverse-CDF
``sample`` (one uniform per position) and ``keyed_race`` (Gumbel-max, one uniform per
position and token), which lets a draft model and the target sample with the same noise.
"""

from __future__ import annotations

import torch

M32 = 0xFFFFFFFF
# Streams: which use of a position's randomness.
ACCEPT, SAMPLE, RACE = 2, 3, 4
# top-k and top-p look for their cut among a row's likeliest tokens, these many first
# (``_lowest_kept``), then the whole vocabulary
CANDIDATES: tuple[int, ...] = (1024,)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (lowbias32) on int64 tensors holding values < 2**32."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & M32  # wraps in int64; the low 32 bits are right
    return x ^ (x >> 16)


def _key(seeds: torch.Tensor, positions: torch.Tensor, stream: int) -> torch.Tensor:
    """A 32-bit hash of (seed, position, stream). seeds: [B]; positions: [B, T] -> [B, T]"""
    s = seeds[:, None]
    h = _mix32((positions & M32) ^ _mix32(torch.full_like(positions, stream)))
    h = _mix32(h ^ (s & M32))
    return _mix32(h ^ ((s >> 32) & M32))


def keyed_uniform(seeds: torch.Tensor, positions: torch.Tensor, stream: int) -> torch.Tensor:
    """Uniforms in [0, 1), one per (seed, position).

    seeds: [B] int64; positions: [B, T] int64 -> [B, T] float64
    """
    h = _key(seeds, positions, stream)
    h2 = _mix32(h ^ 0x9E3779B9)
    # 53 random bits -> a double in [0, 1)
    return ((h << 21) | (h2 >> 11)).to(torch.float64) / float(2**53)


def logits_to_probs(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
) -> torch.Tensor:
    """Per-row temperature, then top-k, then top-p (HF's order); temperature 0 is greedy.

    logits: [B, T, V]; temperature, top_p: [B] float; top_k: [B] int (0 = off), best on
    the host: which filters apply is read from them there, without waiting for the device
    returns probs [B, T, V] float32; a greedy row is one-hot at its argmax.
    """
    B, T, V = logits.shape
    logits = logits.float()
    greedy = temperature <= 0  # [B]
    if bool(greedy.all()):
        return _one_hot_argmax(logits)
    t = torch.where(greedy, torch.ones_like(temperature), temperature)
    filt_k = (top_k > 0) & (top_k < V)
    filt_p = top_p < 1.0
    any_greedy, any_filter = bool(greedy.any()), bool(filt_k.any() | filt_p.any())
    greedy, t, filt_k, filt_p, top_k, top_p = (
        x.to(logits.device) for x in (greedy, t, filt_k, filt_p, top_k, top_p))
    scaled = logits / t.to(logits.dtype)[:, None, None]
    if any_filter:
        lowest = _lowest_kept(scaled.reshape(B * T, V), *(
            x.repeat_interleave(T) for x in (filt_k, top_k, filt_p, top_p)))  # [B * T]
        scaled = scaled.masked_fill(scaled < lowest.view(B, T, 1), float("-inf"))
    probs = scaled.softmax(-1)
    if any_greedy:
        probs = torch.where(greedy[:, None, None], _one_hot_argmax(logits), probs)
    return probs


def _lowest_kept(scaled: torch.Tensor, filt_k: torch.Tensor, top_k: torch.Tensor,
                 filt_p: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The lowest logit top-k then top-p keep, per row; a token as likely stays too (as
    transformers' top-k keeps ties). scaled: [M, V]; the rest [M] -> [M]

    Top-p keeps the smallest set of likeliest tokens whose mass, under the top-k
    distribution, reaches top_p. A sort of the whole vocabulary finds it, but the cut
    usually falls among the first few hundred tokens: each row looks for it among its
    ``CANDIDATES`` likeliest first (``topk``, a fifth of a sort's time), and a row whose
    nucleus is longer (a flat distribution: temperature 1.5, top-p 0.99) sorts the whole
    vocabulary after all. A row's stage depends on the row alone, so its cut does not
    depend on the batch it shares. On a GPU one sort.
    """
    M, V = scaled.shape
    lowest = scaled.new_full((M,), float("-inf"))
    if scaled.device.type != "cpu":  # one sort: moving a row on would read the device
        stages, at, host_k = [V], [list(range(M))], [V] * M
    else:  # each row starts at the first count that holds its top-k
        stages = [k for k in CANDIDATES if k < V] + [V]
        at = [[] for _ in stages]
        host_k = torch.where(filt_k, top_k, 0).tolist()
        for m, need in enumerate(host_k):
            at[next(i for i, count in enumerate(stages) if count >= need)].append(m)
    for i, K in enumerate(stages):
        if not at[i]:
            continue
        at[i].sort()  # rows moved on from the last stage join its own
        rows = torch.tensor(at[i], device=scaled.device)
        x = scaled if len(at[i]) == M else scaled[rows]  # [m, V]: a copy only of some rows
        fk, k, fp = filt_k[rows], top_k[rows], filt_p[rows]  # [m]
        vals = x.topk(K, -1).values if K < V else x.sort(-1, descending=True).values  # [m, K]
        kth = vals.gather(1, (k.clamp(1, K) - 1)[:, None])[:, 0]  # the k-th likeliest
        kth = torch.where(fk, kth, float("-inf"))  # [m] lowest top-k keeps
        if any(host_k[m] for m in at[i]):  # the top-k distribution's normaliser
            x = x.masked_fill(x < kth[:, None], float("-inf"))
        lse = x.logsumexp(-1)  # [m]
        p = (vals.masked_fill(vals < kth[:, None], float("-inf")) - lse[:, None]).exp()
        before = p.cumsum(-1) - p  # [m, K] the mass before each of the likeliest
        rank = torch.arange(K, device=x.device)
        stop = fp[:, None] & (before >= top_p[rows][:, None].to(before.dtype)) & (rank > 0)
        cut = stop.any(1)  # the nucleus ends among these K (top_p 0: the first alone)
        last = vals.gather(1, (stop.float().argmax(1) - 1).clamp(min=0)[:, None])[:, 0]
        lowest[rows] = torch.maximum(kth, torch.where(cut, last, float("-inf")))
        if i + 1 < len(stages):  # a nucleus past K tokens: the next count looks again
            more = (fp & ~cut & ~fk).tolist()
            at[i + 1] += [m for m, again in zip(at[i], more) if again]
    return lowest


def _one_hot_argmax(logits: torch.Tensor) -> torch.Tensor:
    probs = torch.zeros_like(logits, dtype=torch.float32)
    return probs.scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)


def keyed_race(probs: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Gumbel-max sampling with noise keyed by (seed, position, token): at each position the
    token of largest log p(v) + G(v), G(v) = -log(-log u(v)). Exact: it follows probs.

    Raced with the same noise, two distributions at one position (a draft model's q, the
    target's p) pick the same token with probability at least (1 - TV) / (1 + TV), TV
    their total variation distance, without either seeing the other's (Daliri et al. 2024,
    arXiv 2408.07978: Gumbel sampling for drafter-invariant speculative decoding).

    probs: [B, T, V]; seeds: [B] int64; positions: [B, T] int64 -> tokens [B, T] int64
    """
    V = probs.shape[-1]
    key = _key(seeds, positions, RACE)[..., None]  # [B, T, 1]
    token = _mix32(torch.arange(V, device=probs.device) ^ 0x9E3779B9)  # [V]
    h = _mix32(_mix32(key ^ token) ^ (key >> 7))  # [B, T, V] 32 random bits per token
    u = (h.double() + 0.5) / float(2**32)  # (0, 1): no token gets infinite noise
    return (probs.double().log() - (-u.log()).log()).argmax(-1)


def sample(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: one token per distribution.

    probs: [..., V] (need not be normalised); uniforms: [...] in [0, 1) -> tokens [...] int64
    """
    cdf = probs.double().cumsum(-1)  # [..., V]
    u = (uniforms.to(cdf.device, cdf.dtype) * cdf[..., -1]).unsqueeze(-1)
    idx = torch.searchsorted(cdf, u, right=True).squeeze(-1)
    return idx.clamp_(max=probs.shape[-1] - 1)
