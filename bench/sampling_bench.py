"""Sampled generation with top-k / top-p: the cut found among each row's likeliest tokens
first (sampling.CANDIDATES, what a CPU runs) against one sort of the whole vocabulary
(what a GPU runs), side by side.

The engine runs a workload's prompts (workloads.py) at `--batch` rows, each request seeded
and sampled at `--temperature`, `--top-p` and `--top-k`, for each of `--draft-lengths` (0:
no speculation; g: the suffix drafter at a fixed g, so that verify steps carry drafts).
Rounds interleave the two ways, each run on a fresh engine, each round starting with the
other. The figures are each side's median tokens per second with the rounds' range, and
how many texts the two ways agree on: seeded draws are the same in both, so only a
near-tie at the cut (a token whose mass sits within float rounding of top-p) can part them.

    python -m specq.bench.sampling_bench --pair smollm2-135m --batch 16 --temperature 0.8 \\
        --top-p 0.95
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from specq.bench import add_model_arguments, load_model, positive_int
from specq.bench.workloads import WORKLOADS
from specq.schema.generation import Request
from specq.worker.engine import sampling
from specq.worker.engine.drafters import NoDraft
from specq.worker.engine.speculative import SpeculativeEngine, encode_prompt
from specq.worker.engine.suffix import SuffixDrafter

WAYS = {"candidates first": sampling.CANDIDATES, "one sort": ()}


def run_once(pair, prompts: list[list[int]], args: argparse.Namespace, g: int,
             candidates: tuple[int, ...]) -> tuple[float, list[list[int]]]:
    """One run on a fresh engine: (tokens per second, output ids per prompt)."""
    drafter = SuffixDrafter() if g else NoDraft()
    engine = SpeculativeEngine(pair.target, pair.tokenizer, drafter, max_batch_size=args.batch,
                               draft_length=g, adaptive=False)
    requests = [Request(id=i, prompt_token_ids=p, max_new_tokens=args.max_new_tokens,
                        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                        seed=i) for i, p in enumerate(prompts)]
    saved, sampling.CANDIDATES = sampling.CANDIDATES, candidates
    try:
        t0 = time.perf_counter()
        results = engine.generate(requests)
        seconds = time.perf_counter() - t0
    finally:
        sampling.CANDIDATES = saved
    for r in results:
        if r.error:
            raise RuntimeError(f"prompt {r.id}: {r.error}")
    return sum(len(r.token_ids) for r in results) / seconds, [r.token_ids for r in results]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m specq.bench.sampling_bench",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(p)
    p.add_argument("--workload", default="synthesis", choices=list(WORKLOADS))
    p.add_argument("--prompts", type=positive_int, default=32)
    p.add_argument("--batch", type=positive_int, default=16)
    p.add_argument("--max-new-tokens", type=positive_int, default=48)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--draft-lengths", type=_lengths, default=[0, 3])
    p.add_argument("--rounds", type=positive_int, default=3)
    args = p.parse_args(argv)
    pair = load_model(args)
    engine = pair.engine()
    convs = WORKLOADS[args.workload]()
    prompts = [encode_prompt(pair.tokenizer, Request(messages=convs[i % len(convs)],
                                                     max_new_tokens=args.max_new_tokens),
                             engine.context) for i in range(args.prompts)]
    print(f"sampling_bench: {args.pair}, {args.workload}: {len(prompts)} prompts, batch "
          f"{args.batch}, {args.max_new_tokens} new tokens, temperature {args.temperature}, "
          f"top-p {args.top_p}, top-k {args.top_k}; candidates {sampling.CANDIDATES}")
    run_once(pair, prompts[: args.batch], args, 0, sampling.CANDIDATES)  # warm-up
    for g in args.draft_lengths:
        speeds: dict[str, list[float]] = {way: [] for way in WAYS}
        outputs: dict[str, list[list[int]]] = {}
        for r in range(args.rounds):
            for way in (list(WAYS) if r % 2 == 0 else list(WAYS)[::-1]):
                speed, outputs[way] = run_once(pair, prompts, args, g, WAYS[way])
                speeds[way].append(speed)
        first, second = (outputs[way] for way in WAYS)
        same = sum(a == b for a, b in zip(first, second))
        label = f"g = {g}" if g else "no speculation"
        for way, runs in speeds.items():
            print(f"{label:>15}  {way:>16}: {statistics.median(runs):7.1f} tokens/s "
                  f"(rounds {min(runs):.1f}-{max(runs):.1f})")
        ratio = statistics.median(speeds["candidates first"]) / statistics.median(
            speeds["one sort"])
        print(f"{label:>15}  candidates first / one sort {ratio:.2f}x; texts identical "
              f"{same}/{len(prompts)}")
    return 0


def _lengths(text: str) -> list[int]:
    """Comma-separated draft lengths, 0 (no speculation) to 16."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of integers: {text[:40]!r}") from None
    if not values or min(values) < 0 or max(values) > 16:
        raise argparse.ArgumentTypeError(f"need draft lengths from 0 to 16: {text[:40]!r}")
    return values


if __name__ == "__main__":
    sys.exit(main())
