"""`specq bench gpu`: the engine proved and measured on one device, in one call, from the
repository alone (nothing downloaded; the models are built from seeds: gpu_pair.py).

    specq bench gpu --device cuda --out bench-gpu       # the GPU machine, about 8 minutes
    specq bench gpu --device cpu --size tiny --out DIR  # CI: the same code, seconds

1. lossless: greedy speculative output (a fixed draft length and the adaptive policy with
   the draft model; adaptive with the suffix drafter, whose refills join the running pass)
   equals target-only greedy output for a mix of prompts (four workloads, and one in four rows
   under a JSON schema) at each lossless batch size, in float32 and bfloat16. Free rows are
   compared with transformers' own `generate`; shaped rows with the engine's constrained
   decoding without drafts (transformers has none). A divergence is a near-tie when the
   target's logits for the two tokens are within the dtype's tolerance of each other
   (counted and shown, as on CPU); anything else is a failure, and the command exits 1.
2. throughput: for each batch size, transformers' `generate`, the engine without
   speculation, with a fixed g and adaptive (draft model), adaptive with the suffix drafter:
   tokens/s, tokens per target pass, peak memory, and (CUDA) host syncs per step.
3. pass costs: a target pass verifying g + 1 tokens per row against a plain pass (one
   token), in the engine's cache and in transformers' DynamicCache.
4. the worker's device paths (CUDA only; gpu_device.py): an out-of-memory error on an
   oversized batch handled by halving, a lost device classified as such, memory handed back
   between jobs.

Writes gpu.json and gpu.md under --out and prints the Markdown.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import cast

import torch
from transformers import DynamicCache, PreTrainedModel

from specq.api.argtypes import positive_int
from specq.bench import environment, grammar_bench
from specq.bench.gpu_device import device_paths, peak_memory, reset_peak, syncs_per_step
from specq.bench.gpu_pair import (
    SIZES,
    Size,
    build_draft,
    build_target,
    build_tokenizer,
    llama_config,
    to_dtype,
)
from specq.bench.greedy import NearTieCheck
from specq.bench.report import write_json
from specq.bench.runner import Target, _hf_generate, run_hf, run_specq
from specq.bench.workloads import WORKLOADS
from specq.schema.generation import Request
from specq.worker.engine.batch import KVRows
from specq.worker.engine.drafters import Drafter, DraftModel, NoDraft
from specq.worker.engine.grammar import Grammars
from specq.worker.engine.speculative import SpeculativeEngine, encode_prompt
from specq.worker.engine.suffix import SuffixDrafter
from specq.worker.pairs import Pair

log = logging.getLogger(__name__)

# relative gap between two tokens' logits (to the largest logit) that the dtype's rounding
# may flip: float32's from bench/greedy.py; bfloat16 keeps 8 bits of mantissa and a
# pass sums thousands of rounded products, so a few of its last bits
NEAR_TIE = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 4e-3}
PARTS = {"lossless": "lossless", "throughput": "throughput", "passes": "passes",
         "device": "device_paths"}  # --parts names -> the report's keys
SHAPED_EVERY = 4  # one row in four carries a JSON schema
PASS_ROUNDS = 5
SUFFIX = "suffix"  # _engine's drafter: the suffix drafter (no model; refills join a pass)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--size", choices=sorted(SIZES), default=None,
                   help="full: Llama-3.2-1B's shape (the GPU check; the default on CUDA); "
                        "medium, tiny: CPU sizes (tiny: the default on a CPU, seconds)")
    p.add_argument("--out", type=Path, default=Path("bench-gpu"), help="output folder")
    p.add_argument("--threads", type=positive_int, default=None,
                   help="torch CPU threads (default on a CPU: 1, steady on a shared machine)")
    p.add_argument("--parts", default=",".join(PARTS),
                   help="comma-separated parts to run (default all)")


# -- requests --------------------------------------------------------------------------


def requests(n: int, max_new: int) -> list[Request]:
    """n requests: the workloads' prompts interleaved, every SHAPED_EVERY-th one a JSON
    extraction under its schema (grammar_bench's prompts)."""
    free = [c for convs in zip(*(w() for w in WORKLOADS.values())) for c in convs]
    shaped = grammar_bench.prompts()
    out = []
    for i in range(n):
        if i % SHAPED_EVERY == SHAPED_EVERY - 1:
            msgs, schema = shaped[(i // SHAPED_EVERY) % len(shaped)]
            fmt = {"type": "json_schema",
                   "json_schema": {"name": "answer", "schema": schema, "strict": True}}
            out.append(Request(id=i, messages=msgs, max_new_tokens=max_new,
                               response_format=fmt))
        else:
            out.append(Request(id=i, messages=free[i % len(free)], max_new_tokens=max_new))
    return out


# -- lossless --------------------------------------------------------------------------


def divergence(i: int, want: list[int], got: list[int], near_tie: NearTieCheck) -> dict | None:
    """None when equal; else where ``got`` leaves ``want`` and whether it is a near-tie."""
    if want == got:
        return None
    j = next((k for k, (a, b) in enumerate(zip(want, got)) if a != b), None)
    if j is None:  # one stopped earlier at the same tokens: only a stop decision differs
        return {"request": i, "position": min(len(want), len(got)), "gap": None, "tie": False}
    gap = near_tie.gap(i, want[:j], want[j], got[j])
    return {"request": i, "position": j, "gap": gap, "tie": gap <= near_tie.tolerance}


def verdict(reference: dict[int, list[int]], outputs: dict[int, list[int]],
            near_tie: NearTieCheck) -> dict:
    """{equal, near_ties, mismatches, divergences} of outputs against the reference, request
    by request (a request missing from outputs, or failed, is a mismatch)."""
    divs: list[dict] = []
    for i, want in reference.items():
        got = outputs.get(i)
        d = (divergence(i, want, got, near_tie) if got is not None
             else {"request": i, "position": 0, "gap": None, "tie": False})
        if d:
            divs.append(d)
    ties = sum(d["tie"] for d in divs)
    return {"equal": len(reference) - len(divs), "near_ties": ties,
            "mismatches": len(divs) - ties, "divergences": divs}


def _engine(target: PreTrainedModel, tokenizer, draft: PreTrainedModel | str | None,
            batch: int, size: Size, adaptive: bool) -> SpeculativeEngine:
    """An engine with no drafter (None), the draft model, or ``SUFFIX``'s drafter."""
    drafter: Drafter
    if draft is None:
        drafter = NoDraft()
    elif draft == SUFFIX:
        drafter = SuffixDrafter()
    else:
        assert not isinstance(draft, str), draft
        drafter = DraftModel(draft, pad_id=tokenizer.pad_token_id,
                             vocab_size=target.config.vocab_size)
    eng = SpeculativeEngine(target, tokenizer, drafter, max_batch_size=batch,
                            draft_length=size.g, adaptive=adaptive, max_draft_length=size.max_g)
    # the grammar library reads a tokenizer once per engine (a worker makes one engine),
    # 5 s at 128k tokens: every engine here shares the first one's reading and compilations
    _, first = _GRAMMARS.setdefault(id(tokenizer), (tokenizer, eng.grammars))
    if first is not eng.grammars:
        first.library_tokenizer()
        mine = eng.grammars
        mine._lltok, mine._executor, mine._templates = (first._lltok, first._executor,
                                                        first._templates)
    return eng


_GRAMMARS: dict[int, tuple[object, Grammars]] = {}  # id(tokenizer) -> (it, first Grammars)


def lossless(target: PreTrainedModel, tokenizer, size: Size) -> dict:
    """Every lossless batch size x {none, fixed g, adaptive, suffix} against the references,
    in the target's current dtype."""
    draft = build_draft(target, size)
    reqs = requests(max(size.lossless_prompts.values()), size.lossless_new)
    probe = _engine(target, tokenizer, None, 1, size, False)
    prompts = [encode_prompt(tokenizer, r, probe.context) for r in reqs]
    near_tie = NearTieCheck(target, prompts, NEAR_TIE[target.dtype])
    t = Target(target, tokenizer, probe.eos_ids, probe.pad_id)
    free = [i for i, r in enumerate(reqs) if r.response_format is None]
    top = max(size.lossless_batches)
    reference: dict[int, list[int]] = {}
    for k in range(0, len(free), top):  # transformers' own greedy decoding, batched
        part = free[k : k + top]
        outs = _hf_generate(t, [prompts[i] for i in part], size.lossless_new)
        reference.update(zip(part, outs))
    # constrained greedy decoding without drafts, all rows at once: the shaped reference
    shaped_ref = _engine(target, tokenizer, None, top, size, False).generate(reqs)
    reference.update({i: shaped_ref[i].token_ids for i in range(len(reqs)) if i not in free})
    runs = []
    for B in size.lossless_batches:
        mine = reqs[: size.lossless_prompts[B]]
        for method, d, adaptive in (("none", None, False), ("fixed", draft, False),
                                    ("adaptive", draft, True), ("suffix", SUFFIX, True)):
            eng = _engine(target, tokenizer, d, B, size, adaptive)
            results = eng.generate(mine)
            outputs = {r_i: res.token_ids for r_i, res in enumerate(results)
                       if res.error is None}
            check = verdict({i: reference[i] for i in range(len(mine))}, outputs, near_tie)
            c = [res.counters for res in results]
            runs.append({
                "batch": B, "method": method, "g": size.g if method == "fixed" else None,
                "requests": len(mine), "shaped": sum(r.response_format is not None for r in mine),
                "errors": [res.error for res in results if res.error],
                "proposed": sum(x.proposed for x in c), "accepted": sum(x.accepted for x in c),
                "forced_proposed": sum(x.forced_proposed for x in c),
                "tokens_per_pass": sum(x.new_tokens for x in c) / max(
                    1, sum(x.target_passes for x in c)),
                **check})
            log.info("lossless %s B=%d %s: %d equal, %d near-ties, %d mismatches",
                     target.dtype, B, method, check["equal"], check["near_ties"],
                     check["mismatches"])
    return {"dtype": str(target.dtype).removeprefix("torch."),
            "tolerance": near_tie.tolerance, "runs": runs,
            "passed": all(r["mismatches"] == 0 for r in runs)}


# -- throughput ------------------------------------------------------------------------


def throughput(target: PreTrainedModel, tokenizer, size: Size) -> list[dict]:
    """tokens/s, tokens per pass, peak memory, syncs per step at each throughput batch."""
    draft = build_draft(target, size)
    probe = _engine(target, tokenizer, None, 1, size, False)
    t = Target(target, tokenizer, probe.eos_ids, probe.pad_id)
    free = [r for r in requests(max(size.throughput_prompts.values()) * SHAPED_EVERY,
                                size.throughput_new) if r.response_format is None]
    prompts = [encode_prompt(tokenizer, r, probe.context) for r in free]
    make = partial(DraftModel, draft, pad_id=probe.pad_id, vocab_size=target.config.vocab_size)
    rows = []
    for B in size.throughput_batches:
        mine = prompts[: size.throughput_prompts[B]]
        configs = [("hf", None, partial(run_hf, t, mine, B, size.throughput_new)),
                   ("none", 0, partial(run_specq, t, mine, B, size.throughput_new)),
                   ("fixed", size.g, partial(run_specq, t, mine, B, size.throughput_new,
                                             make_drafter=make, g=size.g, max_g=size.max_g)),
                   ("adaptive", None, partial(run_specq, t, mine, B, size.throughput_new,
                                              make_drafter=make, g=None, max_g=size.max_g)),
                   ("suffix", None, partial(run_specq, t, mine, B, size.throughput_new,
                                            make_drafter=SuffixDrafter, g=None,
                                            max_g=size.max_g))]
        for method, g, go in configs:
            reset_peak(target.device)
            run = go()
            passes = sum(r.counters.target_passes for r in run.results or []) or None
            peak = peak_memory(target.device)
            syncs = None
            if method != "hf" and target.device.type == "cuda":  # a run of its own, counted
                eng = _engine(target, tokenizer, {"none": None, "suffix": SUFFIX}.get(
                    method, draft), B, size, method in ("adaptive", "suffix"))
                syncs = syncs_per_step(eng, [Request(id=i, prompt_token_ids=p,
                                                     max_new_tokens=16)
                                             for i, p in enumerate(mine)])
            rows.append({
                "batch": B, "method": method, "g": g, "prompts": len(mine),
                "new_tokens": run.new_tokens, "seconds": run.seconds,
                "tokens_per_s": run.new_tokens / run.seconds,
                "tokens_per_pass": run.new_tokens / passes if passes else None,
                "steps": len(run.steps) or None, "syncs_per_step": syncs,
                # the device's own time per step (CUDA events on a GPU: StepClock)
                "verify_ms_per_step": _mean_ms([x.t_verify for x in run.steps]),
                "draft_ms_per_step": _mean_ms([x.t_draft for x in run.steps]),
                "peak_memory_mib": peak})
            log.info("throughput B=%d %s: %.1f tok/s", B, method, rows[-1]["tokens_per_s"])
    return rows


def _mean_ms(seconds: list[float]) -> float | None:
    return 1e3 * statistics.fmean(seconds) if seconds else None


# -- pass costs ------------------------------------------------------------------------


def _timed(fn, device: torch.device, rounds: int) -> float:
    """Median seconds of fn() over rounds, after one untimed call."""
    times = []
    for r in range(rounds + 1):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        if r:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def pass_costs(target: PreTrainedModel, size: Size) -> list[dict]:
    """At each throughput batch, over pass_context columns: a pass of 1 and of g + 1 tokens
    per row, all logits kept, in the engine's cache (KVRows) and transformers'
    DynamicCache; each pass's columns are taken back out after it."""
    dev, L, W = target.device, size.pass_context, size.g + 1
    gen = torch.Generator().manual_seed(L)
    vocab = target.config.vocab_size
    prompt = torch.randint(0, vocab - 1024 if vocab > 2048 else vocab // 2, (1, L),
                           generator=gen).to(dev)
    one = KVRows(target)
    one.forward(prompt, torch.ones_like(prompt, dtype=torch.bool), last_only=True)
    layers = one.columns(0, 0, L)
    rows = []
    for B in size.throughput_batches:
        kv = KVRows.from_prefix(target, layers, [L] * B)
        hf = DynamicCache(config=target.config)
        for i, (k, v) in enumerate(layers):
            hf.update(k.expand(B, -1, -1, -1).contiguous(), v.expand(B, -1, -1, -1).contiguous(),
                      i)
        row: dict = {"batch": B, "context": L, "verify_tokens": W}
        for T in (1, W):
            ids = torch.randint(0, vocab // 2, (B, T), generator=gen).to(dev)

            def specq_pass(ids: torch.Tensor = ids, kv: KVRows = kv) -> None:
                kv.forward(ids, torch.ones_like(ids, dtype=torch.bool))
                kv.keep(L, torch.zeros(ids.shape[0], dtype=torch.long, device=dev))
                kv.compact(force=True)

            def hf_pass(ids: torch.Tensor = ids, cache: DynamicCache = hf) -> None:
                B, T = ids.shape
                pos = torch.arange(L, L + T, device=dev)[None].expand(B, T)
                mask = torch.ones(B, L + T, dtype=torch.long, device=dev)
                target(input_ids=ids, attention_mask=mask, position_ids=pos,
                       cache=cache, use_cache=True)
                cache.crop(-T)

            row[f"specq_{T}_ms"] = 1e3 * _timed(specq_pass, dev, PASS_ROUNDS)
            row[f"hf_{T}_ms"] = 1e3 * _timed(hf_pass, dev, PASS_ROUNDS)
        row["specq_ratio"] = row[f"specq_{W}_ms"] / row["specq_1_ms"]
        row["hf_ratio"] = row[f"hf_{W}_ms"] / row["hf_1_ms"]
        rows.append(row)
    return rows


# -- report ----------------------------------------------------------------------------


def markdown(report: dict) -> str:
    env, cfg = report["environment"], report["config"]
    out = [f"# specq bench gpu: {cfg['size']} ({cfg['parameters'] / 1e6:.2f} M parameters), "
           f"{env['device']} {env['gpu'] or ''}".rstrip(),
           "",
           f"{env['time']}, torch {env['torch']}, transformers {env['transformers']}; "
           f"draft: the target's first {cfg['draft_layers']} of {cfg['layers']} layers; "
           f"{report['seconds']:.0f} s in all.", ""]
    if "lossless" in report:
        ok = report["lossless_passed"]
        out += [f"## Lossless: {'PASSED' if ok else 'FAILED'}", "",
                "| dtype | batch | method | requests (shaped) | equal | near-ties | "
                "mismatches | tokens/pass | accepted/proposed |",
                "|---|---:|---|---:|---:|---:|---:|---:|---:|"]
        for part in report["lossless"]:
            for r in part["runs"]:
                out.append(f"| {part['dtype']} | {r['batch']} | {_method(r)} | "
                           f"{r['requests']} ({r['shaped']}) | {r['equal']} | "
                           f"{r['near_ties']} | {r['mismatches']} | "
                           f"{r['tokens_per_pass']:.2f} | {r['accepted']}/{r['proposed']} |")
        ties = [(p["dtype"], d) for p in report["lossless"] for r in p["runs"]
                for d in r["divergences"]]
        if ties:
            out += ["", "Divergences (gap: the two tokens' logit gap over the largest logit; "
                    "a near-tie is within the dtype's tolerance):", ""]
            out += [f"- {dt} request {d['request']} at token {d['position']}: gap "
                    f"{'n/a' if d['gap'] is None else format(d['gap'], '.2e')}, "
                    f"{'near-tie' if d['tie'] else 'MISMATCH'}" for dt, d in ties[:40]]
        out.append("")
    if "throughput" in report:
        out += [f"## Throughput ({report['throughput_dtype']})", "",
                "| batch | method | tokens/s | x none | tokens/pass | draft ms/step | "
                "verify ms/step | syncs/step | peak MiB |",
                "|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
        none = {r["batch"]: r for r in report["throughput"] if r["method"] == "none"}
        for r in report["throughput"]:
            base = none[r["batch"]]
            out.append(f"| {r['batch']} | {_method(r)} | {r['tokens_per_s']:.1f} | "
                       f"{r['tokens_per_s'] / base['tokens_per_s']:.2f} | "
                       f"{_num(r['tokens_per_pass'])} | {_num(r['draft_ms_per_step'])} | "
                       f"{_num(r['verify_ms_per_step'])} | {_num(r['syncs_per_step'])} | "
                       f"{_num(r['peak_memory_mib'], '.0f')} |")
        out.append("")
    if "passes" in report:
        W = report["passes"][0]["verify_tokens"] if report["passes"] else 0
        out += [f"## A verify pass of {W} tokens per row against a plain pass", "",
                f"| batch | context | specq 1 ms | specq {W} ms | ratio | transformers 1 ms | "
                f"transformers {W} ms | ratio |", "|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in report["passes"]:
            out.append(f"| {r['batch']} | {r['context']} | {r['specq_1_ms']:.2f} | "
                       f"{r[f'specq_{W}_ms']:.2f} | {r['specq_ratio']:.2f} | "
                       f"{r['hf_1_ms']:.2f} | {r[f'hf_{W}_ms']:.2f} | {r['hf_ratio']:.2f} |")
        out.append("")
    for name, error in report.get("errors", {}).items():
        out += [f"## {name}: ERROR", "", f"    {error}", ""]
    if "device_paths" in report:
        out += ["## Device paths", ""]
        for name, r in report["device_paths"].items():
            state = "skipped" if r.get("skipped") else "passed" if r["passed"] else "FAILED"
            out.append(f"- {name}: {state}: {r['detail']}")
        out.append("")
    return "\n".join(out)


def _method(r: dict) -> str:
    return {"fixed": f"fixed g={r['g']}", "suffix": "adaptive, suffix drafter"}.get(
        r["method"], r["method"])


def _num(x: float | None, fmt: str = ".2f") -> str:
    return "-" if x is None else format(x, fmt)


def default_size(device: torch.device) -> str:
    """The size a run on this device takes unless told: the real model's on CUDA; on a
    CPU, where it would take the better part of an hour, the tiny one CI runs."""
    return "full" if device.type == "cuda" else "tiny"


def bench(args: argparse.Namespace, save: Callable[[dict], None] = lambda r: None) -> dict:
    t0 = time.perf_counter()
    dev = torch.device(args.device)
    if args.size is None:
        args.size = default_size(dev)
        log.info("--size %s (the default on %s)", args.size, dev.type)
    size = SIZES[args.size]
    if args.threads or dev.type == "cpu":
        torch.set_num_threads(args.threads or 1)
    parts = {PARTS.get(p.strip(), p.strip()) for p in args.parts.split(",") if p.strip()}
    cfg = llama_config(size)
    tokenizer = build_tokenizer(cfg.vocab_size, size.specials)
    target = build_target(size, dev)
    report: dict = {"config": {
        "size": size.name, "layers": cfg.num_hidden_layers, "hidden": cfg.hidden_size,
        "vocab": cfg.vocab_size, "parameters": sum(p.numel() for p in target.parameters()),
        "draft_layers": size.draft_layers, "late_scale": size.late_scale,
        **{k: v for k, v in dataclasses.asdict(size).items() if k not in ("config", "extra")},
        "command": " ".join(sys.argv)}}
    report["seconds"], report["part_seconds"], report["errors"] = 0.0, {}, {}
    report["environment"] = environment(cast(Pair, _Built(target)))

    def part(name: str, go: Callable[[], object]) -> None:
        """Run one part; an exception is recorded (and the next part runs), and the report
        is saved after each, so that a run cut short keeps what it measured."""
        if name not in parts:
            return
        t = time.perf_counter()
        try:
            report[name] = go()
        except Exception as exc:  # noqa: BLE001 (reported, and the exit status says so)
            log.exception("part %s failed", name)
            report["errors"][name] = f"{type(exc).__name__}: {exc}"[:2000]
        report["part_seconds"][name] = time.perf_counter() - t
        if name == "lossless" and name in report:  # none proved (an error): not passed
            report["lossless_passed"] = bool(report["lossless"]) and all(
                p["passed"] for p in report["lossless"])
        report["seconds"] = time.perf_counter() - t0
        log.warning("%s: %.0f s", name, report["part_seconds"][name])
        save(report)

    def proofs() -> list[dict]:
        out = report.setdefault("lossless", [])  # saved after each dtype: a run cut short
        for name in size.dtypes:  # float32 first: converted in place after
            to_dtype(target, getattr(torch, name))
            out.append(lossless(target, tokenizer, size))
            report["lossless_passed"] = all(p["passed"] for p in out)
            save(report)
        return out

    part("lossless", proofs)
    # throughput as users run it: bfloat16 on a GPU; float32 on a CPU (no bf16 kernels pay)
    to_dtype(target, torch.bfloat16 if dev.type == "cuda" else torch.float32)
    report["throughput_dtype"] = str(target.dtype).removeprefix("torch.")
    report["environment"] = environment(cast(Pair, _Built(target)))
    part("throughput", lambda: throughput(target, tokenizer, size))
    part("passes", lambda: pass_costs(target, size))
    part("device_paths", lambda: device_paths(target, tokenizer, size, requests))
    return report


@dataclasses.dataclass
class _Built:
    """What bench.environment reads of a Pair: the target."""

    target: PreTrainedModel


def run(args: argparse.Namespace) -> int:
    """Run, write gpu.json and gpu.md under --out (after each part too), print the Markdown.
    1 when a lossless check failed or a part raised, else 0."""
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def save(report: dict) -> None:
        write_json(out / "gpu.json", report)
        (out / "gpu.md").write_text(markdown(report) + "\n")

    report = bench(args, save)
    save(report)
    print(markdown(report))
    print(f"wrote {out / 'gpu.json'} and {out / 'gpu.md'}")
    return 0 if report.get("lossless_passed", True) and not report["errors"] else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="specq bench gpu", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
