"""A job's acceptance metrics for people: a terminal summary and a PNG report.

The report is meant to be shared as it is: its title names the job, the pair and how it
drafts, and its figures; its four panels are acceptance by draft position, steps by draft
length, draft length over time and throughput over time. Counts sit on integer axes (draft
positions, g, tenths of the job). A panel with nothing to show says why in words (a job that
never drafted, nothing generated yet) instead of drawing empty axes, and a series of a
single value is drawn as a bar with a note, not as a lonely dot.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from specq.api.client import JobMetrics
from specq.api.figures import drafted, drafting, item_counts, shown
from specq.api.outputs import OutputFile, descriptor, is_stream

if TYPE_CHECKING:  # matplotlib is imported where a report is drawn: `specq[report]`
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

NEVER_DRAFTED = "never drafted: no draft token was proposed, every step ran the target alone"
NEVER_RAN = "nothing generated: no step ran (no item was run)"


def _not_drafted(m: JobMetrics) -> str:
    """Why a job shows no drafting: it never drafted, or it never ran at all."""
    return NEVER_DRAFTED if m.target_passes else NEVER_RAN
LABEL = 24  # width of format_metrics' labels


def _drafts_per_step(m: JobMetrics) -> str:
    """Draft tokens per draft step, the companion of mean acceptance length (1 + accepted
    per draft step), split by kind: the drafter's and those a grammar forced (proposed at
    any g, g = 0 included, so the g above does not show them)."""
    if not m.draft_steps:
        return "-"
    own = m.proposed - m.forced_proposed
    return (f"{m.proposed / m.draft_steps:.2f}  ({own} from the drafter, {m.forced_proposed} "
            f"forced by a grammar, over {m.draft_steps} steps with drafts)")


def _drafts_verified(m: JobMetrics) -> str:
    """Draft tokens a row verified per step, every kind and every step counted (a step's
    rows carry their own number: the budget cuts each; a grammar forces tokens at any g),
    and the share of row-steps at each number."""
    hist = m.steps_by_drafts_verified
    if not sum(hist):
        return "-"
    total = sum(hist)
    shares = "  ".join(f"{n}:{k / total:.0%}" for n, k in enumerate(hist) if k)
    return f"{shown('mean_drafts_verified', m.mean_drafts_verified)}  ({shares})"


def format_metrics(m: JobMetrics) -> str:
    """The figures a user asks of a finished or running job, one per line (each written by
    api/figures.py, as every other command writes it)."""
    per_pass = m.tokens_per_pass
    rows = [
        ("tokens generated", f"{m.new_tokens}"),
        ("tokens/s (wall)", shown("tokens_per_second", m.tokens_per_second)),
        ("tokens/s (engine busy)", shown("engine_tokens_per_second", m.engine_tokens_per_second)),
        ("acceptance rate", f"{shown('acceptance_rate', m.acceptance_rate)}  ({m.accepted} of "
                            f"{m.proposed} draft tokens)"),
        ("mean acceptance length", f"{shown('mean_acceptance_length', m.mean_acceptance_length)}"
                                   f"  (tokens per draft step, bonus included)"),
        ("target passes", f"{m.target_passes}  ({shown('tokens_per_pass', per_pass)} tokens "
                          f"each)"),
        ("estimated speedup", f"{shown('estimated_speedup', m.estimated_speedup, drafted=drafted(m))}"  # noqa: E501
                              f"  (tokens per pass x verify share; flat verify cost)"),
        ("mean draft length g", f"{shown('mean_draft_length', m.mean_draft_length)}"
                                f"  (the drafter's, chosen per step)"),
        ("draft tokens per step", _drafts_per_step(m)),
        ("drafts verified per row", _drafts_verified(m)),
        ("verified per token", f"{shown('verified_per_token', m.verified_per_token)}"
                               f"  (target tokens verified per token emitted; plain: 1)"),
    ]
    if not drafted(m):
        rows.append(("drafting", _not_drafted(m)))
    if m.forced_proposed:  # shaped rows: the grammar's drafts and the drafter's apart
        own, own_accepted = m.proposed - m.forced_proposed, m.accepted - m.forced_accepted
        rows.append(("grammar drafts", f"{m.forced_accepted / m.forced_proposed:.2f}  "
                                       f"({m.forced_accepted} of {m.forced_proposed} forced "
                                       f"tokens; the drafter's: {own_accepted} of {own})"))
    if m.mask_time:
        rows.append(("grammar masks", f"{m.mask_time:.2f} s  (summed over items)"))
    if m.acceptance_by_position:
        rows.append(("accepted by position", "  ".join(
            f"{i + 1}:{a:.2f}" for i, a in enumerate(m.acceptance_by_position))))
    if m.steps_by_draft_length:
        total = sum(m.steps_by_draft_length)
        rows.append(("steps by draft length", "  ".join(
            f"g={g}:{n / total:.0%}" for g, n in enumerate(m.steps_by_draft_length) if n)))
    if m.draft_length_over_time:
        rows.append(("g over time (10ths)", " ".join(f"{g:.1f}" for g in
                                                     m.draft_length_over_time)))
    rows += cost_rows(m)
    if m.engine_faults:  # a fault is never a silent slow path
        rows.append(("engine faults", f"{m.engine_faults}  (first: {m.first_fault})"))
        if m.items_isolated:
            rows.append(("items run alone", f"{m.items_isolated}  (after a fault struck them: "
                                            f"batch size 1)"))
    head = f"job {m.job_id}  {m.status}  {item_counts(m)}"
    return "\n".join([head] + [f"{label:<{LABEL}}{value}" for label, value in rows])


def cost_rows(m: JobMetrics) -> list[tuple[str, str]]:
    """What the job cost (docs/metrics.md): tokens in and out, device time, what speculation
    saved, and the price of that time where its workers had one."""
    return [
        ("tokens in / out", f"{m.prompt_tokens} / {m.new_tokens}"),
        ("worker-seconds", f"{shown('worker_seconds', m.worker_seconds)}  (device time its "
                           f"chunks held, summed over workers)"),
        ("target passes saved", f"{m.passes_saved}  (tokens - target passes)"),
        ("device time saved", f"{shown('device_seconds_saved', m.device_seconds_saved)}  "
                              f"(passes saved x verify time per pass - drafting time)"),
        ("estimated cost", f"{shown('estimated_cost', m.estimated_cost)}"
                           + ("" if m.estimated_cost is not None else
                              "  (no worker had a price: SPECQ_DEVICE_HOUR_PRICE)")),
    ]


def title(m: JobMetrics) -> str:
    """Three lines: the job, its pair and drafting; its headline figures; what it cost."""
    model = f" ({m.draft_model})" if m.draft_model else ""
    return (f"job {m.job_id}: pair {m.pair or '-'}, drafter {drafting(m)}{model}, {m.status}\n"
            f"acceptance {shown('acceptance_rate', m.acceptance_rate)}, mean acceptance length "
            f"{shown('mean_acceptance_length', m.mean_acceptance_length)}, "
            f"{shown('tokens_per_second', m.tokens_per_second)} tokens/s, estimated speedup "
            f"{shown('estimated_speedup', m.estimated_speedup, drafted=drafted(m))}; "
            f"{item_counts(m)}\n"
            f"cost: {m.prompt_tokens} tokens in, {m.new_tokens} out, "
            f"{shown('worker_seconds', m.worker_seconds)} worker time, {m.passes_saved} target "
            f"passes saved ({shown('device_seconds_saved', m.device_seconds_saved)} device "
            f"time), estimated cost {shown('estimated_cost', m.estimated_cost)}")


def report_figure(m: JobMetrics) -> Figure:
    """The report as a matplotlib Figure (no pyplot state): draw_report saves it."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise RuntimeError("specq report draws with matplotlib: pip install 'specq[report]'") \
            from None

    fig = Figure(figsize=(13, 8.5))
    (pos, steps), (g_time, tps_time) = fig.subplots(2, 2)
    _by_position(pos, m)
    _steps_by_g(steps, m)
    _g_over_time(g_time, m)
    _throughput(tps_time, m)
    fig.suptitle(title(m), fontsize=11)
    fig.tight_layout()
    return fig


def draw_report(m: JobMetrics, path: str | Path) -> Path:
    """Write the report (report_figure) to ``path``, as outputs.OutputFile writes, its
    folder made if need be. Returns the path written: image_path(path)."""
    path = image_path(path)
    figure = report_figure(m)  # before the file: a missing matplotlib leaves none
    with OutputFile(path, binary=True) as out:
        figure.savefig(out.stream, format=path.suffix[1:].lower() or "png", dpi=100)
    return path


def image_path(path: str | Path) -> Path:
    """Where the report of ``path`` goes: ``path``, with .png added to a file name without
    a suffix (a PNG is drawn, as savefig names it). A FIFO, a device or a descriptor
    (/dev/fd/N) keeps its name."""
    path = Path(path)
    if path.suffix or is_stream(path) or descriptor(path) is not None:
        return path
    return path.with_name(path.name + ".png")


def _integer_axis(axis) -> None:
    from matplotlib.ticker import MaxNLocator

    axis.set_major_locator(MaxNLocator(integer=True))


def _note(ax: Axes, text: str) -> None:
    """A line over a panel's drawing (its y axis leaves room for it)."""
    ax.text(0.5, 0.94, text, ha="center", va="top", transform=ax.transAxes, fontsize=9,
            color="dimgray", bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.8})


def _say(ax: Axes, text: str) -> None:
    """A panel with nothing to draw: ``text`` in its middle, no ticks."""
    ax.text(0.5, 0.5, text, ha="center", va="center", wrap=True, transform=ax.transAxes,
            fontsize=10, color="dimgray")
    ax.set_xticks([])
    ax.set_yticks([])


def _by_position(ax: Axes, m: JobMetrics) -> None:
    ax.set_title("acceptance by draft position")
    if not m.acceptance_by_position:
        _say(ax, _not_drafted(m) if not drafted(m) else "no draft token accepted yet")
        return
    positions = list(range(1, len(m.acceptance_by_position) + 1))
    bars = ax.bar(positions, m.acceptance_by_position, color="tab:blue")
    ax.bar_label(bars, fmt="%.2f", fontsize=8)
    ax.set_xticks(positions)
    ax.set(xlabel="draft position", ylabel="share of draft steps accepted", ylim=(0, 1.05))


def _steps_by_g(ax: Axes, m: JobMetrics) -> None:
    ax.set_title("steps by draft length g")
    if not sum(m.steps_by_draft_length):
        _say(ax, "no decoding step recorded")
        return
    lengths = list(range(len(m.steps_by_draft_length)))
    ax.bar(lengths, m.steps_by_draft_length, width=0.6, color="tab:green")
    ax.set_xticks(lengths)
    ax.set_xlim(-0.75, max(len(lengths) - 1, 1) + 0.75)
    _integer_axis(ax.yaxis)
    ax.set(xlabel="draft length g (0: no drafting)", ylabel="steps",
           ylim=(0, max(m.steps_by_draft_length) * 1.25))
    if not drafted(m):
        _note(ax, "never drafted: every step at g = 0")


def _g_over_time(ax: Axes, m: JobMetrics) -> None:
    ax.set_title("draft length over time")
    values = m.draft_length_over_time
    if not drafted(m) or not values:
        _say(ax, _not_drafted(m) if not drafted(m) else "no chunk finished yet")
        return
    tenths = list(range(1, len(values) + 1))
    ax.set(xlabel="tenth of the job in finishing order (of its chunks; of its items under "
                  "10 chunks)",
           ylabel="mean g per step",
           ylim=(0, max(values) * 1.2 + 0.5))
    ax.set_xticks(tenths)
    if len(values) == 1:
        ax.bar(tenths, values, width=0.5, color="tab:orange")
        ax.set_xticks(tenths, ["whole job"])
        ax.set_xlim(0, 2)
        _note(ax, f"one chunk: mean g {values[0]:.2f} over the whole job")
        return
    ax.plot(tenths, values, marker="o", color="tab:orange")


def _throughput(ax: Axes, m: JobMetrics) -> None:
    ax.set_title("throughput over time")
    points = m.throughput_over_time
    if not points:
        _say(ax, "no tokens generated yet")
        return
    ax.set(xlabel="seconds since the first chunk started", ylabel="new tokens/s")
    if len(points) == 1:
        (t, rate), = points
        ax.bar([t], [rate], width=2 * t, color="tab:purple")  # the whole span: [0, 2t]
        ax.set(xlim=(0, 2.2 * t), ylim=(0, rate * 1.3))
        _note(ax, f"one chunk: {rate:.1f} tokens/s on average over {2 * t:.1f} s")
        return
    ax.plot([t for t, _ in points], [r for _, r in points], marker=".", color="tab:purple")
    ax.set_ylim(0, max(r for _, r in points) * 1.15)
