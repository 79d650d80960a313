"""What the packed forward (worker/engine/packed.py) saves, side by side in one run.

1. A ragged verify pass: B rows of `--context` real columns each (one random prompt,
   prefilled once and copied into every row), a pass of g + 1 columns in which only
   `--carrying` of the rows carry g drafts and the rest carry their last token alone; the
   packed forward against the padded one (transformers' forward) in the same cache, and a
   plain pass (one token per row, packed) for scale. Each pass's columns are taken back
   out after it, outside the timer, so every pass sees the same length. From the packed
   and the plain pass, what a draft token costs (their difference over the drafts
   carried), what a row's token of the plain pass costs (the plain pass over B), and their
   ratio: the survival a draft token needs to pay for itself while requests wait for a
   place (budget.py prices it so), at each batch size and each `--context` given.
2. No speculation: the engine (packed forward) against transformers' own padded `generate`
   and against the engine on the padded forward, greedy, `--prompts-per-row` prompts per
   batch row of the built-in prompts, `--max-new-tokens` each; their outputs compared.

Rounds interleave the configurations (each round starts one later); a figure is the median
over `--rounds` rounds with the rounds' range, and ratios are taken round by round.

    python -m specq.bench.verify_bench --pair smollm2-135m --batch-sizes 16,64 --rounds 3
    python -m specq.bench.verify_bench --pair smollm2-135m --parts verify --context 8,300 \
        --batch-sizes 16,32,64 --draft-length 2 --carrying 0.25
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
from transformers import PreTrainedModel

from specq.bench import _ints, add_model_arguments, load_model, positive_int
from specq.bench.greedy import NearTieCheck, compare
from specq.bench.prompts import load_prompts
from specq.bench.runner import Run, Target, run_hf, run_specq
from specq.schema.generation import Request
from specq.worker.engine import packed
from specq.worker.engine.batch import KVRows
from specq.worker.engine.speculative import encode_prompt

log = logging.getLogger(__name__)
VOCAB_LOW = 100  # random prompt ids start here, past any special token


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _spread(values: list[float]) -> dict[str, Any]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "rounds": values}


def _rounds(configs: Mapping[str, Callable[[], float]], rounds: int) -> dict[str, list[float]]:
    """Each configuration's figure per round; round i starts with configuration i."""
    names = list(configs)
    out: dict[str, list[float]] = {n: [] for n in names}
    for i in range(rounds):
        for name in names[i % len(names):] + names[: i % len(names)]:
            out[name].append(configs[name]())
    return out


@contextmanager
def padded_forward() -> Iterator[None]:
    """Every KVRows made inside runs transformers' padded forward (packed.ENV)."""
    before = os.environ.get(packed.ENV)
    os.environ[packed.ENV] = "0"
    try:
        yield
    finally:
        if before is None:
            del os.environ[packed.ENV]
        else:
            os.environ[packed.ENV] = before


def _pass_ms(kv: KVRows, ids: torch.Tensor, valid: torch.Tensor, context: int,
             passes: int) -> float:
    """Median milliseconds of ``passes`` passes, each taken back out after (untimed)."""
    times = []
    for _ in range(passes):
        _sync(kv.device)
        t0 = time.perf_counter()
        kv.logits(ids, valid)  # as a step verifies: the packed forward spreads nothing
        _sync(kv.device)
        times.append(time.perf_counter() - t0)
        kv.keep(context, torch.zeros(kv.rows, dtype=torch.long, device=kv.device))
        kv.compact(force=True)
    return 1e3 * statistics.median(times)


@torch.inference_mode()
def verify_passes(model: PreTrainedModel, batches: list[int], context: int, g: int,
                  carrying: float, passes: int, rounds: int) -> list[dict]:
    """Part 1: per batch size, the ragged verify pass packed and padded, and a plain pass;
    a draft token's price beside a row's plain token (``break_even``)."""
    dev, W = model.device, g + 1
    gen = torch.Generator().manual_seed(context)
    vocab = model.config.vocab_size
    prompt = torch.randint(VOCAB_LOW, vocab, (1, context), generator=gen).to(dev)
    one = KVRows(model)
    one.forward(prompt, torch.ones_like(prompt, dtype=torch.bool), last_only=True)
    layers = one.columns(0, 0, context)
    out: list[dict[str, Any]] = []
    for B in batches:
        caches = {name: KVRows.from_prefix(model, layers, [context] * B, packed=name != "padded")
                  for name in ("packed", "padded")}
        ids = torch.randint(VOCAB_LOW, vocab, (B, W), generator=gen).to(dev)
        carriers = max(1, round(B * carrying))
        valid = torch.zeros(B, W, dtype=torch.bool, device=dev)
        valid[:, 0] = True
        valid[:carriers] = True  # [B, W]: the first rows carry g drafts, the rest none

        plain = torch.ones(B, 1, dtype=torch.bool, device=dev)
        configs = {
            "packed": partial(_pass_ms, caches["packed"], ids, valid, context, passes),
            "padded": partial(_pass_ms, caches["padded"], ids, valid, context, passes),
            "plain": partial(_pass_ms, caches["packed"], ids[:, :1], plain, context, passes),
        }
        for _ in range(2):  # warm-up: the buffers reach their size, the kernels load
            for go in configs.values():
                go()
        ms = _rounds(configs, rounds)
        ratio = [a / b for a, b in zip(ms["packed"], ms["plain"])]
        drafts = carriers * g
        draft = [(a - b) / drafts for a, b in zip(ms["packed"], ms["plain"])]
        row = [b / B for b in ms["plain"]]
        out.append({"batch": B, "context": context, "width": W, "carrying_rows": carriers,
                    "tokens_carried": int(valid.sum()), "tokens_padded": B * W,
                    **{f"{k}_ms": _spread(v) for k, v in ms.items()},
                    "packed_over_padded": _spread([a / b for a, b in zip(ms["packed"],
                                                                         ms["padded"])]),
                    "packed_over_plain": _spread(ratio),
                    "draft_token_ms": _spread(draft), "row_token_ms": _spread(row),
                    "break_even": _spread([d / r for d, r in zip(draft, row)])})
        log.info("verify B=%d: packed %.1f ms, padded %.1f ms", B,
                 out[-1]["packed_ms"]["median"], out[-1]["padded_ms"]["median"])
    return out


def _padded_run(t: Target, prompts: list[list[int]], B: int, max_new: int) -> Run:
    with padded_forward():
        return run_specq(t, prompts, B, max_new)


def _timed_run(make: Callable[[], Run], runs: list[Run]) -> float:
    """Seconds of one run, kept in ``runs``."""
    runs.append(make())
    return runs[-1].seconds


def no_speculation(pair, batches: list[int], per_row: int, max_new: int,
                   rounds: int) -> list[dict]:
    """Part 2: per batch size, seconds of transformers' `generate`, the engine packed and
    the engine padded, without speculation, on the same prompts."""
    engine = pair.engine()
    t = Target(pair.target, pair.tokenizer, engine.eos_ids, engine.pad_id)
    out = []
    for B in batches:
        convs = load_prompts(B * per_row)
        prompts = [encode_prompt(t.tokenizer, Request(messages=m, max_new_tokens=max_new),
                                 engine.context) for m in convs]
        runs: dict[str, list[Run]] = {"hf": [], "packed": [], "padded": []}
        makers = {"hf": partial(run_hf, t, prompts, B, max_new),
                  "packed": partial(run_specq, t, prompts, B, max_new),
                  "padded": partial(_padded_run, t, prompts, B, max_new)}
        seconds = _rounds({n: partial(_timed_run, makers[n], runs[n]) for n in makers},
                          rounds)
        near_tie = NearTieCheck(t.model, prompts)
        ref = runs["hf"][0].outputs
        greedy = {n: compare(ref, runs[n][0].outputs, near_tie) for n in ("packed", "padded")}
        tokens = sum(len(o) for o in ref)
        row: dict[str, Any] = {"batch": B, "prompts": len(prompts), "new_tokens": tokens,
               **{f"{n}_s": _spread(v) for n, v in seconds.items()},
               "hf_over_packed": _spread([h / p for h, p in zip(seconds["hf"],
                                                                 seconds["packed"])]),
               "padded_over_packed": _spread([d / p for d, p in zip(seconds["padded"],
                                                                    seconds["packed"])]),
               "greedy_vs_hf": greedy}
        out.append(row)
        log.info("no speculation B=%d: hf %.1f s, packed %.1f s, padded %.1f s", B,
                 row["hf_s"]["median"], row["packed_s"]["median"], row["padded_s"]["median"])
    return out


def markdown(report: dict) -> str:
    lines = []
    if report.get("verify"):
        lines += ["| batch | context | rows carrying g | tokens carried / padded | packed ms | "
                  "padded ms | packed / padded | packed / plain pass | draft token ms | "
                  "row's token ms | break-even survival |",
                  "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in report["verify"]:
            lines.append(
                f"| {r['batch']} | {r['context']} | {r['carrying_rows']} | "
                f"{r['tokens_carried']} / {r['tokens_padded']} | {_cell(r['packed_ms'], 1)} | "
                f"{_cell(r['padded_ms'], 1)} | {_cell(r['packed_over_padded'], 2)} | "
                f"{_cell(r['packed_over_plain'], 2)} | {_cell(r['draft_token_ms'], 2)} | "
                f"{_cell(r['row_token_ms'], 2)} | {_cell(r['break_even'], 2)} |")
        lines.append("")
    if report.get("no_speculation"):
        lines += ["| batch | prompts | HF generate s | engine packed s | engine padded s | "
                  "HF / packed | padded / packed | greedy = HF (packed, padded) |",
                  "|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in report["no_speculation"]:
            g = r["greedy_vs_hf"]
            lines.append(
                f"| {r['batch']} | {r['prompts']} | {_cell(r['hf_s'], 2)} | "
                f"{_cell(r['packed_s'], 2)} | {_cell(r['padded_s'], 2)} | "
                f"{_cell(r['hf_over_packed'], 2)} | {_cell(r['padded_over_packed'], 2)} | "
                f"{_agree(g['packed'], r['prompts'])}, {_agree(g['padded'], r['prompts'])} |")
    return "\n".join(lines)


def _cell(s: dict, digits: int) -> str:
    return f"{s['median']:.{digits}f} ({s['min']:.{digits}f}-{s['max']:.{digits}f})"


def _agree(greedy: dict, n: int) -> str:
    ties = f" +{greedy['near_ties']} near-ties" if greedy["near_ties"] else ""
    bad = f", {greedy['mismatches']} MISMATCHED" if greedy["mismatches"] else ""
    return f"{greedy['equal']}/{n}{ties}{bad}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(p)
    p.add_argument("--batch-sizes", type=_ints, default=[16, 64],
                   help="part 1, the ragged verify pass")
    p.add_argument("--plain-batch-sizes", type=_ints, default=[1, 16, 64],
                   help="part 2, no speculation against transformers' generate")
    p.add_argument("--context", type=_ints, default=[256],
                   help="part 1: each row's real columns before the pass (a list: each)")
    p.add_argument("--draft-length", type=positive_int, default=4)
    p.add_argument("--carrying", type=float, default=0.25,
                   help="share of the rows that carry drafts in the verify pass")
    p.add_argument("--passes", type=positive_int, default=5, help="timed passes per round")
    p.add_argument("--prompts-per-row", type=positive_int, default=2)
    p.add_argument("--max-new-tokens", type=positive_int, default=32)
    p.add_argument("--rounds", type=positive_int, default=3)
    p.add_argument("--parts", default="verify,plain", help="verify, plain or both")
    args = p.parse_args(argv)
    pair = load_model(args)
    parts = {x.strip() for x in args.parts.split(",")}
    report: dict = {"command": " ".join(sys.argv), "torch_threads": torch.get_num_threads(),
                    "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                    "packed": KVRows(pair.target).packed}
    if "verify" in parts:
        report["verify"] = [r for context in args.context
                            for r in verify_passes(pair.target, args.batch_sizes, context,
                                                   args.draft_length, args.carrying,
                                                   args.passes, args.rounds)]
    if "plain" in parts:
        report["no_speculation"] = no_speculation(pair, args.plain_batch_sizes,
                                                  args.prompts_per_row, args.max_new_tokens,
                                                  args.rounds)
    print(markdown(report))
    bad = sum(g["mismatches"] for r in report.get("no_speculation", [])
              for g in r["greedy_vs_hf"].values())
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
