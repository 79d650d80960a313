"""How each figure of a job is written for people: one format per figure, `-` where undefined.

Every place that shows a job's figures (`specq status --watch`, `specq metrics`, `specq
jobs`, the report's title) writes them with `shown`, so a figure reads the same wherever it
is seen. A figure is undefined where the job gives it no meaning yet: no acceptance without
a draft proposed, no estimated speedup for a job that never drafted (its tokens per pass
count the prefill pass and are no speedup; the JSON and SQL keep the raw value), no
tokens/s before a token was timed.
"""

from __future__ import annotations

from typing import Any

# figure name -> format spec and unit (written after the number)
FORMATS: dict[str, tuple[str, str]] = {
    "acceptance_rate": (".3f", ""),
    "mean_acceptance_length": (".2f", ""),
    "mean_draft_length": (".2f", ""),
    "mean_drafts_verified": (".2f", ""),
    "verified_per_token": (".2f", ""),
    "tokens_per_pass": (".2f", ""),
    "tokens_per_second": (".1f", ""),
    "engine_tokens_per_second": (".1f", ""),
    "estimated_speedup": (".2f", "x"),
    "wall_time": (".1f", " s"),
    "worker_seconds": (".1f", " s"),
    "device_seconds_saved": (".1f", " s"),
    "estimated_cost": (".4f", ""),
}
UNDEFINED = "-"


def shown(name: str, value: float | None, *, drafted: bool = True) -> str:
    """``value`` of figure ``name`` in its one format, or `-` where it is undefined: None,
    a speedup of a job that never drafted (``drafted`` False), tokens/s of nothing timed."""
    if value is None or (name == "estimated_speedup" and not drafted):
        return UNDEFINED
    if name in ("tokens_per_second", "engine_tokens_per_second") and value <= 0:
        return UNDEFINED
    spec, unit = FORMATS[name]
    text = format(value, spec)
    if text.startswith("-") and float(text) == 0:  # a small negative rounded: 0.0, not -0.0
        text = text[1:]
    return f"{text}{unit}"


def counted(n: int, noun: str) -> str:
    """'1 item', '3 items': a count and its noun, plural but for one."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def drafted(figures: Any) -> bool:
    """Whether a job (JobMetrics or JobSummary) ever proposed a draft token: its acceptance
    rate is defined."""
    return figures.acceptance_rate is not None


def item_counts(state: Any) -> str:
    """'1200 completed, 3 failed, 1797 cancelled, 0 pending of 3000': every item counted in
    one status, cancelled never folded into 'done'."""
    return (f"{state.completed} completed, {state.failed} failed, {state.cancelled} cancelled, "
            f"{state.pending} pending of {state.total}")


def drafting(job: Any) -> str:
    """How a job's pair drafts, from its job_metrics columns: 'prompt_lookup/adaptive:4',
    'model/fixed:4', 'none', or '-' where not recorded."""
    if job.drafter is None:
        return UNDEFINED
    if job.draft_mode is None:
        return job.drafter
    return f"{job.drafter}/{job.draft_mode}:{job.draft_length}"
