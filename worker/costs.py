"""The step costs of a pair on a device, kept in the data directory between processes.

A worker and `specq run` choose the draft length from measured costs (engine/policy.py).
Measuring them from nothing at every start cost a worker's start far more than reading them
(docs/benchmarks.md#2026-12-02-calibration-cache), so the cost table is kept as JSON under
``data_dir/calibration``, keyed by everything the costs depend on: the pair's preset, the
device, the dtype, torch's threads, torch's version, the forward's paths (packed,
linear layers prepacked: packed.py) and the host. A start with the same key
loads it; any other key calibrates afresh within ``calibration_budget`` seconds. The steps
then refine the table as always, and the refined table is written back (after each chunk and
at the end of `specq run`), so a calibration made on a busy machine is mended by the jobs
that follow it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
from pathlib import Path
from typing import Any

import torch

from specq.configs.presets import PairPreset
from specq.worker.engine import packed as packing
from specq.worker.engine.batch import KVRows
from specq.worker.engine.calibration import REPEATS
from specq.worker.engine.policy import CostTable
from specq.worker.engine.speculative import SpeculativeEngine

log = logging.getLogger(__name__)

FOLDER = "calibration"  # under the data directory
VERSION = 5  # of the file and of what it holds (2: the largest batch size measured too;
# 3: the packed pass's two-part fit, calibration's ragged passes in it; 4: linear layers
# prepacked on a CPU, passes about 3x cheaper than the costs kept before; 5: a split pass's
# queries gathered from the packed tokens, a lone wide row's pass about half its cost)


def cost_key(preset: PairPreset, engine: SpeculativeEngine) -> dict[str, Any]:
    """What the costs depend on: a change in any of these calibrates again."""
    return {"version": VERSION, "pair": preset.name,
            "preset": preset.model_dump(mode="json"),
            "device": str(engine.target.device), "dtype": str(engine.target.dtype),
            "threads": torch.get_num_threads(), "torch": torch.__version__,
            # the forward's paths: packed (packed.py), and its linear layers prepacked
            "packed": [KVRows(engine.target).packed, packing.prepacking()],
            "host": socket.gethostname()}


def cost_path(data_dir: Path, key: dict[str, Any]) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return data_dir / FOLDER / f"{key['pair']}-{digest}.json"


class CostCache:
    """The cached cost table of one (pair, device, dtype, threads, torch, host)."""

    def __init__(self, data_dir: Path, preset: PairPreset, engine: SpeculativeEngine) -> None:
        self.engine = engine
        self.key = cost_key(preset, engine)
        self.path = cost_path(data_dir, self.key)

    def load(self) -> bool:
        """Put the cached table in the engine's policy; False where there is none for this
        key (or it cannot be read: it is then measured again)."""
        try:
            saved = json.loads(self.path.read_text(encoding="utf-8"))
            if saved.get("key") != self.key:
                return False
            table = CostTable.from_state(saved["costs"], max_weight=REPEATS)
        except FileNotFoundError:
            return False
        except (OSError, ValueError, KeyError, TypeError, IndexError) as exc:
            log.warning("calibration cache %s not read (%s): calibrating", self.path, exc)
            return False
        self.engine.policy.costs = table
        self.engine.policy.forget_data()
        log.info("step costs loaded from %s", self.path)
        return True

    def save(self) -> None:
        """Write the policy's current table, aside and renamed (a reader never sees half);
        a failure is logged, never raised: the costs are a cache."""
        policy = self.engine.policy
        if not policy.adapts or not policy.costs.verify:
            return
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps({"key": self.key, "costs": policy.costs.state()}),
                           encoding="utf-8")
            os.replace(tmp, self.path)
        except OSError as exc:
            log.warning("calibration cache %s not written (%s)", self.path, exc)
            tmp.unlink(missing_ok=True)


def start_costs(engine: SpeculativeEngine, preset: PairPreset, data_dir: Path,
                budget: float) -> CostCache:
    """The engine's step costs at start: the cached table, else a calibration within
    ``budget`` seconds, saved. Returns the cache, for the refined table's later saves."""
    cache = CostCache(data_dir, preset, engine)
    if engine.policy.adapts and not cache.load():
        engine.calibrate(budget=budget)
        cache.save()
    return cache
