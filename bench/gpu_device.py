"""The worker's device paths, run for real on CUDA by `specq bench gpu` (gpu.py).

- out of memory: an oversized batch under a memory cap (torch's per-process fraction)
  raises a real CUDA out-of-memory error; worker/attempts.py's generate_with_retries must
  halve the batch until it fits and finish every item;
- device lost: a device-side assert (a token id past the vocabulary, in a child process:
  the CUDA context is unusable after it) must come out of generate_with_retries as
  DeviceLost, the worker's cue to exit for its supervisor;
- memory between jobs: what a job allocated is handed back once it ends.

The chunk's keeper is a recorder (``Recorder``): these paths are about the device, and a
keeper writes to a database the GPU machine does not have. On a CPU every path is skipped
with the reason: none of these errors exists there.

Host syncs per step are counted with torch's sync debug mode (CUDA only), which warns at
every operation that makes the host wait for the device.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from specq.configs.settings import Settings
from specq.db.models import ItemStatus
from specq.schema.generation import Request
from specq.worker.attempts import ChunkItem, generate_with_retries
from specq.worker.device import DeviceLost, is_device_lost
from specq.worker.engine.drafters import NoDraft
from specq.worker.engine.speculative import SpeculativeEngine

if TYPE_CHECKING:
    from specq.bench.gpu_pair import Size

log = logging.getLogger(__name__)
MiB = 2**20
CPU_ONLY = "CUDA only, and this run is on {device}: {why}"


# -- memory and syncs ------------------------------------------------------------------


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory(device: torch.device) -> float | None:
    """MiB allocated at most since reset_peak (None off CUDA)."""
    if device.type != "cuda":
        return None
    return torch.cuda.max_memory_allocated(device) / MiB


@dataclass
class Syncs:
    count: int | None = None  # None: not countable here


@contextmanager
def sync_counter(device: torch.device) -> Iterator[Syncs]:
    """Count the operations in the block that make the host wait for the device (CUDA:
    torch's sync debug mode; elsewhere count stays None)."""
    syncs = Syncs()
    if device.type != "cuda":
        yield syncs
        return
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            torch.ones(1, device=device).item()  # a probe: one sync must be seen
            probe = len(seen)
            yield syncs
        finally:
            torch.cuda.set_sync_debug_mode("default")
    if probe:  # each sync warns once: the probe says how many warnings one makes
        syncs.count = sum("synchroniz" in str(w.message) for w in seen[probe:])


def syncs_per_step(engine: SpeculativeEngine, requests: list[Request]) -> float | None:
    """Host syncs per engine step over one generation (admissions included)."""
    steps: list = []
    engine.on_step = steps.append
    with sync_counter(engine.target.device) as syncs:
        engine.generate(requests)
    engine.on_step = None
    return syncs.count / len(steps) if syncs.count is not None and steps else None


# -- the worker's paths ----------------------------------------------------------------


@dataclass
class Recorder:
    """The calls generate_with_retries makes on a chunk's keeper, kept in memory."""

    outcomes: list = field(default_factory=list)
    ooms: list[str] = field(default_factory=list)
    failures: list[tuple[list[int], str]] = field(default_factory=list)
    crashes: list[tuple[list[int], str]] = field(default_factory=list)

    def put(self, outcome: Any) -> None:
        self.outcomes.append(outcome)

    def launch(self, indices: list[int], generation: int) -> None:
        pass

    def should_stop(self) -> bool:
        return False

    def out_of_memory(self, error: str) -> None:
        self.ooms.append(error)

    def failed(self, indices: list[int], error: str, generation: int | None = None) -> None:
        self.failures.append((indices, error))

    def crashed(self, indices: list[int], why: str) -> None:
        self.crashes.append((indices, why))


def _items(reqs: list[Request]) -> list[ChunkItem]:
    return [ChunkItem(index=i, prompt=r.prompt,
                      messages=[m.model_dump() for m in r.messages] if r.messages else None,
                      params={"max_new_tokens": r.max_new_tokens}) for i, r in enumerate(reqs)]


def _generate(engine: SpeculativeEngine, items: list[ChunkItem]) -> Recorder:
    keeper = Recorder()
    generate_with_retries(engine, items, {}, "bench-gpu", keeper,
                          Settings(retry_backoff=0.01, retry_backoff_max=0.01))
    return keeper


def oom_halving(engine: SpeculativeEngine, reqs: list[Request], base: int,
                factor: int) -> dict:
    """A batch ``factor`` times one of ``base`` rows, under a cap of twice what ``base``
    rows needed: out-of-memory errors, halvings, every item done."""
    dev = engine.target.device
    engine.max_batch_size = base
    engine.generate(reqs[:base])  # warm: shared prefixes stored, kernels chosen
    torch.cuda.empty_cache()
    floor = torch.cuda.memory_allocated(dev)
    reset_peak(dev)
    engine.generate(reqs[:base])
    need = torch.cuda.max_memory_allocated(dev) - floor
    engine.reset()
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(dev).total_memory
    cap = torch.cuda.memory_reserved(dev) + 2 * need
    engine.max_batch_size = base * factor
    items = _items([reqs[i % len(reqs)] for i in range(base * factor)])
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), dev)
    try:
        keeper = _generate(engine, items)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, dev)
        torch.cuda.empty_cache()
    done = sum(o.status == ItemStatus.completed for o in keeper.outcomes)
    ok = bool(keeper.ooms) and done == len(items) and not keeper.failures
    return {"passed": ok, "ooms": len(keeper.ooms), "completed": done, "items": len(items),
            "cap_mib": cap / MiB, "need_mib_at_base": need / MiB,
            "detail": f"{len(items)} items at batch {base * factor} under a cap of "
                      f"{cap / MiB:.0f} MiB: {len(keeper.ooms)} out-of-memory error(s), each "
                      f"halving the batch; {done}/{len(items)} completed"}


def memory_between_jobs(engine: SpeculativeEngine, reqs: list[Request]) -> dict:
    """Allocated memory after a job ends, against before it started."""
    dev = engine.target.device
    engine.generate(reqs[:1])  # warm
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated(dev)
    reset_peak(dev)
    engine.generate(reqs)
    peak = torch.cuda.max_memory_allocated(dev)
    after = torch.cuda.memory_allocated(dev)
    left = after - before
    ok = left <= max(16 * MiB, 0.05 * (peak - before))
    return {"passed": ok, "before_mib": before / MiB, "peak_mib": peak / MiB,
            "after_mib": after / MiB,
            "detail": f"{(peak - before) / MiB:.0f} MiB used during the job, "
                      f"{left / MiB:.1f} MiB still allocated after it"}


def device_lost(device: torch.device) -> dict:
    """A device-side assert in a child process (it leaves the CUDA context unusable)."""
    try:
        done = subprocess.run([sys.executable, "-m", "specq.bench.gpu_device", str(device)],
                              capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        return {"passed": False, "detail": "the child process did not end in 300 s"}
    lines = [x for x in done.stdout.splitlines() if x.startswith("{")]
    if not lines:
        return {"passed": False, "detail": f"the child exited {done.returncode} with no "
                f"verdict: {done.stderr[-600:]}"}
    got = json.loads(lines[-1])
    ok = got["raised"] == "DeviceLost" and got["classified"]
    return {"passed": ok, **got,
            "detail": f"generate_with_retries raised {got['raised']} "
                      f"({got['cause'][:120]}); is_device_lost: {got['classified']}"}


def lose_the_device(device: str) -> dict:
    """The child's work: a tiny model on ``device``, one item whose prompt holds a token id
    past the vocabulary (on CUDA, the embedding's device-side assert). Prints and returns
    what came out of generate_with_retries."""
    from specq.bench.gpu_pair import SIZES, build_target, build_tokenizer, llama_config

    size = SIZES["tiny"]
    dev = torch.device(device)
    cfg = llama_config(size)
    engine = SpeculativeEngine(build_target(size, dev), build_tokenizer(cfg.vocab_size,
                                                                        size.specials),
                               NoDraft(), max_batch_size=2)
    item = ChunkItem(index=0, prompt=None, messages=None,
                     params={"prompt_token_ids": [5, cfg.vocab_size + 1000, 7],
                             "max_new_tokens": 4})
    got: dict[str, Any] = {"raised": None, "cause": "", "classified": False}
    try:
        _generate(engine, [item])
    except DeviceLost as exc:
        cause = exc.__cause__ or exc
        got = {"raised": "DeviceLost", "cause": f"{type(cause).__name__}: {cause}",
               "classified": is_device_lost(cause)}
    except Exception as exc:  # noqa: BLE001 (the verdict names whatever came out)
        got = {"raised": type(exc).__name__, "cause": str(exc),
               "classified": is_device_lost(exc)}
    print(json.dumps(got), flush=True)
    return got


def device_paths(target, tokenizer, size: Size,
                 requests: Callable[[int, int], list[Request]]) -> dict[str, dict]:
    """Each path's {passed, detail} (or {skipped, detail} off CUDA)."""
    dev = target.device
    if dev.type != "cuda":
        why = {"oom_halving": "a CPU raises no CUDA out-of-memory error to halve on",
               "device_lost": "a lost device is a CUDA context error",
               "memory_between_jobs": "torch keeps no count of a CPU's allocations"}
        return {k: {"skipped": True, "passed": None,
                    "detail": CPU_ONLY.format(device=dev, why=v)} for k, v in why.items()}
    reqs = [r for r in requests(4 * size.oom_base, 16) if r.response_format is None]
    engine = SpeculativeEngine(target, tokenizer, NoDraft(), max_batch_size=size.oom_base)
    out = {"memory_between_jobs": memory_between_jobs(engine, reqs[: size.oom_base])}
    out["oom_halving"] = oom_halving(engine, reqs, size.oom_base, size.oom_factor)
    out["device_lost"] = device_lost(dev)
    for name, r in out.items():
        log.info("device path %s: %s", name, r["detail"])
    return out


if __name__ == "__main__":
    lose_the_device(sys.argv[1] if len(sys.argv) > 1 else "cuda")
