"""The grammar mask's cost per token: llguidance (specq's) against xgrammar, when installed.

`python -m specq.bench.mask_cost [--pair smollm2-135m]`: for each schema of the json-schema
workload (grammar_bench.py), a valid answer in specq's JSON layout is tokenized with the
pair's tokenizer and walked token by token; at each position each library computes the
next-token bitmask (one thread, on the host) and then consumes the token. After a warm-up
round, prints the median, mean and 95th percentile microseconds per mask and the compile
cost per schema (xgrammar's cache off: each job compiles its schema once).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from specq.bench import grammar_bench
from specq.configs.presets import get_preset, locate
from specq.configs.settings import Settings
from specq.schema.grammar import JSON_LAYOUT

ANSWERS = [
    {"name": "Maria Lopez", "age": 34, "city": "Madrid", "job": "nurse"},
    {"product": "blender", "rating": 4, "sentiment": "mixed",
     "summary": "Loud but crushes ice in seconds."},
    {"question": "Which planet is largest?", "options": ["Mars", "Venus", "Jupiter", "Earth"],
     "answer": "C"},
    {"title": "Double charge", "priority": "high", "category": "billing",
     "summary": "Charged twice this month, wants a refund."},
]
SCHEMAS = [grammar_bench._PERSON, grammar_bench._REVIEW, grammar_bench._QUIZ,
           grammar_bench._TICKET]


_MADE: dict[str, Any] = {}  # each library's tokenizer, made once per process


def _llguidance(tok, schema: dict, ids: list[int]) -> tuple[float, list[float]]:
    import llguidance
    import llguidance.hf
    import llguidance.torch as llt

    lltok = _MADE.get("lltok") or llguidance.hf.from_tokenizer(tok)
    _MADE["lltok"] = lltok
    t0 = time.perf_counter()
    m = llguidance.LLMatcher(lltok, llguidance.LLMatcher.grammar_from_json_schema(
        schema, defaults=JSON_LAYOUT), log_level=0)
    compile_s = time.perf_counter() - t0
    bitmask = llt.allocate_token_bitmask(1, lltok.vocab_size)
    times = []
    for t in ids:
        t0 = time.perf_counter()
        llt.fill_next_token_bitmask(m, bitmask)
        times.append(time.perf_counter() - t0)
        assert m.consume_token(t), m.get_error()
    return compile_s, times


def _xgrammar(tok, schema: dict, ids: list[int]) -> tuple[float, list[float]]:
    import xgrammar as xgr

    info = _MADE.get("info") or xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok))
    _MADE["info"] = info
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    t0 = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False,
                                            separators=(", ", ": "))
    compile_s = time.perf_counter() - t0
    m = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, info.vocab_size)
    times = []
    for t in ids:
        t0 = time.perf_counter()
        m.fill_next_token_bitmask(bitmask)
        times.append(time.perf_counter() - t0)
        assert m.accept_token(t)
    return compile_s, times


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m specq.bench.mask_cost", description=__doc__)
    p.add_argument("--pair", default="smollm2-135m")
    p.add_argument("--rounds", type=int, default=5, help="walks of every answer per library")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    from transformers import AutoTokenizer

    settings = Settings()
    where, kwargs = locate(get_preset(args.pair, settings.presets_file).target,
                           Path(settings.data_dir))
    tok = AutoTokenizer.from_pretrained(where, **kwargs)
    walks = [(s, tok(json.dumps(a), add_special_tokens=False).input_ids)
             for s, a in zip(SCHEMAS, ANSWERS)]
    libraries = {"llguidance": _llguidance, "xgrammar": _xgrammar}
    print(f"pair {args.pair}: vocabulary {len(tok)}, {sum(len(i) for _, i in walks)} tokens "
          f"per round, {args.rounds} rounds")
    for name, walk in libraries.items():
        try:
            for s, ids in walks:  # a warm-up round: the libraries set up lazily
                walk(tok, s, ids)
            runs = [walk(tok, s, ids) for _ in range(args.rounds) for s, ids in walks]
        except ImportError as exc:
            print(f"{name:<11} not installed ({exc})")
            continue
        times = sorted(t for _, ts in runs for t in ts)
        p95 = times[int(0.95 * (len(times) - 1))]
        compile_ms = 1e3 * statistics.mean(c for c, _ in runs)
        print(f"{name:<11} mask {1e6 * statistics.median(times):7.1f} us median, "
              f"{1e6 * statistics.mean(times):7.1f} us mean, {1e6 * p95:7.1f} us p95; "
              f"compile {compile_ms:.1f} ms per schema")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
