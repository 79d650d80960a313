"""Prefill seconds of a job whose prompts share a prefix (a system prompt, a template),
with the engine's prefix sharing on and off, side by side.

`--prompts` prompts are a `--prefix-tokens` token system prompt followed by a short
question each; the engine runs them at `--batch` rows (refilling as rows finish) and
counts the seconds it spends prefilling (SpeculativeEngine.prefill_seconds). Rounds
interleave sharing on and off, each with a fresh engine (an empty prefix store); the
figure is each side's median, and the first tokens must agree.

    python -m specq.worker.bench.prefill_bench --pair smollm2-135m --prompts 64 --prefix-tokens 300
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys

import torch

from specq.configs.generation import Request
from specq.worker.bench import add_model_arguments, load_model, positive_int
from specq.worker.engine.drafters import NoDraft
from specq.worker.engine.speculative import SpeculativeEngine

log = logging.getLogger(__name__)
SYSTEM = ("You are a careful assistant that rewrites product descriptions for an online "
          "catalogue. Keep every fact, drop marketing adjectives, use plain sentences, "
          "state sizes in metric units and mention the material first. ")
TOPICS = ["a wooden chair", "a steel kettle", "a wool scarf", "a glass vase", "a leather bag",
          "a cotton shirt", "a ceramic mug", "a bamboo desk"]


def job(tokenizer, prompts: int, prefix_tokens: int) -> list[list[int]]:
    """Prompt token ids: the same `prefix_tokens` system tokens, then a question each."""
    system = tokenizer(SYSTEM * (prefix_tokens // 20 + 1)).input_ids[:prefix_tokens]
    return [system + tokenizer(f" Item {i}: rewrite the description of {TOPICS[i % len(TOPICS)]}"
                               f" sold in pack {i // len(TOPICS) + 1}.").input_ids
            for i in range(prompts)]


def run_once(pair, prompts: list[list[int]], batch: int, new_tokens: int,
             share: bool) -> tuple[float, list[list[int]]]:
    engine = SpeculativeEngine(pair.target, pair.tokenizer, NoDraft(), max_batch_size=batch,
                               share_prefixes=share)
    results = engine.generate(Request(id=i, prompt_token_ids=p, max_new_tokens=new_tokens)
                              for i, p in enumerate(prompts))
    return engine.prefill_seconds, [r.token_ids for r in results]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m specq.worker.bench.prefill_bench",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(p)
    p.add_argument("--prompts", type=positive_int, default=64)
    p.add_argument("--prefix-tokens", type=positive_int, default=300)
    p.add_argument("--batch", type=positive_int, default=16)
    p.add_argument("--max-new-tokens", type=positive_int, default=1,
                   help="1: the job is all prefill; more: rows refill as others finish")
    p.add_argument("--repeat", type=positive_int, default=1)
    args = p.parse_args(argv)
    pair = load_model(args)
    prompts = job(pair.tokenizer, args.prompts, args.prefix_tokens)
    seconds: dict[bool, list[float]] = {True: [], False: []}
    tokens = {}
    for _ in range(args.repeat):
        for share in (False, True):
            t, tokens[share] = run_once(pair, prompts, args.batch, args.max_new_tokens, share)
            seconds[share].append(t)
    same = sum(a == b for a, b in zip(tokens[True], tokens[False]))
    off, on = statistics.median(seconds[False]), statistics.median(seconds[True])
    lengths = sorted(map(len, prompts))
    print(f"{args.prompts} prompts of {lengths[0]}-{lengths[-1]} tokens sharing "
          f"{args.prefix_tokens}, batch {args.batch}, {args.max_new_tokens} new tokens, "
          f"{args.pair} on {pair.target.device} {str(pair.target.dtype).removeprefix('torch.')}, "
          f"torch threads {torch.get_num_threads()}, median of {args.repeat}")
    print(f"prefill seconds: sharing off {off:.2f}, on {on:.2f}: {off / on:.2f}x faster; "
          f"outputs identical {same}/{len(prompts)}")
    return 0 if same == len(prompts) else 1


if __name__ == "__main__":
    sys.exit(main())
