"""`specq bench`: when does speculation pay? Side by side, in one process, on the same
prompts and pair:

(a) hf             HF plain `generate`, target alone, batched, left padded, greedy;
(b) hf-assisted    HF assisted generation one prompt at a time (assistant_model= or
                   prompt_lookup_num_tokens=), as a user runs it;
(c) specq-none     the specq engine without speculation (the NoDraft drafter);
(d) specq-fixed    the engine with a fixed draft length g, for each g asked;
(e) specq-adaptive the engine choosing g (0 included) each step.

`--workload NAME` (or `all`) runs all of it on a built-in prompt set (workloads.py) and
ends with one table of tokens per target pass and speedups, per workload and drafter.

Run with `specq bench --help` (or `python -m specq.bench`). The CLI wires it as
`add_arguments(subparser)` and `run(args)`.
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
import transformers

from specq.api.argtypes import COUNT_MAX, positive_int
from specq.bench import grammar_bench
from specq.bench.drafts import shallow_draft, skip_draft
from specq.bench.figures import figures
from specq.bench.greedy import NearTieCheck, compare
from specq.bench.prompts import load_prompts
from specq.bench.report import (
    LEGEND,
    PROFILE_LEGEND,
    WORKLOAD_LEGEND,
    plot,
    profile_table,
    table,
    workload_table,
    write_json,
)
from specq.bench.runner import (
    ADAPTIVE,
    ASSISTED,
    FIXED,
    HF,
    METHODS,
    NONE,
    Run,
    Target,
    load_bench_pair,
    run_assisted,
    run_hf,
    run_specq,
)
from specq.bench.workloads import WORKLOADS, workload_names
from specq.schema.generation import Request
from specq.worker.engine.drafters import Drafter, DraftModel, PromptLookup
from specq.worker.engine.speculative import encode_prompt
from specq.worker.engine.suffix import SuffixDrafter
from specq.worker.pairs import Pair

log = logging.getLogger(__name__)


DEFAULT_PROMPTS = 16  # of the built-in input-grounded prompts (prompts.py)


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """--pair, --device, --dtype, --threads: what the one-model benches (cache_bench,
    prefill_bench) load and run on."""
    p.add_argument("--pair", default="smollm2-135m", help="model-pair preset (its target)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=positive_int, default=None)


def load_model(args: argparse.Namespace) -> Pair:
    """torch's threads set and the pair loaded, as add_model_arguments' flags say."""
    logging.basicConfig(level=logging.WARNING)
    return load_bench_pair(args)


def _ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not a comma-separated list of integers: {text[:40]!r}") from None
    if not values or min(values) < 1 or max(values) > COUNT_MAX:
        raise argparse.ArgumentTypeError(f"need integers from 1 to {COUNT_MAX}: {text[:40]!r}")
    return values


def _methods(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    unknown = [n for n in names if n not in METHODS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown method(s) {unknown}; known: {list(METHODS)}")
    return names


def _workloads(text: str) -> list[str]:
    """Workload names; json-schema (grammar_bench.py) besides those of workloads.py."""
    names = [x.strip() for x in text.split(",") if x.strip()]
    shaped = [grammar_bench.NAME] if grammar_bench.NAME in names else []
    rest = ",".join(n for n in names if n != grammar_bench.NAME)
    try:
        return (workload_names(rest) if rest else []) + shaped
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{exc}, {grammar_bench.NAME}") from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The bench's options, on a parser of its own or a `specq bench` subparser."""
    p.add_argument("--pair", default="smollm2-135m", help="model-pair preset")
    p.add_argument("--draft", default="preset",
                   help="comma-separated drafters to compare: preset (the preset's own), "
                   "lookup (prompt lookup), suffix (the job-level suffix index and prompt "
                   "lookup), shallow:K (the target's first K layers), skip:A+B (its first A "
                   "and last B layers); see bench/drafts.py")
    p.add_argument("--prompts", type=positive_int, default=None,
                   help=f"number of prompts (cycled; default {DEFAULT_PROMPTS}, or all of "
                   "a workload; a repeat's output is one the job already wrote, which a "
                   "drafter reading the job's outputs copies)")
    p.add_argument("--prompts-file", type=Path, default=None,
                   help="JSONL prompts (string, {prompt} or {messages}) instead of the built-in")
    p.add_argument("--workload", type=_workloads, default=None,
                   help=f"comma-separated built-in prompt sets ({', '.join(WORKLOADS)}) or "
                   "all: the bench runs on each and ends with a table per workload and drafter;"
                   f" {grammar_bench.NAME}: structured outputs and grammar drafts "
                   "(bench/grammar_bench.py)")
    p.add_argument("--grammar-drafters", default="lookup",
                   help=f"{grammar_bench.NAME}: drafters run with and without grammar drafts "
                   "(comma-separated: lookup, suffix; empty: none)")
    p.add_argument("--grammar-configs", default="",
                   help=f"{grammar_bench.NAME}: only these configurations (comma-separated "
                   "labels as the table prints them: free, shaped, +grammar, lookup, "
                   "lookup+grammar, ...; shaped always); default all")
    p.add_argument("--max-new-tokens", type=positive_int, default=64)
    p.add_argument("--batch-sizes", type=_ints, default=[1, 4, 16, 64])
    p.add_argument("--draft-lengths", type=_ints, default=list(range(1, 9)))
    p.add_argument("--methods", type=_methods, default=list(METHODS),
                   help=f"comma-separated subset of {','.join(METHODS)}")
    p.add_argument("--hf-lookup-tokens", type=positive_int, default=10,
                   help="prompt_lookup_num_tokens for HF assisted prompt lookup")
    p.add_argument("--repeat", type=positive_int, default=1,
                   help="run every configuration this many times, in turn, and report the "
                   "run of median time (a busy machine's noise)")
    p.add_argument("--output-dir", type=Path, default=Path("bench-out"),
                   help="where bench.json and bench.png go")
    p.add_argument("--device", default=None, help="overrides SPECQ_DEVICE")
    p.add_argument("--dtype", default=None, help="overrides SPECQ_DTYPE")
    p.add_argument("--data-dir", type=Path, default=None, help="overrides SPECQ_DATA_DIR")
    p.add_argument("--threads", type=positive_int, default=None,
                   help="torch CPU threads (1 is steadier on a shared, busy machine)")


def _drafters(spec: str, pair: Pair, lookup_tokens: int
              ) -> list[tuple[str, Callable[[], Drafter], dict | None]]:
    """(name, drafter factory, HF assisted kwargs or None) for each drafter named in
    ``spec``."""
    pad = pair.tokenizer.pad_token_id if pair.tokenizer.pad_token_id is not None else 0
    vocab = pair.target.get_output_embeddings().weight.shape[0]
    out: list[tuple[str, Callable[[], Drafter], dict | None]] = []
    for name in [x.strip() for x in spec.split(",") if x.strip()]:
        kind = name
        if name == "preset":
            kind = {"model": "model", "prompt_lookup": "lookup", "suffix": "suffix"}.get(
                pair.preset.drafter, "none")
            name = f"preset:{kind}"
        if kind == "none":
            log.warning("drafter %s proposes nothing: no speculative runs for it", name)
        elif kind == "lookup":
            out.append((name, PromptLookup, {"prompt_lookup_num_tokens": lookup_tokens}))
        elif kind == "suffix":  # HF has no such assistant: no hf-assisted run for it
            out.append((name, SuffixDrafter, None))
        elif kind == "model" or kind.startswith(("shallow:", "skip:")):
            if kind == "model":
                model = pair.drafter.kv.model  # type: ignore[attr-defined]
            elif kind.startswith("shallow:"):
                model = shallow_draft(pair.target, int(kind.split(":", 1)[1]))
            else:  # skip:A+B, the first A and the last B layers
                first, last = (int(x) for x in kind.split(":", 1)[1].split("+"))
                total = pair.target.config.num_hidden_layers
                model = skip_draft(pair.target, [*range(first), *range(total - last, total)])
            out.append((name, partial(DraftModel, model, pad_id=pad, vocab_size=vocab),
                        {"assistant_model": model}))
        else:
            raise ValueError(f"--draft: unknown drafter {name!r}")
    return out


def batch_variance_note(device: torch.device, dtype: torch.dtype) -> str:
    """Why greedy outputs may differ from the reference without a fault of speculation: in
    a half-precision dtype on a CPU the target's own greedy output moves with the batch's
    shape (its attention's rounding follows the shape; docs/engine.md, "Lossless")."""
    if device.type != "cpu" or dtype == torch.float32:
        return ""
    name = str(dtype).removeprefix("torch.")
    return (f"; in {name} on a CPU the target's own greedy output moves with the batch's "
            f"shape, with or without drafts (docs/engine.md, Lossless): --dtype float32 "
            f"compares token for token")


def environment(pair: Pair) -> dict:
    dev = pair.target.device
    return {
        "torch": torch.__version__, "transformers": transformers.__version__,
        "python": platform.python_version(), "platform": platform.platform(),
        "device": str(dev), "dtype": str(pair.target.dtype).removeprefix("torch."),
        "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
        "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else None,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def bench(args: argparse.Namespace, workload: str | None = None) -> dict:
    """Run every configuration on the prompts (those of ``workload`` when given); returns
    the report (also written as JSON and PNG)."""
    pair = load_bench_pair(args)
    engine = pair.engine()  # for its EOS ids and pad id, the same the runs use
    new = args.max_new_tokens
    target = Target(pair.target, pair.tokenizer, engine.eos_ids, engine.pad_id)
    if workload:
        convs = WORKLOADS[workload]()
        convs = [convs[i % len(convs)] for i in range(args.prompts or len(convs))]
    else:
        convs = load_prompts(args.prompts or DEFAULT_PROMPTS, args.prompts_file)
    prompts = [encode_prompt(pair.tokenizer, Request(messages=m, max_new_tokens=new),
                             engine.context) for m in convs]
    distinct = len({tuple(p) for p in prompts})
    if distinct < len(prompts):
        log.warning("%d prompts, %d of them distinct: a repeated prompt's greedy output is one "
                    "the job already wrote, and a drafter that reads the job's outputs (suffix, "
                    "the job index) copies it whole; speculation's figures are then not a new "
                    "job's", len(prompts), distinct)
    drafters = _drafters(args.draft, pair, args.hf_lookup_tokens)
    methods = {METHODS[m] for m in args.methods}
    max_g = max(args.draft_lengths)
    log.info("%d prompts of %d-%d tokens; drafters %s", len(prompts),
             min(map(len, prompts)), max(map(len, prompts)), [d[0] for d in drafters])

    # every configuration's runs; repeats go round all configurations of a batch size in
    # turn, so that a slow spell of the machine falls on all of them alike, and each round
    # starts one configuration later, so that none always runs right after the same one
    tried: dict[tuple, list[Run]] = {}

    def done(key: tuple, run: Run) -> None:
        tried.setdefault(key, []).append(run)
        log.info("%s %s B=%d g=%s: %.1f tok/s", run.method, run.draft or "", run.batch_size,
                 run.g, run.new_tokens / run.seconds)

    for B in args.batch_sizes:
        configs: list[tuple[tuple, Callable[[], Run]]] = []
        if HF in methods:
            configs.append(((HF, B), partial(run_hf, target, prompts, B, new)))
        if NONE in methods:
            configs.append(((NONE, B), partial(run_specq, target, prompts, B, new)))
        for name, make, _ in drafters:
            if FIXED in methods:
                configs += [((FIXED, B, name, g),
                             partial(run_specq, target, prompts, B, new, make_drafter=make,
                                     draft=name, g=g, max_g=max_g))
                            for g in args.draft_lengths]
            if ADAPTIVE in methods:
                configs.append(((ADAPTIVE, B, name),
                                partial(run_specq, target, prompts, B, new, make_drafter=make,
                                        draft=name, g=None, max_g=max_g)))
        for i in range(args.repeat):
            for key, go in configs[i % len(configs):] + configs[: i % len(configs)]:
                done(key, go())
    if ASSISTED in methods:  # batch size is irrelevant: compare with the smallest's baselines
        for _ in range(args.repeat):
            for name, _, assistant in drafters:
                if assistant is not None:  # HF has such an assistant
                    done((ASSISTED, min(args.batch_sizes), name),
                         run_assisted(target, prompts, new, name, assistant))
    median = {k: sorted(v, key=lambda r: r.seconds)[len(v) // 2] for k, v in tried.items()}
    runs = [(median[k], median.get((HF, k[1])), median.get((NONE, k[1]))) for k in tried]
    reference = next((r for r, _, _ in runs if r.method == HF), None) or runs[0][0]
    near_tie = NearTieCheck(pair.target, prompts)
    rows = []
    for (run, hf, none), key in zip(runs, tried):
        row = figures(run, hf, none)
        row["seconds_of_repeats"] = [r.seconds for r in tried[key]]
        row["speedup_vs_none_by_round"] = by_round(tried[key], tried.get((NONE, key[1])))
        row.update(against_best_fixed(key, tried, median))
        row["reference"] = run is reference
        row["greedy"] = None if run is reference else compare(reference.outputs, run.outputs,
                                                              near_tie)
        rows.append(row)
    mismatched = sum(1 for r in rows if r["greedy"] and r["greedy"]["mismatches"])
    if mismatched:
        log.error("greedy outputs differ from the reference in %d run(s)%s", mismatched,
                  batch_variance_note(pair.target.device, pair.target.dtype))
    return {
        "environment": environment(pair),
        "config": {
            "pair": args.pair, "workload": workload, "drafts": [d[0] for d in drafters],
            "prompts": len(prompts), "distinct_prompts": distinct,
            "prompt_tokens": [len(p) for p in prompts], "max_new_tokens": new,
            "batch_sizes": args.batch_sizes, "draft_lengths": args.draft_lengths,
            "methods": sorted(methods), "hf_lookup_tokens": args.hf_lookup_tokens,
            "repeat": args.repeat,
            "command": " ".join(sys.argv),
        },
        "reference": f"{reference.method} B={reference.batch_size}",
        "greedy_mismatched_runs": mismatched,
        "runs": rows,
    }


def by_round(runs: list[Run], none: list[Run] | None) -> list[float] | None:
    """Speedup over no speculation (``none``: or another configuration) in each round of
    repeats: a run against the other's run of its own round. A round's configurations run
    one after another, so a slow spell of the machine that spans the round falls on both
    sides of its ratio; the spread of these ratios is what the median speedup can be
    trusted to. None without such runs in the same rounds (hf-assisted runs have rounds of
    their own)."""
    if not none or len(none) != len(runs) or runs[0].method == ASSISTED:
        return None
    return [(r.new_tokens / r.seconds) / (n.new_tokens / n.seconds)
            for r, n in zip(runs, none)]


def against_best_fixed(key: tuple, tried: dict[tuple, list[Run]],
                       median: dict[tuple, Run]) -> dict:
    """An adaptive run against the fixed draft length that ran fastest with the same
    drafter at its batch size (the best median): ``best_fixed_g``, the ratio of the two
    medians' tokens per second (``speedup_vs_best_fixed``) and each round's own ratio
    (``speedup_vs_best_fixed_by_round``: the two ran in one round, minutes apart rather
    than tens of minutes). Empty for any other run, or without fixed runs beside it."""
    if key[0] != ADAPTIVE:
        return {}
    fixed = [k for k in median if k[0] == FIXED and k[1:3] == key[1:3]]
    if not fixed:
        return {}
    best = max(fixed, key=lambda k: median[k].new_tokens / median[k].seconds)
    rate = [r.new_tokens / r.seconds for r in (median[key], median[best])]
    return {"best_fixed_g": best[3], "speedup_vs_best_fixed": rate[0] / rate[1],
            "speedup_vs_best_fixed_by_round": by_round(tried[key], tried[best])}


def run(args: argparse.Namespace) -> int:
    """Bench, print the table, write bench.json and bench.png under --output-dir (with
    --workload: bench-NAME.json and bench-NAME.png per workload, then the workloads'
    table). Returns 1 when greedy outputs mismatched (not near-ties), else 0."""
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    workloads = getattr(args, "workload", None) or [None]
    status = 0
    if grammar_bench.NAME in workloads:
        args.command_line = " ".join(sys.argv)
        status = grammar_bench.run(args)
        workloads = [w for w in workloads if w != grammar_bench.NAME]
        if not workloads:
            return status
    reports = {}
    for workload in workloads:
        report = reports[workload] = bench(args, workload)
        stem = f"bench-{workload}" if workload else "bench"
        write_json(out / f"{stem}.json", report)
        plot(out / f"{stem}.png", report["runs"])
        env = report["environment"]
        n, distinct = report["config"]["prompts"], report["config"]["distinct_prompts"]
        repeated = "" if distinct == n else f" ({distinct} distinct: repeats are copied)"
        print(f"specq bench: {args.pair}, {workload or 'prompts'}: "
              f"{n} prompts{repeated}, {args.max_new_tokens} new tokens, "
              f"{env['device']} {env['dtype']}, {env['cpu_count']} CPUs, torch "
              f"{env['torch']}; reference: {report['reference']}")
        print(table(report["runs"]))
        print()
        print(profile_table(report["runs"]))
        print(f"wrote {out / stem}.json and {out / stem}.png\n")
    print(LEGEND)
    print(PROFILE_LEGEND)
    if None not in reports:
        print()
        print(workload_table(reports))
        print(WORKLOAD_LEGEND)
    return 1 if status or any(r["greedy_mismatched_runs"] for r in reports.values()) else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m specq.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    add_arguments(p)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return run(args)
