"""A worker with injected engine faults, for the fault tests and `specq bench-chaos`.

    python -m specq.bench.faults FAULTS_FILE --pair tiny [-n NAME]

runs `specq worker --pair tiny` with the engine patched to raise the faults that
FAULTS_FILE (JSON, re-read whenever it changes) asks for:

    {"version": 1, "oom": 2, "error": 1, "device": 0, "poison": "MARKER",
     "poison_kind": "error"}

- ``oom``, ``error``, ``device``: that many steps, from the next one on, fail with a CUDA
  out-of-memory error, a RuntimeError, or a CUDA illegal-memory-access error (in that
  order), once per ``version`` of the file: bump it to ask again.
- ``poison``: every step whose batch holds a request with MARKER in its prompt fails, as
  ``poison_kind`` says: ``error`` (a RuntimeError), ``device`` (a CUDA illegal memory
  access: the worker exits for its supervisor), or ``kill`` (the process dies at once, as
  by a segfault: SIGKILL to itself).
The fault strikes inside the step's target pass, after the drafter proposed, as a real
one would: the drafter's state is left half-updated. A real CUDA error or segfault is not
what this CPU-only machine should produce on purpose: these stand in for one (a mock where
the real part cannot run).
"""

from __future__ import annotations

import json
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from specq.worker.engine.batch import KVRows
from specq.worker.engine.logits import Logits
from specq.worker.engine.speculative import SpeculativeEngine
from specq.worker.engine.step import Step

KINDS = ("oom", "error", "device")
POISON_KINDS = ("error", "device", "kill")


def make_fault(kind: str) -> Exception:
    if kind == "oom":
        return torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB "
                                      "(injected fault)")
    if kind == "device":
        return RuntimeError("CUDA error: an illegal memory access was encountered "
                            "(injected fault)")
    return RuntimeError(f"injected fault ({kind})")


class FaultPlan:
    """The faults a JSON file asks for, consumed one per step."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._mtime: float | None = None
        self._version: Any = None
        self.queue: list[str] = []
        self.poison: str | None = None
        self.poison_kind = "error"
        self.armed = True  # main() arms it once the worker is ready (after its warm-up)

    def _reload(self) -> None:
        try:
            mtime = self.path.stat().st_mtime
        except FileNotFoundError:
            return
        if mtime == self._mtime:
            return
        self._mtime = mtime
        try:
            plan = json.loads(self.path.read_text() or "{}")
        except ValueError:
            return  # caught half-written: the next step reads it again
        self.poison = plan.get("poison")
        self.poison_kind = plan.get("poison_kind", "error")
        if self.poison_kind not in POISON_KINDS:
            raise ValueError(f"{self.path}: poison_kind must be one of {POISON_KINDS}")
        if plan.get("version") != self._version:
            self._version = plan.get("version")
            self.queue = [k for k in KINDS for _ in range(int(plan.get(k, 0)))]

    def next_fault(self, engine: SpeculativeEngine) -> str | None:
        if not self.armed:
            return None
        self._reload()
        if self.poison and any(self.poison in _text(r.request) for r in engine.rows):
            return {"error": "poison", "device": "device", "kill": "kill"}[self.poison_kind]
        return self.queue.pop(0) if self.queue else None


def _text(request: Any) -> str:
    if request.prompt is not None:
        return request.prompt
    return " ".join(m.content for m in request.messages or [])


def install(plan: FaultPlan) -> Callable[[], None]:
    """Patch the engine: a step the plan picks fails in its target pass. Returns the
    function that takes the patch off again."""
    armed: dict[int, str] = {}  # id(target model) -> fault kind for its next pass
    step, logits = SpeculativeEngine.step, KVRows.logits  # every pass of a model goes there

    def faulty_step(self: SpeculativeEngine) -> Step:
        kind = plan.next_fault(self)
        if kind:
            armed[id(self.target)] = kind
        try:
            return step(self)
        finally:
            armed.pop(id(self.target), None)

    def faulty_logits(self: KVRows, *args: Any, **kwargs: Any) -> Logits:
        kind = armed.pop(id(self.model), None)
        if kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)  # as a segfault would: no cleanup at all
        if kind:
            raise make_fault(kind)
        return logits(self, *args, **kwargs)

    SpeculativeEngine.step = faulty_step  # type: ignore[method-assign]
    KVRows.logits = faulty_logits  # type: ignore[method-assign]

    def undo() -> None:
        SpeculativeEngine.step, KVRows.logits = step, logits  # type: ignore[method-assign]

    return undo


def main(argv: list[str]) -> None:
    """FAULTS_FILE --pair PAIR [-n NAME] [--loglevel L]: a worker with faults installed."""
    import argparse

    from celery.signals import worker_ready

    from specq.worker.launch import run_worker

    p = argparse.ArgumentParser(prog="python -m specq.bench.faults")
    p.add_argument("faults_file", type=Path)
    p.add_argument("--pair", required=True)
    p.add_argument("-n", "--hostname")
    p.add_argument("--loglevel", default="info")
    args = p.parse_args(argv)
    plan = FaultPlan(args.faults_file)
    plan.armed = False  # the worker's start-up generation and calibration run clean

    @worker_ready.connect(weak=False)
    def _arm(**_: Any) -> None:
        plan.armed = True

    install(plan)
    run_worker(args.pair, args.loglevel, args.hostname)


if __name__ == "__main__":
    main(sys.argv[1:])
