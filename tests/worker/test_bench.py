"""`specq bench` on the tiny pair (never a speed asserted), its arithmetic, the shallow draft."""

from __future__ import annotations

import argparse
import json
import math

import pytest
import torch

from specq.bench import add_arguments, batch_variance_note, run
from specq.bench.drafts import DraftBuildError, shallow_draft, skip_draft
from specq.bench.figures import alpha_mle, figures, predicted, t_verify_at
from specq.bench.greedy import NearTieCheck, compare
from specq.bench.prompts import PromptFileError, load_prompts
from specq.bench.runner import ADAPTIVE, FIXED, NONE, Run, Step
from specq.bench.workloads import WORKLOADS, workload_names
from specq.schema.counters import Counters
from specq.schema.generation import Request
from specq.worker.engine.drafters import DraftModel
from specq.worker.engine.result import Result
from specq.worker.engine.speculative import SpeculativeEngine


def _args(tmp_path, *extra: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args([
        "--prompts", "4", "--max-new-tokens", "8", "--batch-sizes", "1,2",
        "--draft-lengths", "1,2", "--device", "cpu", "--dtype", "float32",
        "--data-dir", str(tmp_path / "data"), "--output-dir", str(tmp_path / "out"), *extra,
    ])


def _finite(x) -> None:
    if isinstance(x, dict):
        for v in x.values():
            _finite(v)
    elif isinstance(x, list):
        for v in x:
            _finite(v)
    elif isinstance(x, float):
        assert math.isfinite(x)


@pytest.mark.parametrize("pair,drafts,repeat", [("tiny", "preset,shallow:2", 1),
                                                ("tiny-lookup", "preset", 2)])
def test_bench_runs_end_to_end(tmp_path, capsys, pair, drafts, repeat):
    assert run(_args(tmp_path, "--pair", pair, "--draft", drafts, "--repeat", str(repeat))) == 0
    report = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert (tmp_path / "out" / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "specq-adaptive" in capsys.readouterr().out

    assert {"environment", "config", "reference", "runs"} <= report.keys()
    assert {"torch", "device", "dtype", "cpu_count"} <= report["environment"].keys()
    _finite(report)
    runs = report["runs"]
    n_drafts = len(report["config"]["drafts"])
    assert n_drafts == len(drafts.split(","))
    seen = {(r["method"], r["draft"], r["batch_size"], r["g"]) for r in runs}
    for B in (1, 2):
        assert ("hf", None, B, None) in seen and ("specq-none", None, B, 0) in seen
        for d in report["config"]["drafts"]:
            assert {("specq-fixed", d, B, 1), ("specq-fixed", d, B, 2),
                    ("specq-adaptive", d, B, None)} <= seen
    assert sum(r["method"] == "hf-assisted" for r in runs) == n_drafts
    for r in runs:
        assert len(r["seconds_of_repeats"]) == repeat
        assert r["seconds"] == sorted(r["seconds_of_repeats"])[repeat // 2]  # the median run
        assert r["new_tokens"] > 0 and r["tokens_per_s"] > 0
        assert r["speedup_vs_hf"] is not None and r["speedup_vs_none"] is not None
        rounds = r["speedup_vs_none_by_round"]
        if r["method"] == "hf-assisted":  # rounds of their own, no baseline in them
            assert rounds is None
        else:  # each round's run against that round's no-speculation run
            none = next(n for n in runs if n["method"] == NONE
                        and n["batch_size"] == r["batch_size"])
            assert rounds == pytest.approx([n / s for s, n in zip(r["seconds_of_repeats"],
                                                                  none["seconds_of_repeats"])])
        if not r["reference"]:  # greedy: every method gives the target's own tokens
            assert r["greedy"]["mismatches"] == 0, r
        if r["method"] == FIXED:
            assert 0 <= r["acceptance_rate"] <= 1 and r["mean_acceptance_length"] >= 1
            assert r["c"] > 0 and r["predicted_theorem"] > 0 and r["efficiency"] > 0
            assert r["steps"] == r["g_counts"][str(r["g"])]
    assert report["greedy_mismatched_runs"] == 0
    for r in runs:  # adaptive against the fixed g of the fastest median, round by round
        if r["method"] != ADAPTIVE:
            assert "speedup_vs_best_fixed" not in r
            continue
        fixed = [f for f in runs if f["method"] == FIXED and f["draft"] == r["draft"]
                 and f["batch_size"] == r["batch_size"]]
        best = max(fixed, key=lambda f: f["tokens_per_s"])
        assert r["best_fixed_g"] == best["g"]
        assert r["speedup_vs_best_fixed"] == pytest.approx(r["tokens_per_s"]
                                                           / best["tokens_per_s"])
        assert r["speedup_vs_best_fixed_by_round"] == pytest.approx(
            [b / s for s, b in zip(r["seconds_of_repeats"], best["seconds_of_repeats"])])


def test_bench_workloads_table(tmp_path, capsys):
    args = _args(tmp_path, "--pair", "tiny-suffix", "--draft", "preset,lookup", "--workload",
                 "json,chat", "--methods", "none,fixed,adaptive", "--batch-sizes", "1,3",
                 "--prompts", "6")
    assert run(args) == 0
    out = capsys.readouterr().out
    table = out[out.index("workload "):]
    for name in ("json", "chat"):
        report = json.loads((tmp_path / "out" / f"bench-{name}.json").read_text())
        assert report["config"]["workload"] == name and report["config"]["prompts"] == 6
        assert report["config"]["distinct_prompts"] == 6
        assert f"{name}: 6 prompts, " in out  # none repeated: the header says nothing more
        assert report["greedy_mismatched_runs"] == 0
        assert (tmp_path / "out" / f"bench-{name}.png").exists()
        runs = [r for r in report["runs"] if r["method"] != NONE]
        assert {r["draft"] for r in runs} == {"preset:suffix", "lookup"}
        for r in runs:  # (None: an adaptive run that never drafted)
            assert r["tokens_per_step"] >= 1
            # a ratio of two timings, with no bound above: beside a tiny target's pass the
            # suffix drafter's Python can take as long as the pass (a fresh clone: 1.01)
            assert r["propose_share"] is None or 0 <= r["propose_share"] < float("inf")
            assert r["propose_share"] is not None or r["method"] != FIXED
        for r in runs:  # adaptive beside the fixed g it is weighed against
            if r["method"] != FIXED:
                assert f"{r['speedup_vs_best_fixed']:.2f} g={r['best_fixed_g']}" in table
        for r in report["runs"]:
            cells = f"{name}  {r['draft'] or '-'}  {r['method']}"
            assert any(" ".join(cells.split()) in " ".join(line.split())
                       for line in table.splitlines())


def test_a_bench_of_repeated_prompts_says_how_many_are_distinct(tmp_path, capsys, caplog):
    """More prompts than a workload has: the prompts cycle, and a drafter that reads the
    job's outputs copies a repeat's whole output; the header and the JSON say so."""
    from specq.bench import WORKLOADS

    n = len(WORKLOADS["chat"]()) + 2
    args = _args(tmp_path, "--pair", "tiny-suffix", "--draft", "preset", "--workload",
                 "chat", "--methods", "none", "--batch-sizes", "4", "--prompts", str(n),
                 "--max-new-tokens", "2")
    assert run(args) == 0
    config = json.loads((tmp_path / "out" / "bench-chat.json").read_text())["config"]
    assert (config["prompts"], config["distinct_prompts"]) == (n, n - 2)
    assert f"chat: {n} prompts ({n - 2} distinct: repeats are copied)" in capsys.readouterr().out
    assert "of them distinct" in caplog.text


def test_workloads_are_distinct_prompt_sets():
    assert workload_names("all") == list(WORKLOADS)
    assert workload_names("json, chat") == ["json", "chat"]
    with pytest.raises(ValueError, match="nope"):
        workload_names("json,nope")
    seen = set()
    for name, make in WORKLOADS.items():
        texts = [conv[-1].content for conv in make()]
        assert len(texts) >= 24 and len(set(texts)) == len(texts), name
        assert not seen & set(texts)
        seen |= set(texts)


def test_predicted_speedups_by_hand():
    # alpha 0.5, g 2: E = 1 + .5 + .25 = 1.75; c = 0.01 / 0.04 = 0.25
    thm, meas = predicted(0.5, 1.0, {2: 10}, t_draft=0.01, t_step=0.04, t_verify={3: 0.06})
    assert thm == pytest.approx(1.75 / 1.5)  # (1 - a^3) / ((1 - a)(2c + 1))
    assert meas == pytest.approx(1.75 * 0.04 / (2 * 0.01 + 0.06))  # 0.875
    # half the rows propose: E = 1 + 0.5 * 0.75
    _, meas = predicted(0.5, 0.5, {2: 10}, t_draft=0.01, t_step=0.04, t_verify={3: 0.06})
    assert meas == pytest.approx(1.375 * 0.04 / 0.08)
    # a mix of g = 0 and g = 2 steps (adaptive), two of each
    thm, meas = predicted(0.5, 1.0, {0: 2, 2: 2}, t_draft=0.01, t_step=0.04,
                          t_verify={1: 0.04, 3: 0.06})
    assert thm == pytest.approx((2 * 1 + 2 * 1.75) / (2 * 1 + 2 * 1.5))
    assert meas == pytest.approx(5.5 * 0.04 / (2 * 0.04 + 2 * (0.02 + 0.06)))
    # t_verify between measured points: the line through the extremes
    assert t_verify_at(3, {1: 1.0, 5: 3.0}) == pytest.approx(2.0)
    assert t_verify_at(9, {2: 0.5}) == 0.5


def test_alpha_and_figures_from_steps():
    # (proposed, accepted) per row: full accept, partial, none, a row that proposed nothing
    steps = [Step(2, [2, 2, 2, 0], [2, 1, 0, 0], t_draft=0.02, t_verify=0.06, verify_tokens=3)]
    alpha, f = alpha_mle(steps)
    assert alpha == pytest.approx(3 / (3 + 2)) and f == pytest.approx(3 / 4)

    def result(i, proposed, accepted, by_pos, tokens):  # one prefill pass, one step
        c = Counters(draft_steps=1 if proposed else 0, proposed=proposed, accepted=accepted,
                     accepted_by_position=by_pos, target_passes=2, new_tokens=tokens)
        return Result(id=i, token_ids=[5] * tokens, counters=c)

    # the prefill's token, then accepted drafts and one recovered or bonus token
    results = [result(0, 2, 2, [1, 1], 4), result(1, 2, 1, [1], 3), result(2, 2, 0, [], 2),
               result(3, 0, 0, [], 2)]
    spec = Run(FIXED, 4, seconds=1.0, outputs=[r.token_ids for r in results], draft="x", g=2,
               results=results, steps=steps, prefill_seconds=0.2)
    none = Run(NONE, 4, seconds=1.4, outputs=[[5]] * 11, g=0, results=[],
               steps=[Step(0, [0] * 4, [0] * 4, 0.0, 0.04, 1)], prefill_seconds=0.2)
    hf = Run("hf", 4, seconds=3.5, outputs=[[5]] * 11)
    row = figures(spec, hf, none)
    assert row["tokens_per_s"] == 11 and row["speedup_vs_hf"] == pytest.approx(3.5)
    assert row["speedup_vs_none"] == pytest.approx(1.4)
    assert row["acceptance_rate"] == pytest.approx(3 / 6)
    assert row["mean_acceptance_length"] == pytest.approx(1 + 3 / 3)
    assert row["acceptance_by_position"] == pytest.approx([2 / 3, 1 / 3])
    assert row["t_draft"] == pytest.approx(0.01) and row["c"] == pytest.approx(0.25)
    e = 1 + 0.75 * (0.6 + 0.36)
    assert row["predicted_alpha_cost"] == pytest.approx(e * 0.04 / (0.02 + 0.06))
    # measured: 7 tokens over 4 row-steps, each step 0.08 s against a 0.04 s plain step
    assert row["tokens_per_step"] == pytest.approx(7 / 4) and row["rows_per_step"] == 4
    assert row["predicted_measured"] == pytest.approx(7 / 4 * 0.04 / 0.08)
    # decoding alone: 1.2 s against 0.8 s, the same 0.2 s of prefill left out of both
    assert row["decode_speedup_vs_none"] == pytest.approx(1.2 / 0.8)
    assert row["efficiency"] == pytest.approx(1.5 / row["predicted_measured"])
    # verified per emitted token: 8 passes' own tokens + 6 drafts over 11 tokens; padded,
    # every row of the step as wide as the widest (3), and the 4 prefills' last positions
    assert row["verified_per_token"] == pytest.approx((8 + 6) / 11)
    assert row["padded_per_token"] == pytest.approx((4 * 3 + 4) / 11)


def test_greedy_compare_flags_a_real_mismatch(tiny_models):
    target = tiny_models["target"]
    prompt = [5, 6, 7, 8]
    with torch.no_grad():
        logits = target(input_ids=torch.tensor([prompt])).logits[0, -1]
    best, worst = int(logits.argmax()), int(logits.argmin())
    check = NearTieCheck(target, [prompt])
    same = compare([[best, 9]], [[best, 9]], check)
    assert same == {"equal": 1, "near_ties": 0, "mismatches": 0, "mismatch_ids": []}
    assert compare([[best, 9]], [[worst, 9]], check)["mismatches"] == 1


def test_a_mismatch_in_half_precision_on_a_cpu_says_the_batch_moves_the_target():
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    note = batch_variance_note(cpu, torch.bfloat16)
    assert "bfloat16 on a CPU" in note and "--dtype float32" in note
    assert "float16 on a CPU" in batch_variance_note(cpu, torch.float16)
    # float32, or a GPU: a mismatch there is the engine's to answer for, and says nothing else
    assert batch_variance_note(cpu, torch.float32) == batch_variance_note(gpu, torch.bfloat16) == ""


def test_prompts_cycle_and_file_errors(tmp_path):
    assert len(load_prompts(40)) == 40
    f = tmp_path / "p.jsonl"
    f.write_text('"plain"\n{"prompt": "p"}\n{"messages": [{"role": "user", "content": "m"}]}\n')
    assert [c[0].content for c in load_prompts(4, f)] == ["plain", "p", "m", "plain"]
    f.write_text('{"prompt": "ok"}\n{"nope": 1}\n')
    with pytest.raises(PromptFileError, match=":2:"):
        load_prompts(2, f)


# -- the shallow draft --------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 2])
def test_shallow_draft_shares_the_targets_modules(tiny_models, k):
    target = tiny_models["target"]
    draft = shallow_draft(target, k)
    assert draft.config.num_hidden_layers == k and len(draft.model.layers) == k
    assert draft.model.embed_tokens.weight.data_ptr() == target.model.embed_tokens.weight.data_ptr()
    assert draft.lm_head.weight.data_ptr() == target.lm_head.weight.data_ptr()
    assert draft.model.norm.weight.data_ptr() == target.model.norm.weight.data_ptr()
    for i in range(k):
        assert draft.model.layers[i] is target.model.layers[i]
        assert draft.model.layers[i].self_attn.layer_idx == i
    target_ptrs = {p.data_ptr() for p in target.parameters()}
    assert all(p.data_ptr() in target_ptrs for p in draft.parameters())


def test_shallow_draft_rejects_bad_depth(tiny_models):
    target = tiny_models["target"]
    for k in (0, target.config.num_hidden_layers):
        with pytest.raises(DraftBuildError, match="num_layers"):
            shallow_draft(target, k)


def test_skip_draft_shares_weights_with_its_own_layer_numbers(tiny_models):
    target = tiny_models["target"]
    draft = skip_draft(target, [0, 3])
    assert [layer.self_attn.layer_idx for layer in draft.model.layers] == [0, 1]
    assert draft.model.layers[1].self_attn.q_proj is target.model.layers[3].self_attn.q_proj
    assert draft.model.layers[1].mlp is target.model.layers[3].mlp
    assert target.model.layers[3].self_attn.layer_idx == 3  # the target is untouched
    target_ptrs = {p.data_ptr() for p in target.parameters()}
    assert all(p.data_ptr() in target_ptrs for p in draft.parameters())
    with pytest.raises(DraftBuildError, match="keep"):
        skip_draft(target, [0, 1, 2, 3])


@pytest.mark.parametrize("build", [lambda t: shallow_draft(t, 1), lambda t: shallow_draft(t, 2),
                                   lambda t: skip_draft(t, [0, 3])],
                         ids=["shallow1", "shallow2", "skip0+3"])
def test_self_draft_speculation_equals_target_greedy(tiny_models, tiny_tokenizer, build):
    target = tiny_models["target"]
    k = 2
    drafter = DraftModel(build(target), pad_id=tiny_tokenizer.pad_token_id)
    engine = SpeculativeEngine(target, tiny_tokenizer, drafter, max_batch_size=4,
                               draft_length=3, adaptive=False)
    gen = torch.Generator().manual_seed(k)
    prompts = [(torch.randint(3, 259, (4,), generator=gen).tolist() * 4)[: 6 + 3 * i]
               for i in range(8)]
    requests = [Request(id=i, prompt_token_ids=p, max_new_tokens=10 + 2 * i)
                for i, p in enumerate(prompts)]
    results = engine.generate(requests)
    want = []
    for req in requests:
        ids = torch.tensor([req.prompt_token_ids])
        with torch.no_grad():
            out = target.generate(ids, max_new_tokens=req.max_new_tokens, do_sample=False)
        want.append(out[0, ids.shape[1]:].tolist())
    verdict = compare(want, [r.token_ids for r in results], NearTieCheck(target, prompts))
    assert verdict["mismatches"] == 0 and verdict["equal"] >= len(prompts) - 1, verdict
    assert sum(r.counters.proposed for r in results) > 0
    assert sum(r.counters.accepted for r in results) > 0


@pytest.mark.parametrize("mode", [[], ["--admit-groups", "1,3"],
                                  ["--templates", "4", "--check-alone"]])
def test_prefill_bench_compares_sharing_or_refill_groups(capsys, mode):
    """Side by side on the tiny pair, the outputs identical (never a speed asserted)."""
    from specq.bench import prefill_bench

    argv = ["--pair", "tiny", "--prompts", "10", "--prefix-tokens", "40", "--batch", "4",
            "--max-new-tokens", "6", *mode]
    assert prefill_bench.main(argv) == 0
    out = capsys.readouterr().out
    assert "outputs identical 10/10" in out
    assert ("admit group 3:" in out) == ("--admit-groups" in mode)
    assert ("each also equal to the prompt run alone" in out) == ("--check-alone" in mode)


def test_bench_json_schema_workload(tmp_path, capsys):
    """`specq bench --workload json-schema`: every configuration side by side, shaped runs
    identical to constrained decoding without drafts, the grammar's drafts counted."""
    args = _args(tmp_path, "--pair", "tiny-lookup", "--workload", "json-schema",
                 "--batch-sizes", "2", "--max-new-tokens", "24", "--grammar-drafters", "lookup")
    assert run(args) == 0
    out = capsys.readouterr().out
    assert "x shaped" in out and "mask us/tok" in out
    report = json.loads((tmp_path / "out" / "bench-json-schema.json").read_text())
    runs = {r["config"]: r for r in report["runs"]}
    assert list(runs) == ["free", "shaped", "+grammar", "lookup", "lookup+grammar"]
    assert all(r["mismatches"] == 0 for name, r in runs.items() if name != "free")
    assert runs["+grammar"]["forced_proposed"] > 0 and runs["shaped"]["forced_proposed"] == 0
    assert runs["+grammar"]["tokens_per_pass"] > runs["shaped"]["tokens_per_pass"]
    assert all(r["tokens_per_pass_median"] == r["tokens_per_pass"] for r in runs.values())
    assert runs["shaped"]["mask_seconds"] > 0 and runs["free"]["mask_seconds"] == 0
    assert runs["lookup+grammar"]["speedup_vs_no_grammar_drafts"] is not None


def test_schema_table_reads_tokens_a_pass_as_the_rounds_median():
    """The schema bench's tokens a pass is the rounds' median with their range, not the
    median-seconds run's own figure (which may be any round's)."""
    from specq.bench.grammar_bench import table

    run_ = {"config": "lookup+grammar", "batch_size": 4, "seconds": 9.4, "valid": 3,
            "tokens_per_pass": 2.66, "tokens_per_pass_of_repeats": [3.05, 3.06, 2.66],
            "tokens_per_pass_median": 3.05, "forced_accepted": 9, "forced_proposed": 10,
            "mask_us_per_token": 1.0, "mask_share": 0.01, "speedup_vs_shaped": 1.6,
            "speedup_vs_shaped_rounds": [1.6, 1.6, 1.8], "speedup_vs_no_grammar_drafts": None,
            "mismatches": 0}
    row = table({"prompts": 3, "runs": [run_]}).splitlines()[2]
    assert "3.05 (2.66-3.06)" in row and "2.66 (" not in row


def test_verify_bench_runs_packed_and_padded_side_by_side(capsys):
    """The ragged verify pass and plain decoding, packed against padded and transformers'
    `generate`, on the tiny pair: outputs equal (never a speed asserted)."""
    from specq.bench import verify_bench

    argv = ["--pair", "tiny", "--batch-sizes", "4", "--plain-batch-sizes", "2",
            "--context", "16", "--passes", "1", "--rounds", "1", "--prompts-per-row", "1",
            "--max-new-tokens", "4"]
    assert verify_bench.main(argv) == 0
    out = capsys.readouterr().out
    assert "| 4 | 16 | 1 | 8 / 20 |" in out  # one row of four carries 4 drafts: 8 of 20
    assert "| 2/2, 2/2 |" in out  # packed and padded engines both equal transformers' greedy


def test_verify_bench_prices_a_draft_token_beside_a_rows_token(tiny_models):
    """Each context, each batch size: a draft token's price is the packed pass's excess
    over the plain pass, shared by the drafts carried; a row's token the plain pass over
    the rows; the break-even survival their ratio, round by round."""
    from specq.bench import verify_bench

    rows = [r for context in (8, 24) for r in verify_bench.verify_passes(
        tiny_models["target"], [4, 8], context, 2, 0.5, passes=1, rounds=2)]
    assert [(r["context"], r["batch"]) for r in rows] == [(8, 4), (8, 8), (24, 4), (24, 8)]
    for r in rows:
        drafts = r["carrying_rows"] * 2
        assert r["tokens_carried"] == r["batch"] + drafts
        for i in range(2):
            packed, plain = r["packed_ms"]["rounds"][i], r["plain_ms"]["rounds"][i]
            draft, row = r["draft_token_ms"]["rounds"][i], r["row_token_ms"]["rounds"][i]
            assert draft == pytest.approx((packed - plain) / drafts)
            assert row == pytest.approx(plain / r["batch"]) and row > 0
            assert r["break_even"]["rounds"][i] == pytest.approx(draft / row)


def test_sampling_bench_runs_both_ways_with_the_same_texts(capsys):
    """Side by side on the tiny pair (its vocabulary is under the candidates, so both ways
    sort it whole), seeded texts identical (never a speed asserted)."""
    from specq.bench import sampling_bench

    argv = ["--pair", "tiny", "--prompts", "5", "--batch", "2", "--max-new-tokens", "6",
            "--rounds", "1", "--top-k", "20"]
    assert sampling_bench.main(argv) == 0
    out = capsys.readouterr().out
    assert out.count("texts identical 5/5") == 2 and "one sort" in out


def test_profile_table_names_runs_by_the_keys_given():
    """The grammar bench names its runs by configuration and batch size, the others by
    drafter, method, batch size and g: each gets its phases' shares and their sum."""
    from specq.bench.report import profile_table

    shares = {"admit": 0.25, "verify": 0.7, "host": 0.05}
    rows = [{"config": "suffix+grammar", "batch_size": 16, "profile_shares": shares,
             "profile_coverage": 1.0},
            {"config": "shaped", "batch_size": 16, "profile_shares": None}]
    lines = profile_table(rows, {"config": "config", "batch_size": "B"}).splitlines()
    assert lines[0].split() == ["config", "B", "admit", "verify", "host", "sum"]
    assert [line.split() for line in lines[2:]] == [
        ["suffix+grammar", "16", "25.0", "70.0", "5.0", "100.0"]]  # no profile: no line
    default = profile_table([{**rows[0], "draft": "suffix", "method": NONE, "g": 0}])
    assert default.splitlines()[0].split()[:4] == ["draft", "method", "B", "g"]
