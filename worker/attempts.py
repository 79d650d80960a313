"""Generating a chunk's items through faults: transient until proven otherwise.

A fault fails nothing on its first occurrence. There are two kinds:

- An engine exception. The engine drops its state (both caches, the drafter's, the rows)
  before the next generation, and:
  - out of memory with more than one row in the batch: the chunk's remaining items are
    retried at half the batch size (down to 1); the engine's own size is restored after;
  - a device that is gone (a CUDA error other than out-of-memory): the items in flight
    count a crash (below), and DeviceLost is raised: the worker exits for its supervisor
    to restart it (worker/tasks.py);
  - anything else (and out of memory with a single row): each item that was in the batch
    when it struck counts an attempt, stored with the error.
- A worker that died (killed, crashed) with items in flight. Every batch the engine starts
  is marked on its items first (Run.launch), so the next run of the chunk, on any worker,
  finds the marks of the dead run and counts a crash on each of those items; an item that
  was alone in its batch counts an attempt too, where the death is proven (worker/run.py's
  glossary: crash).

An item a fault struck, in this run or an earlier one, is a suspect: suspects run alone,
after the rest of the chunk, the least struck first, after a pause that doubles each time
(retry_backoff .. retry_backoff_max). One bad item therefore takes no batch-mate down: they
finish alone while it fails alone. An item fails for good, with its last error, once its
attempts reach max_attempts x (retries + 1) (`specq retry` sends failed items back with
their attempts kept). Every fault is counted on the chunk (the job's engine_faults), and
every suspect that completes alone too (items_isolated).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from pydantic import ValidationError

from specq.configs.settings import Settings
from specq.db.models import ItemStatus, utcnow
from specq.db.outcomes import Outcome, storable
from specq.schema.generation import Request, merge
from specq.worker import device, metrics
from specq.worker.engine.result import Result
from specq.worker.engine.speculative import SpeculativeEngine
from specq.worker.keeper import Stopped

__all__ = ["ChunkItem", "Run", "Stopped", "Tally", "generate_with_retries", "item_outcome",
           "storable"]

log = logging.getLogger(__name__)


@dataclass
class ChunkItem:
    """A pending item as read at the chunk's start."""

    index: int
    prompt: str | None
    messages: list | None
    params: dict | None  # its own generation parameters, over the job's
    attempts: int = 0
    retries: int = 0
    crashes: int = 0  # workers that died with it in flight
    error: str | None = None  # the last fault's, while it stays pending

    @property
    def struck(self) -> tuple[int, int]:
        """How often faults struck it (attempts, crashes): suspects run in this order."""
        return self.attempts, self.crashes


class Run(Protocol):
    """Where generation reports what happens to a chunk's items: its run (worker/run.py:
    ChunkRun, which writes them only while it holds the chunk's lease)."""

    def launch(self, indices: list[int], generation: int) -> None: ...

    def put(self, outcome: Outcome) -> None: ...

    def failed(self, indices: list[int], error: str, generation: int | None = None
               ) -> None: ...

    def out_of_memory(self, error: str) -> None: ...

    def crashed(self, indices: list[int], why: str) -> None: ...

    def should_stop(self) -> bool: ...


@dataclass
class Tally:
    """What a chunk's generation came to."""

    failed: int = 0  # items failed for good by this run
    faults: int = 0  # engine exceptions met


def generate_with_retries(
    engine: SpeculativeEngine,
    items: list[ChunkItem],
    params: dict[str, Any],
    hostname: str,
    run: Run,
    settings: Settings,
    on_item: Callable[[], object] | None = None,
    job: int | None = None,
) -> Tally:
    """Generate every item once (each outcome goes to ``run`` as it finishes).
    ``job`` names the items' job to the engine (a suffix drafter's index is per job)."""
    tally = Tally()
    started = utcnow()
    limit = {it.index: settings.max_attempts * (it.retries + 1) for it in items}
    struck = {it.index: it.struck for it in items if any(it.struck)}  # the suspects
    requests: dict[int, Request] = {}
    for it in items:
        if it.attempts >= limit[it.index]:  # its last run's worker died with it alone
            run.put(item_outcome(it.index, Result(id=it.index, error=it.error or
                                                     f"failed {it.attempts} times"),
                                    hostname, started, started))
            tally.failed += 1
            continue
        try:
            requests[it.index] = Request(id=it.index, prompt=it.prompt, messages=it.messages,
                                         **merge(params, it.params))
        except ValidationError as exc:
            run.put(item_outcome(it.index, Result(id=it.index, error=str(exc)), hostname,
                                    started, started))
    finished: set[int] = set()
    alone: set[int] = set()  # the suspect running alone now

    def seen(result: Result) -> None:
        index = int(result.id)
        finished.add(index)
        run.put(item_outcome(index, result, hostname, started, utcnow(),
                                isolated=index in alone))
        if on_item:
            on_item()
        stop_if_told()

    def stop_if_told() -> None:
        """Stopped once the run should stop (it gave its lease up, lost it, or its job is
        being cancelled): checked as each item ends and before each engine step, so a
        run does not generate for seconds what its writes could no longer keep."""
        if run.should_stop():
            raise Stopped

    full = engine.max_batch_size
    batch, pause = full, settings.retry_backoff
    remaining = sorted(requests)
    generation = 0  # the engine generations of this run, each a launch of its own
    try:
        while remaining:
            singles = sorted((i for i in remaining if i in struck), key=lambda i: (struck[i], i))
            groups = [[i for i in remaining if i not in struck]] + [[i] for i in singles]
            try:
                for group in filter(None, groups):
                    generation += 1
                    alone.clear()
                    alone.update(group if group[0] in struck else ())
                    engine.max_batch_size = batch

                    def admitted(ids: list, g: int = generation) -> None:
                        run.launch([int(i) for i in ids], g)

                    engine.generate([requests[i] for i in group], on_result=seen, job=job,
                                    on_admit=admitted, check=stop_if_told)
                break
            except Stopped:
                raise
            except Exception as exc:  # noqa: BLE001 (every engine fault is judged here)
                tally.faults += 1
                metrics.active().engine_restarts.inc()
                active = [int(i) for i in engine.active_ids() if int(i) not in finished]
                active = active or [i for i in remaining if i not in finished]
                engine.reset()
                device.free_memory(engine.target.device)
                remaining = [i for i in remaining if i not in finished]
                error = f"{type(exc).__name__}: {exc}"[:2000]
                if device.is_device_lost(exc):
                    run.crashed(active, error)
                    raise device.DeviceLost(str(exc)) from exc
                if device.is_out_of_memory(exc) and min(batch, len(active)) > 1:
                    batch = max(1, min(batch, len(active)) // 2)
                    run.out_of_memory(error)
                    metrics.active().oom_halvings.inc()
                    log.warning("out of memory at %d rows (%s); retrying %d items at batch "
                                "size %d", len(active), error, len(remaining), batch)
                    continue
                log.warning("engine failure on items %s (%s); %d items left", active, error,
                            len(remaining), exc_info=not device.is_out_of_memory(exc))
                run.failed(active, error, generation)
                for i in active:
                    attempts, crashes = struck.get(i, (0, 0))
                    struck[i] = (attempts + 1, crashes)
                    if attempts + 1 >= limit[i]:
                        run.put(item_outcome(i, Result(id=i, error=error), hostname,
                                                started, utcnow()))
                        finished.add(i)
                        tally.failed += 1
                remaining = [i for i in remaining if i not in finished]
                metrics.active().items_retried.inc(len([i for i in active if i in remaining]))
                if remaining:
                    time.sleep(pause)
                    pause = min(settings.retry_backoff_max, pause * 2)
    finally:
        engine.max_batch_size = full
    return tally


def item_outcome(index: int, res: Result, hostname: str, started: Any, finished: Any,
                 isolated: bool = False) -> Outcome:
    """What a result writes to its item: the output, or the error that stopped it.
    ``isolated``: it ran alone because a fault had struck it."""
    if res.error:
        return Outcome.failure(index, storable(res.error), prompt_tokens=res.prompt_tokens,
                               counters=res.counters, worker=hostname, started_at=started,
                               finished_at=finished, isolated=isolated)
    return Outcome(index, ItemStatus.completed, output=storable(res.text),
                   token_ids=list(res.token_ids), finish_reason=res.finish_reason,
                   prompt_tokens=res.prompt_tokens, counters=res.counters, worker=hostname,
                   started_at=started, finished_at=finished, isolated=isolated)
