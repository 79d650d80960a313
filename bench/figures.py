"""The figures of one run: throughput, acceptance, costs, predicted speedups, efficiency.

Acceptance has two figures, and they differ:
- acceptance rate = accepted / proposed (the counters' rate, vLLM's "draft acceptance
  rate"); with g drafts per step it falls as g grows even when each token is as likely;
- alpha = the per-token acceptance probability of Leviathan et al. (arXiv 2211.17192),
  estimated as accepted / (accepted + rejections), a rejection being a row-step that did
  not accept all it proposed. Thm 3.8 and E(g) take this alpha.

Predicted speedups over specq without speculation at the same batch size (t_step: its
mean plain decode step), for a run whose steps used draft lengths g_s:
- theorem: sum_s E(alpha, g_s) / sum_s (g_s c + 1), Thm 3.8, c = t_draft / t_step;
- measured cost: E[tokens per step] t_step / (mean seconds of this run's steps, drafting
  and target pass), E[tokens per step] being what a row gained per target pass while
  decoding. Both factors are measured, so the prediction holds exactly what the model
  passes cost; efficiency = measured speedup / this is what the engine's own bookkeeping
  (acceptance, cache fix-ups, refills, a batch thinning at its end) costs on top.
- alpha and cost (JSON only, the adaptive policy's own model): sum_s E(alpha, g_s, f)
  t_step / sum_s (g_s t_draft + t_verify(g_s + 1)), f the share of rows that proposed. It
  takes every proposal as g long; prompt lookup often finds fewer, so it errs both ways.
For one g the first and last reduce to worker.engine.policy's theorem_speedup and
measured_speedup.

They predict the decoding steps. Prefilling the prompts is the same work with and
without speculation and no drafter shortens it, so the measured speedup they are set
against is the decoding one (xdec): (seconds - prefill seconds) of specq without
speculation over the same of this run (the prefill passes: a refill that joins a step's
pass, speculative.py: _join, counts as decoding in both). The whole-run speedup (xnone) is
reported beside.
"""

from __future__ import annotations

import math
from collections import Counter
from statistics import fmean

from specq.bench.runner import Run, Step
from specq.schema.counters import verified_per_token
from specq.worker.engine.policy import expected_tokens, measured_speedup, theorem_speedup


def alpha_mle(steps: list[Step]) -> tuple[float | None, float | None]:
    """(alpha, f): per-token acceptance probability and share of row-steps proposing."""
    accepted = rejections = proposing = rows = 0
    for s in steps:
        if s.g == 0:
            continue
        for n, k in zip(s.num_draft, s.accepted):
            rows += 1
            if n > 0:
                proposing += 1
                accepted += k
                rejections += k < n
    if not proposing:
        return None, None
    alpha = accepted / (accepted + rejections) if accepted + rejections else None
    return (None if alpha is None else min(alpha, 0.999)), proposing / rows


def verify_times(steps: list[Step]) -> dict[int, float]:
    """Mean seconds of a target pass over n tokens per row, for each n seen."""
    by_n: dict[int, list[float]] = {}
    for s in steps:
        by_n.setdefault(s.verify_tokens, []).append(s.t_verify)
    return {n: fmean(v) for n, v in sorted(by_n.items())}


def t_verify_at(n: int, table: dict[int, float]) -> float:
    """t_verify(n): measured, else the line through the smallest and largest n seen."""
    if n in table:
        return table[n]
    if not table:
        raise ValueError("t_verify: no target pass measured")
    pts = sorted(table.items())
    if len(pts) == 1:
        return pts[0][1]
    (n0, t0), (n1, t1) = pts[0], pts[-1]
    return t0 + max(0.0, (t1 - t0) / (n1 - n0)) * (n - n0)


def draft_time(steps: list[Step]) -> float | None:
    """Mean seconds per draft token step, over the steps that drafted."""
    per_token = [s.t_draft / s.g for s in steps if s.g > 0]
    return fmean(per_token) if per_token else None


def predicted(alpha: float, f: float, g_counts: dict[int, int], t_draft: float,
              t_step: float, t_verify: dict[int, float]) -> tuple[float, float]:
    """(Thm 3.8, measured-cost prediction) for steps with these draft lengths."""
    c = t_draft / t_step
    if len(g_counts) == 1:
        (g,) = g_counts
        tg = t_verify_at(g + 1, t_verify)
        return theorem_speedup(alpha, g, c), measured_speedup(alpha, g, t_draft, t_step, tg, f)
    tokens = sum(k * expected_tokens(alpha, g) for g, k in g_counts.items())
    tokens_f = sum(k * expected_tokens(alpha, g, f) for g, k in g_counts.items())
    theorem = tokens / sum(k * (g * c + 1) for g, k in g_counts.items())
    cost = sum(k * (g * t_draft + t_verify_at(g + 1, t_verify))
               for g, k in g_counts.items())
    return theorem, tokens_f * t_step / cost


def figures(run: Run, hf: Run | None, none: Run | None) -> dict:
    """Every figure of one run; None where it does not apply (JSON null, never NaN)."""
    out: dict = {
        "method": run.method, "draft": run.draft, "batch_size": run.batch_size, "g": run.g,
        "seconds": run.seconds, "new_tokens": run.new_tokens,
        "tokens_per_s": run.new_tokens / run.seconds if run.seconds > 0 else None,
    }
    out["speedup_vs_hf"] = _ratio(out["tokens_per_s"], hf)
    out["speedup_vs_none"] = _ratio(out["tokens_per_s"], none)
    out["prefill_seconds"] = run.prefill_seconds
    out["decode_speedup_vs_none"] = decode_speedup(run, none)
    out.update(profile_figures(run.profile, run.seconds))
    if run.results is None:
        return out
    counters = [r.counters for r in run.results]
    proposed = sum(c.proposed for c in counters)
    accepted = sum(c.accepted for c in counters)
    draft_steps = sum(c.draft_steps for c in counters)
    by_pos = _sum_lists([c.accepted_by_position for c in counters])
    alpha, f = alpha_mle(run.steps)
    g_counts = dict(sorted(Counter(s.g for s in run.steps).items()))
    t_verify = verify_times(run.steps)
    t_draft = draft_time(run.steps)
    t_step = step_time(none) if none is not None else None
    out.update({
        "acceptance_rate": accepted / proposed if proposed else None,
        "alpha": alpha,
        "propose_rate": f,
        "mean_acceptance_length": 1 + accepted / draft_steps if draft_steps else None,
        "proposed": proposed, "accepted": accepted, "draft_steps": draft_steps,
        "accepted_by_position": by_pos,
        # share of draft steps that accepted at least i + 1 tokens
        "acceptance_by_position": [a / draft_steps for a in by_pos] if draft_steps else [],
        "steps": len(run.steps), "g_counts": {str(g): k for g, k in g_counts.items()},
        "t_draft": t_draft, "t_step": t_step,
        "t_verify": {str(n): t for n, t in t_verify.items()},
        "c": t_draft / t_step if t_draft is not None and t_step else None,
        "propose_share": propose_share(run.steps),
        # draft tokens per row per step, every kind: [n] row-steps that verified n
        "steps_by_drafts_verified": _sum_lists([c.steps_by_drafts_verified for c in counters]),
        "verified_per_token": verified_per_token(
            sum(c.target_passes for c in counters), proposed, run.new_tokens),
        "padded_per_token": padded_per_token(run.steps, counters, run.new_tokens),
        "tokens_per_step": tokens_per_step(run.results), "step_seconds": step_seconds(run.steps),
        # rows per step while decoding: a job's last rows finishing at different times
        # thin the batch, a loss that is neither the model passes' nor the bookkeeping's
        "rows_per_step": (sum(c.target_passes - 1 for c in counters) / len(run.steps)
                          if run.steps else None),
        "predicted_theorem": None, "predicted_measured": None, "predicted_alpha_cost": None,
        "efficiency": None,
        "policy_snapshot": _jsonable(run.snapshot),
    })
    if (alpha is not None and f is not None and t_draft is not None and t_step is not None
            and any(g for g in g_counts)):
        thm, by_alpha = predicted(alpha, f, g_counts, t_draft, t_step, t_verify)
        out["predicted_theorem"], out["predicted_alpha_cost"] = thm, by_alpha
    if None not in (out["tokens_per_step"], out["step_seconds"], t_step):
        out["predicted_measured"] = out["tokens_per_step"] * t_step / out["step_seconds"]
        if out["decode_speedup_vs_none"] is not None:
            out["efficiency"] = out["decode_speedup_vs_none"] / out["predicted_measured"]
    return out


def tokens_per_step(results: list) -> float | None:
    """E[tokens per step] as measured: tokens a row gained per target pass while decoding
    (the prefill pass and the first token it yields left out)."""
    decoding = [r.counters for r in results if r.counters.target_passes > 1]
    passes = sum(c.target_passes - 1 for c in decoding)
    return sum(c.new_tokens - 1 for c in decoding) / passes if passes else None


def padded_per_token(steps: list[Step], counters: list, new_tokens: int) -> float | None:
    """Tokens a padded verify pass computes per token emitted: every row pays the step's
    widest row (Step.verify_tokens), a prefill one (its last position) per row. Against
    verified_per_token, what padding costs beyond the tokens the rows carried."""
    if not new_tokens:
        return None
    prefills = sum(c.target_passes for c in counters) - sum(len(s.num_draft) for s in steps)
    return (sum(len(s.num_draft) * s.verify_tokens for s in steps) + prefills) / new_tokens


def propose_share(steps: list[Step]) -> float | None:
    """Drafting time over target-pass time, in the steps that drafted: what proposing
    costs next to the pass that verifies it (a model-less drafter should be near 0)."""
    drafted = [s for s in steps if s.g > 0]
    verify = sum(s.t_verify for s in drafted)
    return sum(s.t_draft for s in drafted) / verify if verify > 0 else None


def step_seconds(steps: list[Step]) -> float | None:
    """Mean seconds of a decoding step: its drafting and its target pass."""
    return fmean(s.t_draft + s.t_verify for s in steps) if steps else None


def decode_speedup(run: Run, none: Run | None) -> float | None:
    """Decoding tokens per second over those of specq without speculation, prefill left
    out of both (the same prompts and outputs, so the same prefill work)."""
    if none is None or run.prefill_seconds is None or none.prefill_seconds is None:
        return None
    mine, base = run.seconds - run.prefill_seconds, none.seconds - none.prefill_seconds
    if mine <= 0 or base <= 0 or not none.new_tokens:
        return None
    return (run.new_tokens / mine) / (none.new_tokens / base)


def profile_figures(profile: dict[str, float] | None, seconds: float) -> dict:
    """Where a run's time went (worker/engine/profile.py): seconds per phase, each phase's
    share of the run's wall time (``seconds``), and the phases' sum over the wall time (the
    run's time the profile saw; the rest is the bench's own sync around generate)."""
    if profile is None or seconds <= 0:
        return {"profile": None, "profile_shares": None, "profile_coverage": None}
    return {"profile": dict(profile),
            "profile_shares": {p: s / seconds for p, s in profile.items()},
            "profile_coverage": sum(profile.values()) / seconds}


def step_time(run: Run) -> float | None:
    """t_step: the mean plain decode step (a target pass over 1 token per row)."""
    return verify_times(run.steps).get(1)


def _ratio(tokens_per_s: float | None, base: Run | None) -> float | None:
    if tokens_per_s is None or base is None or base.seconds <= 0 or not base.new_tokens:
        return None
    return tokens_per_s / (base.new_tokens / base.seconds)


def _sum_lists(lists: list[list[int]]) -> list[int]:
    out = [0] * max((len(x) for x in lists), default=0)
    for x in lists:
        for i, v in enumerate(x):
            out[i] += v
    return out


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_jsonable(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x
