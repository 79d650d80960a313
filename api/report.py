"""A job's acceptance metrics for people: a terminal summary and a PNG report."""

from __future__ import annotations

from pathlib import Path

from specq.api.client import JobMetrics


def _f(v: float | None, spec: str = ".3f") -> str:
    return "-" if v is None else format(v, spec)


def format_metrics(m: JobMetrics) -> str:
    """The figures a user asks of a finished or running job, one per line."""
    lines = [
        f"job {m.job_id}  {m.status}  {m.completed} completed, {m.failed} failed, "
        f"{m.cancelled} cancelled, {m.pending} pending of {m.total}",
        f"tokens generated        {m.new_tokens}",
        f"tokens/s (wall)         {_f(m.tokens_per_second, '.1f')}",
        f"tokens/s (engine busy)  {_f(m.engine_tokens_per_second, '.1f')}",
        f"acceptance rate         {_f(m.acceptance_rate)}  ({m.accepted} of {m.proposed} drafts)",
        f"mean acceptance length  {_f(m.mean_acceptance_length)}  (tokens per draft step, bonus "
        f"included)",
        f"target passes           {m.target_passes}  ({_f(m.new_tokens / m.target_passes if m.target_passes else None, '.2f')} tokens each)",  # noqa: E501
        f"estimated speedup       {_f(m.estimated_speedup, '.2f')}x  (tokens per pass x verify "
        f"share; flat verify cost)",
        f"mean draft length g     {_f(m.mean_draft_length, '.2f')}",
    ]
    if m.acceptance_by_position:
        by_pos = "  ".join(f"{i + 1}:{a:.2f}" for i, a in enumerate(m.acceptance_by_position))
        lines.append(f"accepted by position    {by_pos}")
    if m.steps_by_draft_length:
        total = sum(m.steps_by_draft_length)
        share = "  ".join(f"g={g}:{n / total:.0%}" for g, n in enumerate(m.steps_by_draft_length)
                          if n)
        lines.append(f"steps by draft length   {share}")
    if m.draft_length_over_time:
        lines.append("g over time (10ths)     "
                     + " ".join(f"{g:.1f}" for g in m.draft_length_over_time))
    lines += fault_lines(m)
    return "\n".join(lines)


def fault_lines(m: JobMetrics) -> list[str]:
    """The job's faults, if it met any: how many, the first error, and the items that fell
    back to running alone (the slow path)."""
    if not m.engine_faults:
        return []
    lines = [f"engine faults           {m.engine_faults}  (first: {m.first_fault})"]
    if m.items_isolated:
        lines.append(f"items run alone         {m.items_isolated}  (after a fault struck them: "
                     f"batch size 1)")
    return lines


def draw_report(m: JobMetrics, path: str | Path) -> Path:
    """Acceptance by draft position, draft length over time, steps per draft length."""
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError("specq report draws with matplotlib: pip install 'specq[report]'") \
            from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    ax = axes[0]
    pos = list(range(1, len(m.acceptance_by_position) + 1))
    ax.bar(pos, m.acceptance_by_position, color="tab:blue")
    ax.set(title="acceptance by draft position", xlabel="draft position",
           ylabel="share of draft steps accepted", ylim=(0, 1))
    ax = axes[1]
    ax.plot(range(1, len(m.draft_length_over_time) + 1), m.draft_length_over_time, marker="o")
    ax.set(title="draft length chosen over time", xlabel="tenth of the job's items",
           ylabel="mean g per step", ylim=(0, None))
    ax = axes[2]
    ax.bar(range(len(m.steps_by_draft_length)), m.steps_by_draft_length, color="tab:green")
    ax.set(title="steps by draft length", xlabel="g", ylabel="steps")
    fig.suptitle(
        f"job {m.job_id}: acceptance {_f(m.acceptance_rate, '.2f')}, mean acceptance length "
        f"{_f(m.mean_acceptance_length, '.2f')}, {_f(m.tokens_per_second, '.1f')} tokens/s, "
        f"estimated speedup {_f(m.estimated_speedup, '.2f')}x"
    )
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
