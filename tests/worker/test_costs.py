"""The step-cost cache: a start with the same (pair, device, dtype, threads, torch, host)
loads the costs instead of calibrating; any change of key calibrates again; the costs the
steps refine are written back; a calibration stays within its time budget."""

from __future__ import annotations

import json

import pytest
import torch

from specq.configs.presets import get_preset
from specq.configs.settings import Settings
from specq.worker import costs
from specq.worker.costs import CostCache, cost_key, start_costs
from specq.worker.engine.policy import CostTable
from specq.worker.pairs import load_pair


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """The tiny target with prompt lookup (an adaptive policy), built in a data dir of its
    own."""
    return load_pair(get_preset("tiny-lookup"),
                     Settings(data_dir=tmp_path_factory.mktemp("data"), device="cpu"))


@pytest.fixture
def engine(pair):
    return pair.engine(max_batch_size=4)


def test_a_fresh_start_calibrates_and_saves_then_a_second_loads(pair, engine, tmp_path,
                                                                  monkeypatch):
    calls = []
    real = type(engine).calibrate
    monkeypatch.setattr(type(engine), "calibrate",
                        lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    cache = start_costs(engine, pair.preset, tmp_path, budget=60)
    assert calls == [1] and cache.path.is_file()
    assert cache.path.parent == tmp_path / "calibration"
    saved = json.loads(cache.path.read_text())
    assert saved["key"] == cost_key(pair.preset, engine)
    measured = engine.policy.snapshot()["t_verify"]

    again = pair.engine(max_batch_size=4)
    start_costs(again, pair.preset, tmp_path, budget=60)
    assert calls == [1], "the second start loads the cached costs"
    loaded = again.policy.snapshot()["t_verify"]
    assert loaded.keys() == measured.keys()
    for b in measured:
        assert loaded[b] == pytest.approx(measured[b])


@pytest.mark.parametrize("change", ["device", "dtype", "threads", "torch", "host", "pair"])
def test_any_change_of_key_calibrates_again(pair, engine, tmp_path, monkeypatch, change):
    first = start_costs(engine, pair.preset, tmp_path, budget=60)
    assert CostCache(tmp_path, pair.preset, engine).load()
    if change == "threads":
        monkeypatch.setattr(torch, "get_num_threads", lambda: 977)
    elif change == "torch":
        monkeypatch.setattr(torch, "__version__", "0.0.1")
    elif change == "host":
        monkeypatch.setattr(costs.socket, "gethostname", lambda: "elsewhere")
    elif change in ("device", "dtype"):
        real = costs.cost_key
        monkeypatch.setattr(costs, "cost_key", lambda p, e: {**real(p, e), change: "other"})
    preset = get_preset("tiny") if change == "pair" else pair.preset
    other = CostCache(tmp_path, preset, engine)
    assert other.key != first.key and other.path != first.path
    assert not other.load()


def test_a_corrupt_or_foreign_file_is_measured_again(pair, engine, tmp_path):
    cache = CostCache(tmp_path, pair.preset, engine)
    cache.path.parent.mkdir(parents=True)
    cache.path.write_text("{not json")
    assert not cache.load()
    cache.path.write_text(json.dumps({"key": {**cache.key, "host": "x"}, "costs": {}}))
    assert not cache.load()
    short = {"xtx": [[1.0]], "xty": [1.0], "prior_xtx": [[1.0]], "prior_xty": [1.0],
             "ragged": 9.0}  # a pass fit cut short: its terms missing
    cache.path.write_text(json.dumps({"key": cache.key, "costs": {
        "verify": {}, "draft": {}, "passes": {"4": short}}}))
    assert not cache.load()


def test_refined_costs_are_written_back(pair, engine, tmp_path):
    cache = start_costs(engine, pair.preset, tmp_path, budget=60)
    policy = engine.policy
    policy.observe(0, [0] * 4, [0] * 4, 0.0, 123.0, 1)  # a plain pass at batch 4, very slow
    cache.save()
    state = json.loads(cache.path.read_text())["costs"]
    table = CostTable.from_state(state, max_weight=2.0)
    assert table.verify_seconds(1, 4) == pytest.approx(policy.t_verify(1, 4), rel=0.3)
    # loaded weights are capped: the next run's steps soon outweigh them
    assert all(d.weight <= 2.0 for t in table.verify.values() for d in t.values())


def test_a_fresh_calibration_keeps_to_its_budget(pair):
    """The smallest batch size is always measured, then the largest (on prompts shortened
    to PREFILL_TOKENS in all) and the others, each where the last one's time, scaled by
    the tokens, fits in what is left of the budget."""
    big = pair.engine(max_batch_size=4096)
    assert big.calibrate(budget=0.0) == [1]
    assert set(big.policy.snapshot()["t_verify"]) == {1}
    assert pair.engine(max_batch_size=16).calibrate(budget=3600.0) == [1, 16]
    assert pair.engine(max_batch_size=300).calibrate(budget=3600.0) == [1, 16, 256, 300]


def test_a_saved_fit_loads_whole_and_a_broken_one_is_measured_again(pair, engine, tmp_path):
    """The packed pass's fit (calibration's ragged shapes in it) comes back from the file
    as it was saved; a file whose fit cannot be read is calibrated afresh, not half-used."""
    cache = start_costs(engine, pair.preset, tmp_path, budget=60)
    measured = engine.policy.costs.pass_fit(4)
    assert measured is not None
    again = pair.engine(max_batch_size=4)
    assert CostCache(tmp_path, pair.preset, again).load()
    assert again.policy.costs.pass_fit(4) == pytest.approx(measured)
    saved = json.loads(cache.path.read_text())
    saved["costs"]["passes"]["4"].pop("prior_xtx")
    cache.path.write_text(json.dumps(saved))
    assert not CostCache(tmp_path, pair.preset, pair.engine(max_batch_size=4)).load()
