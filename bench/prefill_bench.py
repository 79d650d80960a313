"""Prefill seconds of a job whose prompts share a prefix (a system prompt, a template),
with the engine's prefix sharing on and off, side by side.

`--prompts` prompts are a `--prefix-tokens` token system prompt followed by a short
question each; the engine runs them at `--batch` rows (refilling as rows finish) and
counts the seconds it spends prefilling (SpeculativeEngine.prefill_seconds; every refill
prefilled in a pass of its own, none joining a running pass: ``join_refills=False``). Rounds
interleave sharing on and off, each with a fresh engine (an empty prefix store); the
figure is each side's median, and the first tokens must agree.

    python -m specq.bench.prefill_bench --pair smollm2-135m --prompts 64 --prefix-tokens 300

With `--templates N` the prompts use N different system prompts (prompt i the (i mod N)-th),
so that every admission holds several shared-prefix groups, as a synthesis job's does;
`--head-tokens K` gives the templates their first K tokens in common (a chat template's
header and default system prompt, before each task's own instructions);
`--check-alone` also runs each prompt alone (batch 1, sharing off) and counts the outputs
that equal it. Every run reports its batch rows per step (the batch stays full).

With `--admit-groups 1,4` it compares refill groups instead (sharing on): rows ask for
1..`--max-new-tokens` tokens (varied, so that they finish one by one), and a refill waits
until that many rows are free (SpeculativeEngine.admit_group); the figures are prefills,
prefill seconds and the whole job's seconds.

    python -m specq.bench.prefill_bench --prompts 64 --max-new-tokens 32 --admit-groups 1,4
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from typing import Any

import torch

from specq.bench import _ints, add_model_arguments, load_model, positive_int
from specq.schema.generation import Request
from specq.worker.engine.drafters import NoDraft
from specq.worker.engine.speculative import SpeculativeEngine

log = logging.getLogger(__name__)
SYSTEM = ("You are a careful assistant that rewrites product descriptions for an online "
          "catalogue. Keep every fact, drop marketing adjectives, use plain sentences, "
          "state sizes in metric units and mention the material first. ")
TOPICS = ["a wooden chair", "a steel kettle", "a wool scarf", "a glass vase", "a leather bag",
          "a cotton shirt", "a ceramic mug", "a bamboo desk"]


HEAD = "You work for a shop's catalogue team and answer in English. "
TEAMS = ["Furniture", "Kitchen", "Clothing", "Garden", "Toys", "Lighting", "Office", "Sports"]


def job(tokenizer, prompts: int, prefix_tokens: int, templates: int = 1,
        head_tokens: int = 0) -> list[list[int]]:
    """Prompt token ids: one of ``templates`` system prompts of `prefix_tokens` tokens
    (prompt i takes the (i mod templates)-th; the first ``head_tokens`` of them the same in
    every template), then a question each."""
    head = tokenizer(HEAD * (head_tokens // 10 + 1)).input_ids[:head_tokens]
    systems = [head + tokenizer(f"[{TEAMS[t % len(TEAMS)]} desk {t}] "
                                + SYSTEM * (prefix_tokens // 20 + 1)
                                ).input_ids[: max(prefix_tokens - head_tokens, 1)]
               for t in range(templates)]
    return [systems[i % templates]
            + tokenizer(f" Item {i}: rewrite the description of {TOPICS[i % len(TOPICS)]}"
                        f" sold in pack {i // len(TOPICS) + 1}.").input_ids
            for i in range(prompts)]


def run_once(pair, prompts: list[list[int]], batch: int, new_tokens: int | list[int],
             share: bool, group: int | None = None
             ) -> tuple[SpeculativeEngine, float, list, list[int]]:
    """One run on a fresh engine: (the engine, wall seconds, output ids per prompt, rows of
    each step). A result with an error fails the run."""
    # refills prefilled in passes of their own: the passes this bench times (a refill that
    # joins a running pass is decoding's time, SpeculativeEngine._join)
    engine = SpeculativeEngine(pair.target, pair.tokenizer, NoDraft(), max_batch_size=batch,
                               share_prefixes=share, admit_group=group, join_refills=False)
    rows: list[int] = []
    engine.on_step = lambda step: rows.append(len(step.accepted))
    new = new_tokens if isinstance(new_tokens, list) else [new_tokens] * len(prompts)
    t0 = time.perf_counter()
    results = engine.generate(Request(id=i, prompt_token_ids=p, max_new_tokens=n)
                              for i, (p, n) in enumerate(zip(prompts, new)))
    seconds = time.perf_counter() - t0
    for r in results:
        if r.error:
            raise RuntimeError(f"prompt {r.id}: {r.error}")
    return engine, seconds, [r.token_ids for r in results], rows


def varied(prompts: int, max_new: int) -> list[int]:
    """max_new_tokens per prompt spread over 1..max_new: rows finish one by one."""
    return [1 + (i * 7) % max_new for i in range(prompts)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m specq.bench.prefill_bench",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(p)
    p.add_argument("--prompts", type=positive_int, default=64)
    p.add_argument("--prefix-tokens", type=positive_int, default=300)
    p.add_argument("--batch", type=positive_int, default=16)
    p.add_argument("--max-new-tokens", type=positive_int, default=1,
                   help="1: the job is all prefill; more: rows refill as others finish")
    p.add_argument("--repeat", type=positive_int, default=1)
    p.add_argument("--templates", type=positive_int, default=1,
                   help="different system prompts among the prompts")
    p.add_argument("--head-tokens", type=int, default=0,
                   help="tokens every template starts with (a chat template's header)")
    p.add_argument("--check-alone", action="store_true",
                   help="also run each prompt alone and count outputs equal to it")
    p.add_argument("--admit-groups", type=_ints,
                   help="compare these refill groups (e.g. 1,4) instead of sharing off/on")
    args = p.parse_args(argv)
    pair = load_model(args)
    if not 0 <= args.head_tokens < args.prefix_tokens:
        p.error("--head-tokens: from 0 to --prefix-tokens - 1")
    prompts = job(pair.tokenizer, args.prompts, args.prefix_tokens, args.templates,
                  args.head_tokens)
    configs = ([(True, g) for g in args.admit_groups] if args.admit_groups
               else [(False, None), (True, None)])
    new = varied(len(prompts), args.max_new_tokens) if args.admit_groups else args.max_new_tokens
    runs: dict[tuple, list[tuple[int, float, float]]] = {c: [] for c in configs}
    tokens: dict[tuple | str, list] = {}  # by config, and 'alone'
    steps: dict[tuple, Any] = {}
    for _ in range(args.repeat):  # rounds interleave the configurations
        for share, group in configs:
            engine, wall, tokens[share, group], steps[share, group] = run_once(
                pair, prompts, args.batch, new, share, group)
            runs[share, group].append((engine.admissions, engine.prefill_seconds, wall))
    first = tokens[configs[0]]
    if args.check_alone:
        alone = [run_once(pair, [q], 1, n, False)[2][0] for q, n in
                 zip(prompts, new if isinstance(new, list) else [new] * len(prompts))]
        tokens["alone"] = alone
    same = min(sum(a == b for a, b in zip(first, t)) for t in tokens.values())
    lengths = sorted(map(len, prompts))
    print(f"{args.prompts} prompts of {lengths[0]}-{lengths[-1]} tokens sharing "
          f"{args.prefix_tokens} in {args.templates} template(s)"
          f"{f' ({args.head_tokens} common to all)' if args.head_tokens else ''}, "
          f"batch {args.batch}, "
          f"{'1-' if args.admit_groups else ''}{args.max_new_tokens} new tokens, "
          f"{args.pair} on {pair.target.device} {str(pair.target.dtype).removeprefix('torch.')}, "
          f"torch threads {torch.get_num_threads()}, median of {args.repeat}")

    def median(config: tuple, k: int) -> float:
        return statistics.median(r[k] for r in runs[config])

    if args.admit_groups:
        base = configs[0]
        for c in configs:
            print(f"admit group {c[1]}: {median(c, 0):.0f} prefills, prefill seconds "
                  f"{median(c, 1):.2f}, job seconds {median(c, 2):.2f} "
                  f"({median(base, 2) / median(c, 2):.2f}x group {base[1]}'s speed)")
    else:
        off, on = median((False, None), 1), median((True, None), 1)
        print(f"prefill seconds: sharing off {off:.2f}, on {on:.2f}: {off / on:.2f}x faster")
    for (share, group), rows in steps.items():
        if not rows:  # max_new_tokens 1: the prefill gives the only token, no step
            continue
        print(f"sharing {'on' if share else 'off'}{f', group {group}' if group else ''}: "
              f"rows per step {statistics.mean(rows):.1f} (max {max(rows)}) over "
              f"{len(rows)} steps")
    print(f"outputs identical {same}/{len(prompts)}"
          + (" (each also equal to the prompt run alone)" if args.check_alone else ""))
    return 0 if same == len(prompts) else 1


if __name__ == "__main__":
    sys.exit(main())
