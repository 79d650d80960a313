"""`specq bench gpu` at its tiny size on the CPU (what CI runs, so that the GPU check never
rots), its verdict on a broken engine, its comparator, and the pair it builds."""

from __future__ import annotations

import json
import math

import pytest
import torch

from specq.api import cli
from specq.bench import gpu, gpu_device
from specq.bench.gpu_pair import SIZES, build_target, build_tokenizer, llama_config
from specq.bench.greedy import NearTieCheck
from specq.db.models import ItemStatus
from specq.schema.generation import Request
from specq.worker.engine import speculative
from specq.worker.engine.drafters import NoDraft
from specq.worker.engine.speculative import SpeculativeEngine

TINY = SIZES["tiny"]


def _finite(x) -> None:
    if isinstance(x, dict):
        for v in x.values():
            _finite(v)
    elif isinstance(x, list):
        for v in x:
            _finite(v)
    elif isinstance(x, float):
        assert math.isfinite(x)


def test_the_tiny_run_proves_and_measures(tmp_path, capsys):
    out = tmp_path / "out"
    assert cli.main(["bench", "gpu", "--device", "cpu", "--size", "tiny",
                     "--out", str(out)]) == 0
    report = json.loads((out / "gpu.json").read_text())
    text = (out / "gpu.md").read_text()
    assert text.strip() in capsys.readouterr().out
    _finite(report)

    assert report["config"]["size"] == "tiny" and report["environment"]["device"] == "cpu"
    assert report["lossless_passed"] is True
    assert [p["dtype"] for p in report["lossless"]] == ["float32", "bfloat16"]
    for part in report["lossless"]:
        runs = part["runs"]
        assert {(r["batch"], r["method"]) for r in runs} == {
            (b, m) for b in TINY.lossless_batches
            for m in ("none", "fixed", "adaptive", "suffix")}
        for r in runs:
            assert r["mismatches"] == 0 and not r["errors"]
            assert r["equal"] + r["near_ties"] == r["requests"] == TINY.lossless_prompts[
                r["batch"]]
            assert r["shaped"] >= 1  # grammar-constrained rows in every run
        fixed = [r for r in runs if r["method"] == "fixed"]
        assert all(0 < r["accepted"] <= r["proposed"] for r in fixed)  # the draft is used
        assert all(r["forced_proposed"] > 0 for r in fixed)  # and the grammar's drafts
        suffix = [r for r in runs if r["method"] == "suffix"]  # the drafter whose refills join
        assert all(0 < r["accepted"] <= r["proposed"] for r in suffix)

    rows = report["throughput"]
    assert {(r["batch"], r["method"]) for r in rows} == {
        (b, m) for b in TINY.throughput_batches
        for m in ("hf", "none", "fixed", "adaptive", "suffix")}
    for r in rows:
        assert r["tokens_per_s"] > 0 and r["new_tokens"] > 0
        assert r["peak_memory_mib"] is None and r["syncs_per_step"] is None  # CUDA only
        assert (r["verify_ms_per_step"] is None) == (r["method"] == "hf")
        if r["method"] == "none":
            assert r["tokens_per_pass"] == pytest.approx(1.0)
        if r["method"] == "fixed":
            assert r["tokens_per_pass"] > 1.0
    assert [p["batch"] for p in report["passes"]] == list(TINY.throughput_batches)
    assert all(p["specq_1_ms"] > 0 and p["hf_1_ms"] > 0 and p["verify_tokens"] == TINY.g + 1
               for p in report["passes"])
    paths = report["device_paths"]
    assert set(paths) == {"oom_halving", "device_lost", "memory_between_jobs"}
    assert all(p["skipped"] and "CUDA only, and this run is on cpu: " in p["detail"]
               for p in paths.values())

    assert "## Lossless: PASSED" in text
    assert "| float32 | 8 | fixed g=3 |" in text and "| bfloat16 | 1 | adaptive |" in text
    assert "## Throughput (float32)" in text and "| 4 | adaptive |" in text
    assert "| 4 | adaptive, suffix drafter |" in text
    assert "## A verify pass of 4 tokens per row against a plain pass" in text
    assert "- oom_halving: skipped: CUDA only, and this run is on cpu: " in text


def _accept_every_draft(draft_ids, num_draft, target_ids):
    """A broken acceptance: every proposed draft token stands, whatever the target says."""
    B, g = draft_ids.shape
    out = torch.cat([draft_ids, target_ids[:, -1:]], 1)
    rows = torch.arange(B, device=draft_ids.device)
    out[rows, num_draft] = target_ids[rows, num_draft]
    return out, num_draft


def test_a_broken_engine_fails_the_check(tmp_path, monkeypatch):
    monkeypatch.setattr(speculative, "accept_matching", _accept_every_draft)
    out = tmp_path / "out"
    assert cli.main(["bench-gpu", "--device", "cpu", "--size", "tiny", "--out", str(out),
                     "--parts", "lossless"]) == 1
    report = json.loads((out / "gpu.json").read_text())
    assert report["lossless_passed"] is False
    bad = [r for p in report["lossless"] for r in p["runs"] if r["mismatches"]]
    assert bad and {r["method"] for r in bad} <= {"fixed", "adaptive", "suffix"}
    assert all(r["mismatches"] == 0 for p in report["lossless"] for r in p["runs"]
               if r["method"] == "none")  # no drafts, nothing wrongly accepted
    text = (out / "gpu.md").read_text()
    assert "## Lossless: FAILED" in text and "MISMATCH" in text
    assert "throughput" not in report and "## Throughput" not in text


@pytest.fixture(scope="module")
def tiny():
    cfg = llama_config(TINY)
    return build_target(TINY, torch.device("cpu")), build_tokenizer(cfg.vocab_size,
                                                                    TINY.specials)


def test_the_comparator_tells_ties_from_mismatches(tiny):
    target, _ = tiny
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    with torch.inference_mode():
        logits = target(torch.tensor([prompts[1] + [12]])).logits[0, -1]
    a, b = logits.topk(2).indices.tolist()
    reference = {0: [20, 21, 22], 1: [12, a, 30]}
    outputs = {0: [20, 21, 22], 1: [12, b, 31]}
    strict = gpu.verdict(reference, outputs, NearTieCheck(target, prompts, 0.0))
    assert (strict["equal"], strict["near_ties"], strict["mismatches"]) == (1, 0, 1)
    (d,) = strict["divergences"]
    assert d["request"] == 1 and d["position"] == 1 and d["gap"] > 0 and not d["tie"]
    loose = gpu.verdict(reference, outputs, NearTieCheck(target, prompts, 10.0))
    assert (loose["near_ties"], loose["mismatches"]) == (1, 0)
    # a missing (failed) output, and one that stops early, are mismatches at any tolerance
    other = gpu.verdict(reference, {1: [12, a]}, NearTieCheck(target, prompts, 10.0))
    assert (other["equal"], other["mismatches"]) == (0, 2)


def test_the_built_tokenizer_has_the_models_vocabulary(tiny):
    target, tok = tiny
    cfg = target.config
    assert len(tok) == cfg.vocab_size
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (
        cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == tuple(
        cfg.vocab_size - TINY.specials + k for k in range(3))
    text = 'Hello world, {"a": [1, 2]}\n\u00e9t\u00e9 \U0001f600'
    ids = tok(text, add_special_tokens=False).input_ids
    assert tok.decode(ids) == text and len(ids) < len(text.encode())  # merges are used
    full = build_tokenizer(128256, 256)
    assert len(full) == 128256 and full.convert_ids_to_tokens(128000) == "<|begin_of_text|>"
    assert llama_config(SIZES["full"]).num_hidden_layers == 16


def test_a_finished_generation_hands_its_caches_back(tiny):
    """Memory is freed between jobs: once generate returns, no cache buffer is held."""
    target, tok = tiny
    engine = SpeculativeEngine(target, tok, NoDraft(), max_batch_size=2)
    results = engine.generate([Request(id=i, prompt_token_ids=[5 + i, 6, 7], max_new_tokens=4)
                               for i in range(3)])
    assert all(r.error is None and len(r.token_ids) == 4 for r in results)
    assert engine.kv.cache is None and engine.rows == []


def test_the_device_paths_plumbing_runs_on_a_cpu(tiny, capsys):
    """The CUDA-only paths cannot fail a CPU for real; what they drive can run here: the
    worker's generate_with_retries with the recording keeper, and the child's verdict when
    the bad token id is a plain IndexError (a CPU has no device to lose)."""
    target, tok = tiny
    engine = SpeculativeEngine(target, tok, NoDraft(), max_batch_size=2)
    reqs = [r for r in gpu.requests(6, 4) if r.response_format is None]
    keeper = gpu_device._generate(engine, gpu_device._items(reqs))
    assert [o.status for o in keeper.outcomes] == [ItemStatus.completed] * len(reqs)
    assert not keeper.ooms and not keeper.failures and not keeper.crashes

    got = gpu_device.lose_the_device("cpu")
    assert got == {"raised": None, "cause": "", "classified": False}
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == got


def test_the_size_defaults_to_the_real_model_on_cuda_only():
    from specq.bench.gpu import default_size

    assert default_size(torch.device("cuda")) == "full"
    assert default_size(torch.device("cpu")) == "tiny"
