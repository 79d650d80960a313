"""The bench's outputs: a terminal table, a JSON file of every figure, a PNG plot."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from specq.bench.runner import ADAPTIVE, ASSISTED, FIXED, HF, NONE

log = logging.getLogger(__name__)

COLUMNS = [  # header, key, format
    ("draft", "draft", "{}"), ("method", "method", "{}"), ("B", "batch_size", "{}"),
    ("g", "g", "{}"), ("tok/s", "tokens_per_s", "{:.1f}"), ("xHF", "speedup_vs_hf", "{:.2f}"),
    ("xnone", "speedup_vs_none", "{:.2f}"), ("rounds", "speedup_vs_none_by_round", "{}"),
    ("xdec", "decode_speedup_vs_none", "{:.2f}"), ("acc", "acceptance_rate", "{:.2f}"),
    ("alpha", "alpha", "{:.2f}"), ("mal", "mean_acceptance_length", "{:.2f}"),
    ("E", "tokens_per_step", "{:.2f}"),
    ("ver/tok", "verified_per_token", "{:.2f}"), ("pad/tok", "padded_per_token", "{:.2f}"),
    ("c", "c", "{:.2f}"), ("thm3.8", "predicted_theorem", "{:.2f}"),
    ("pred", "predicted_measured", "{:.2f}"), ("eff", "efficiency", "{:.2f}"),
    ("greedy", "greedy", "{}"),
]


def _cell(row: dict, key: str, fmt: str) -> str:
    v = row.get(key)
    if key == "greedy":
        if not v:
            return "ref" if row.get("reference") else "-"
        flag = "" if not v["mismatches"] else " MISMATCH"
        tie = f"~{v['near_ties']}" if v["near_ties"] else ""
        return f"{v['equal']}/{v['equal'] + v['near_ties'] + v['mismatches']}{tie}{flag}"
    if key == "speedup_vs_none_by_round":  # the rounds' range: what the median is worth
        return "-" if not v or row.get("reference") else f"{min(v):.2f}-{max(v):.2f}"
    if key == "speedup_vs_best_fixed":  # the medians' ratio, the best g, the rounds' range
        rounds = row.get("speedup_vs_best_fixed_by_round")
        spread = f" ({min(rounds):.2f}-{max(rounds):.2f})" if rounds else ""
        return "-" if v is None else f"{v:.2f} g={row['best_fixed_g']}{spread}"
    if key == "g" and v is None and row["method"] == ADAPTIVE:
        return "auto"
    return "-" if v is None else fmt.format(v)


def table(rows: list[dict]) -> str:
    """Plain fixed-width text, one line per run."""
    return aligned([[h for h, _, _ in COLUMNS]] + [[_cell(r, k, f) for _, k, f in COLUMNS]
                                                  for r in rows])


def aligned(cells: list[list[str]]) -> str:
    """A header line, a rule and the rows, each column right-aligned to its widest cell."""
    widths = [max(len(c[i]) for c in cells) for i in range(len(cells[0]))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(line, widths)) for line in cells]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


LEGEND = (
    "xHF: speedup over HF plain generate at the same batch size (hf-assisted: over batch 1); "
    "xnone: over specq without speculation (the median runs'); rounds: with --repeat, "
    "the lowest and highest xnone of one round of runs; acc: accepted/proposed; alpha: "
    "per-token "
    "acceptance probability; xdec: xnone in decoding time, the prefill passes (the same "
    "work in both; a refill that joins a step's pass counts as decoding) left out; "
    "mal: mean acceptance length (bonus included); c: draft step / "
    "plain decode step; E: tokens a row gains per target pass; ver/tok: target tokens "
    "verified per token emitted (plain: 1), pad/tok: as a padded pass computes them; "
    "thm3.8: Leviathan Thm 3.8 "
    "from alpha, g, c; pred: E x plain step / this run's mean step (measured costs); "
    "eff: xdec / pred, the engine's own bookkeeping; greedy: prompts equal to the "
    "reference (~near-ties)."
)


PROFILE_KEYS = {"draft": "draft", "method": "method", "batch_size": "B", "g": "g"}


def profile_table(rows: list[dict], keys: dict[str, str] = PROFILE_KEYS) -> str:
    """One line per specq run: each phase's share of its wall time, in percent, and the
    phases' sum (worker/engine/profile.py). ``keys``: the row's keys that name the run, and
    each one's column head."""
    runs = [r for r in rows if r.get("profile_shares")]
    if not runs:
        return ""
    phases = list(runs[0]["profile_shares"])
    head = [*keys.values(), *phases, "sum"]
    cells = [head]
    for r in runs:
        shares = r["profile_shares"]
        cells.append([*(_cell(r, k, "{}") for k in keys),
                      *(f"{100 * shares[p]:.1f}" for p in phases),
                      f"{100 * r['profile_coverage']:.1f}"])
    return aligned(cells)


PROFILE_LEGEND = (
    "where each run's wall time went, % (worker/engine/profile.py): admit: refills "
    "(encode, prefill, first token; a refill that joins a step's pass is prefilled in "
    "verify); propose: drafting; verify: the target pass; mask: "
    "a grammar's work for shaped rows; accept: "
    "acceptance, cache keep and the step's sync; upkeep: drafter update, compaction, "
    "retiring rows; host: per-row parameters and handing tokens to rows; results: "
    "on_result callbacks; sum: the phases over the wall time."
)


WORKLOAD_COLUMNS = [  # header, key, format
    ("draft", "draft", "{}"), ("method", "method", "{}"), ("B", "batch_size", "{}"),
    ("g", "g", "{}"), ("tok/pass", "tokens_per_step", "{:.2f}"),
    ("xnone", "speedup_vs_none", "{:.2f}"), ("rounds", "speedup_vs_none_by_round", "{}"),
    ("xdec", "decode_speedup_vs_none", "{:.2f}"), ("x best g", "speedup_vs_best_fixed", "{}"),
    ("xHF", "speedup_vs_hf", "{:.2f}"), ("acc", "acceptance_rate", "{:.2f}"),
    ("ver/tok", "verified_per_token", "{:.2f}"), ("pad/tok", "padded_per_token", "{:.2f}"),
    ("propose", "propose_share", "{:.3f}"), ("greedy", "greedy", "{}"),
]
WORKLOAD_LEGEND = (
    "tok/pass: tokens a row gains per target pass while decoding; rounds: with --repeat, "
    "the lowest and highest xnone of one round (a run against the no-speculation run of "
    "its own round): the noise the median xnone carries; x best g: adaptive against the "
    "fixed g with the fastest median run (the same drafter and batch size), the medians' "
    "ratio, that g, and the range of each round's own ratio; ver/tok: target tokens verified "
    "per token emitted (the rows' own tokens: what a packed pass computes; plain: 1); "
    "pad/tok: the same as a padded pass computes it (every row as wide as the widest); "
    "propose: drafting time over target-pass time in the steps that drafted."
)


def workload_table(reports: dict[str, dict]) -> str:
    """One block of lines per workload: its specq runs, the figures that compare drafters."""
    cols = [("workload", None, "{}"), *WORKLOAD_COLUMNS]
    cells = [[h for h, _, _ in cols]]
    for name, report in reports.items():
        for r in report["runs"]:
            if r["method"] in (NONE, FIXED, ADAPTIVE):
                cells.append([name] + [_cell(r, k, f) for _, k, f in WORKLOAD_COLUMNS])
    return aligned(cells)


def write_json(path: Path, report: dict) -> None:
    path.write_text(json.dumps(report, indent=1, allow_nan=False))
    log.info("wrote %s", path)


def plot(path: Path, rows: list[dict]) -> None:
    """Speedup over HF plain vs batch size per method; acceptance by draft position."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax0, ax1, ax2) = plt.subplots(1, 3, figsize=(18, 5.5))
    for ax, key, title in [(ax0, "tokens_per_s", "New tokens per second"),
                           (ax1, "speedup_vs_hf", "Speedup over HF plain generate")]:
        series: dict[str, list[tuple[int, float]]] = {}
        for r in rows:
            if r.get(key) is not None:
                series.setdefault(_label(r), []).append((r["batch_size"], r[key]))
        for label, pts in series.items():
            xs, ys = zip(*sorted(pts))
            style = "o--" if label in (HF, NONE) else "s" if ASSISTED in label else "o-"
            ax.plot(xs, ys, style, label=label)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size")
        ax.set_title(title)
        if series:
            ax.legend(fontsize=7)
    ax0.set_yscale("log")
    ax1.axhline(1.0, color="grey", lw=0.8)

    smallest = min((r["batch_size"] for r in rows), default=1)
    for r in rows:
        acc = r.get("acceptance_by_position")
        if r["batch_size"] == smallest and acc and r["method"] in (FIXED, ADAPTIVE):
            ax2.plot(range(1, len(acc) + 1), acc, "o-", label=_label(r))
    ax2.set_xlabel("draft position i")
    ax2.set_ylabel("share of draft steps accepting >= i tokens")
    ax2.set_ylim(0, 1)
    ax2.set_title(f"Acceptance by draft position (batch {smallest})")
    if ax2.lines:
        ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    log.info("wrote %s", path)


def _label(r: dict) -> str:
    if r["method"] in (HF, NONE):
        return r["method"]
    g = "auto" if r["method"] == ADAPTIVE else r["g"]
    suffix = "" if r["method"] == ASSISTED else f" g={g}"
    return f"{r['method']} {r['draft']}{suffix}"
