"""`specq bench --workload json-schema`: structured outputs, and the grammar as a drafter.

24 prompts of the synthesis and extraction kind (person extraction, review scoring, quiz
writing, ticket triage), each with a JSON schema, run side by side on one pair at each batch
size:

- free          no response_format, no drafts: how often the model's own answer parses and
                validates when only the prompt asks for JSON;
- shaped        the schema as response_format, no drafts: constrained decoding as other
                engines do it, the baseline of every speedup here;
- +grammar      shaped, with the grammar's forced tokens as drafts (no other drafter);
- DRAFTER       shaped, with the drafter (lookup, suffix) but no grammar drafts;
- DRAFTER+grammar  shaped, with both: forced tokens first, then the drafter's continuation.

For each: wall seconds, tokens per target pass, the share of outputs that parse and validate
against their schema, forced tokens proposed and accepted, and the grammar mask's cost (per
generated token, and as a share of the run), and where the run's wall time went, phase by
phase (the engine's profile: prefill, drafting, the target's pass, the grammar's masks...).
Speedups are wall-time ratios against
``shaped`` and against the same drafter without grammar drafts, measured in the same process;
with ``--repeat``, a round runs each configuration once (each round starting one later), and
the speedup over ``shaped`` is the median of the rounds' with their range.
Every shaped run's greedy output must equal ``shaped``'s token for token (mismatches are
counted; the engine tests hold it against transformers' generate).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import jsonschema
import torch

from specq.bench.figures import profile_figures
from specq.bench.report import PROFILE_LEGEND, profile_table, write_json
from specq.bench.runner import load_bench_pair
from specq.schema.generation import Message, Request
from specq.worker.engine.drafters import Drafter, NoDraft, PromptLookup
from specq.worker.engine.speculative import SpeculativeEngine
from specq.worker.engine.suffix import SuffixDrafter

log = logging.getLogger(__name__)
NAME = "json-schema"

_PERSON = {"type": "object", "additionalProperties": False,
           "required": ["name", "age", "city", "job"],
           "properties": {"name": {"type": "string", "maxLength": 40},
                          "age": {"type": "integer", "minimum": 0, "maximum": 120},
                          "city": {"type": "string", "maxLength": 30},
                          "job": {"type": "string", "maxLength": 30}}}
_REVIEW = {"type": "object", "additionalProperties": False,
           "required": ["product", "rating", "sentiment", "summary"],
           "properties": {"product": {"type": "string", "maxLength": 40},
                          "rating": {"type": "integer", "minimum": 1, "maximum": 5},
                          "sentiment": {"enum": ["positive", "negative", "mixed"]},
                          "summary": {"type": "string", "maxLength": 80}}}
_QUIZ = {"type": "object", "additionalProperties": False,
         "required": ["question", "options", "answer"],
         "properties": {"question": {"type": "string", "maxLength": 80},
                        "options": {"type": "array", "minItems": 4, "maxItems": 4,
                                    "items": {"type": "string", "maxLength": 24}},
                        "answer": {"enum": ["A", "B", "C", "D"]}}}
_TICKET = {"type": "object", "additionalProperties": False,
           "required": ["title", "priority", "category", "summary"],
           "properties": {"title": {"type": "string", "maxLength": 50},
                          "priority": {"enum": ["low", "medium", "high", "urgent"]},
                          "category": {"enum": ["billing", "technical", "account", "other"]},
                          "summary": {"type": "string", "maxLength": 80}}}

_PEOPLE = ["Maria Lopez is a 34-year-old nurse who lives in Madrid.",
           "Born 51 years ago, John Smith now works as a baker in London.",
           "In Osaka, Aiko Tanaka (28) has worked as an engineer for many years.",
           "Peter Novak, teacher, age 45, moved to Prague last spring.",
           "Fatima Khan is a 39-year-old lawyer from Lahore.",
           "Lucas Martin, 62, is a retired pilot living in Lyon."]
_REVIEWS = ["The blender is loud but it crushes ice in seconds. Worth the money.",
            "These headphones broke after two weeks. Terrible sound, avoid them.",
            "The tent kept us dry all night, though it is heavy to carry.",
            "Great coffee grinder, easy to clean and very consistent.",
            "The phone case looks nice but the buttons are hard to press.",
            "This desk chair is comfortable and was easy to assemble."]
_TOPICS = ["the solar system", "world capitals", "basic chemistry", "the human body",
           "famous painters", "computer networks"]
_TICKETS = ["I was charged twice for my subscription this month, please refund one.",
            "The app crashes every time I open the settings page on my phone.",
            "I forgot my password and the reset email never arrives.",
            "Can you tell me where your company offices are located?",
            "Our whole team cannot log in since this morning, we need help now!",
            "The invoice shows the wrong company name, please correct it."]


def _keys(schema: dict) -> str:
    return ", ".join(f'"{k}"' for k in schema["properties"])


def prompts() -> list[tuple[list[Message], dict]]:
    """(conversation, JSON schema) for each of the 24 prompts."""
    out = []
    for text in _PEOPLE:
        out.append((f"Extract the person in the text as a JSON object with the keys "
                    f"{_keys(_PERSON)}. Answer with the JSON object only.\n\nText: {text}",
                    _PERSON))
    for text in _REVIEWS:
        out.append((f"Read the customer review and answer with a JSON object with the keys "
                    f"{_keys(_REVIEW)} (rating from 1 to 5; sentiment positive, negative or "
                    f"mixed). Answer with the JSON object only.\n\nReview: {text}", _REVIEW))
    for topic in _TOPICS:
        out.append((f"Write one multiple-choice quiz question about {topic} as a JSON object "
                    f"with the keys {_keys(_QUIZ)} (four options; the answer is A, B, C or D)."
                    f" Answer with the JSON object only.", _QUIZ))
    for text in _TICKETS:
        out.append((f"Triage the support ticket: answer with a JSON object with the keys "
                    f"{_keys(_TICKET)} (priority low, medium, high or urgent; category billing,"
                    f" technical, account or other). Answer with the JSON object only.\n\n"
                    f"Ticket: {text}", _TICKET))
    return [([Message(role="user", content=text)], schema) for text, schema in out]


def valid(text: str, schema: dict) -> bool:
    """The text is one JSON value (surrounding whitespace aside) valid against the schema."""
    try:
        jsonschema.validate(json.loads(text), schema)
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False
    return True


@dataclass
class Config:
    label: str
    drafter: Callable[[], Drafter]
    shaped: bool
    grammar_drafts: bool


def configs(drafters: list[str]) -> list[Config]:
    makers = {"lookup": PromptLookup, "suffix": SuffixDrafter}
    out = [Config("free", NoDraft, False, False), Config("shaped", NoDraft, True, False),
           Config("+grammar", NoDraft, True, True)]
    for name in drafters:
        out += [Config(name, makers[name], True, False),
                Config(f"{name}+grammar", makers[name], True, True)]
    return out


def run_config(pair, cfg: Config, convs, batch: int, max_new: int) -> dict:
    """Warm up, then one timed generation of every prompt under ``cfg``."""
    engine = SpeculativeEngine(pair.target, pair.tokenizer, cfg.drafter(),
                               max_batch_size=batch, draft_length=4,
                               grammar_drafts=cfg.grammar_drafts)
    requests = [Request(id=i, messages=m, max_new_tokens=max_new,
                        response_format={"type": "json_schema", "json_schema": {
                            "name": "answer", "schema": s, "strict": True}}
                        if cfg.shaped else None)
                for i, (m, s) in enumerate(convs)]
    engine.generate([r.model_copy(update={"max_new_tokens": 4}) for r in requests[:batch]],
                    job="warm-up")
    engine.calibrate([batch])
    engine.grammars.masking.reset()
    engine.profile.reset()
    t0 = time.perf_counter()
    results = engine.generate(requests, job="bench")
    seconds = time.perf_counter() - t0
    profile = dict(engine.profile.seconds)
    for r in results:
        if r.error:
            raise RuntimeError(f"prompt {r.id}: {r.error}")
    new = sum(r.counters.new_tokens for r in results)
    passes = sum(r.counters.target_passes for r in results)
    c = [r.counters for r in results]
    return {
        "config": cfg.label, "batch_size": batch, "seconds": seconds, "new_tokens": new,
        "target_passes": passes, "tokens_per_pass": new / passes,
        "valid": sum(valid(r.text, s) for r, (_, s) in zip(results, convs)),
        "length_cut": sum(r.finish_reason == "length" for r in results),
        "proposed": sum(x.proposed for x in c), "accepted": sum(x.accepted for x in c),
        "forced_proposed": sum(x.forced_proposed for x in c),
        "forced_accepted": sum(x.forced_accepted for x in c),
        "mask_seconds": engine.grammars.mask_seconds,
        "mask_us_per_token": 1e6 * engine.grammars.mask_seconds / max(new, 1),
        "mask_share": engine.grammars.mask_seconds / seconds,
        **profile_figures(profile, seconds),
        "outputs": [r.token_ids for r in results],
        "texts": [r.text for r in results],
    }


def bench(args: argparse.Namespace) -> dict:
    pair = load_bench_pair(args)
    convs = prompts()
    convs = [convs[i % len(convs)] for i in range(args.prompts or len(convs))]
    drafters = [d for d in args.grammar_drafters.split(",") if d]
    chosen = [c for c in configs(drafters)
              if not args.grammar_configs or c.label in args.grammar_configs.split(",")]
    if "shaped" not in {c.label for c in chosen}:
        raise ValueError("--grammar-configs: shaped is every speedup's baseline; keep it")
    rows = []
    for batch in args.batch_sizes:
        runs: dict[str, list[dict]] = {c.label: [] for c in chosen}
        for i in range(args.repeat):  # a round runs each config once, each round one later
            for cfg in chosen[i % len(chosen):] + chosen[: i % len(chosen)]:
                runs[cfg.label].append(run_config(pair, cfg, convs, batch,
                                                  args.max_new_tokens))
        for cfg in chosen:
            row = sorted(runs[cfg.label], key=lambda r: r["seconds"])[args.repeat // 2]
            row["seconds_of_repeats"] = [r["seconds"] for r in runs[cfg.label]]
            row["tokens_per_pass_of_repeats"] = [r["tokens_per_pass"] for r in runs[cfg.label]]
            # the figure a bar reads: the rounds' median (the median-seconds run's own may be
            # any round's: 2.66 beside rounds of 3.05 and 3.06, docs/benchmarks.md)
            row["tokens_per_pass_median"] = statistics.median(row["tokens_per_pass_of_repeats"])
            rows.append(row)
            log.info("%s B=%d: %.1f s, %.2f tokens/pass, %d/%d valid", cfg.label, batch,
                     row["seconds"], row["tokens_per_pass"], row["valid"], len(convs))
    for row in rows:  # speedups and greedy identity, against runs of the same batch size
        same = {r["config"]: r for r in rows if r["batch_size"] == row["batch_size"]}
        base = same["shaped"]
        # each round's ratio (its configs ran one after another): the median and its spread
        row["speedup_vs_shaped_rounds"] = [b / s for b, s in zip(base["seconds_of_repeats"],
                                                                 row["seconds_of_repeats"])]
        row["speedup_vs_shaped"] = statistics.median(row["speedup_vs_shaped_rounds"])
        without = same.get(row["config"].removesuffix("+grammar") or "shaped")
        row["speedup_vs_no_grammar_drafts"] = (
            without["seconds"] / row["seconds"]
            if row["config"].endswith("+grammar") and without else None)
        row["mismatches"] = (None if row["config"] == "free" else
                             sum(a != b for a, b in zip(row["outputs"], base["outputs"])))
    return {"pair": args.pair, "prompts": len(convs), "max_new_tokens": args.max_new_tokens,
            "batch_sizes": args.batch_sizes, "threads": torch.get_num_threads(),
            "runs": rows}


def table(report: dict) -> str:
    head = (f"{'config':<16} {'B':>3} {'s':>7} {'tok/pass (rounds)':>17} {'valid':>7} "
            f"{'forced':>11} {'mask us/tok':>11} {'mask %':>6} {'x shaped (rounds)':>17} "
            f"{'x no-gd':>7} {'mism':>4}")
    lines = [head, "-" * len(head)]
    n = report["prompts"]
    for r in report["runs"]:
        forced = f"{r['forced_accepted']}/{r['forced_proposed']}"
        gd = r["speedup_vs_no_grammar_drafts"]
        lines.append(
            f"{r['config']:<16} {r['batch_size']:>3} {r['seconds']:>7.1f} "
            f"{_spread(r['tokens_per_pass_median'], r['tokens_per_pass_of_repeats']):>17} "
            f"{r['valid']:>3}/{n:<3} {forced:>11} "
            f"{r['mask_us_per_token']:>11.1f} {100 * r['mask_share']:>6.2f} "
            f"{_spread(r['speedup_vs_shaped'], r['speedup_vs_shaped_rounds']):>17} "
            f"{'-' if gd is None else f'{gd:.2f}':>7} "
            f"{'-' if r['mismatches'] is None else r['mismatches']:>4}")
    return "\n".join(lines)


def _spread(figure: float, rounds: list[float]) -> str:
    """``1.76 (1.70-1.80)``: the figure and its rounds' range (the figure alone for one)."""
    if len(rounds) < 2:
        return f"{figure:.2f}"
    return f"{figure:.2f} ({min(rounds):.2f}-{max(rounds):.2f})"


LEGEND = """tok/pass: the median of the rounds' runs (rounds: their range); valid: outputs
that parse and validate against their schema; forced: forced tokens accepted/proposed; mask
us/tok: grammar mask seconds per generated token (us), mask %: of the run's wall time; x
shaped: speedup over constrained decoding without drafts, the median of the rounds' (a round
runs each config once, in turn); x no-gd: over the same drafter without grammar drafts,
medians' ratio; mism: greedy outputs that differ from shaped's."""


def run(args: argparse.Namespace) -> int:
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    report = bench(args)
    report["command"] = getattr(args, "command_line", None)
    write_json(out / f"bench-{NAME}.json", report)
    print(f"specq bench: {args.pair}, {NAME}: {report['prompts']} prompts, "
          f"{args.max_new_tokens} new tokens, {report['threads']} torch threads")
    print(table(report))
    print(LEGEND)
    print(profile_table(report["runs"], {"config": "config", "batch_size": "B"}))
    print(PROFILE_LEGEND)
    print(f"wrote {out / f'bench-{NAME}.json'}")
    mismatched = sum(r["mismatches"] or 0 for r in report["runs"])
    return 1 if mismatched else 0
