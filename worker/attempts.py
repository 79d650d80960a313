"""Generating a chunk's items through engine faults: transient until proven otherwise.

An exception from the engine fails nothing on its first occurrence. The engine drops its
state (both caches, the drafter's, the rows) before the next generation, and:

- out of memory with more than one row in the batch: the chunk's remaining items are
  retried at half the batch size (down to 1); the engine's own size is restored after;
- a device that is gone (a CUDA error other than out-of-memory): DeviceLost is raised,
  and the worker exits for its supervisor to restart it (worker/tasks.py);
- anything else (and out of memory with a single row): each item that was in the batch
  when it struck counts an attempt, stored with the error. Those items then run alone, so
  that one bad item cannot take its batch-mates down with it, after a pause that doubles
  each time (retry_backoff .. retry_backoff_max). An item fails for good, with its last
  error, once its attempts reach max_attempts x (retries + 1) (`specq retry` sends failed
  items back with their attempts kept).
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from specq.configs.generation import Request, merge
from specq.configs.settings import Settings
from specq.db.models import ItemStatus, utcnow
from specq.db.outcomes import Outcome
from specq.worker import device
from specq.worker.engine.result import Result
from specq.worker.engine.speculative import SpeculativeEngine
from specq.worker.keeper import ChunkKeeper

log = logging.getLogger(__name__)


class Stopped(Exception):
    """The keeper asked the engine to stop: lease lost, or the job is being cancelled."""


@dataclass
class ChunkItem:
    """A pending item as read at the chunk's start."""

    index: int
    prompt: str | None
    messages: list | None
    overrides: dict | None
    attempts: int = 0
    retries: int = 0


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
    keeper: ChunkKeeper,
    settings: Settings,
    on_item: Callable[[], None] | None = None,
    job: int | None = None,
) -> Tally:
    """Generate every item once (each outcome goes to the keeper as it finishes).
    ``job`` names the items' job to the engine (a suffix drafter's index is per job)."""
    tally = Tally()
    started = utcnow()
    requests: dict[int, Request] = {}
    for it in items:
        try:
            requests[it.index] = Request(id=it.index, prompt=it.prompt, messages=it.messages,
                                         **merge(params, it.overrides))
        except ValidationError as exc:
            keeper.put(item_outcome(it.index, Result(id=it.index, error=str(exc)), hostname,
                                    started, started))
    attempts = {it.index: it.attempts for it in items}
    limit = {it.index: settings.max_attempts * (it.retries + 1) for it in items}
    finished: set[int] = set()

    def seen(result: Result) -> None:
        index = int(result.id)
        finished.add(index)
        keeper.put(item_outcome(index, result, hostname, started, utcnow()))
        if on_item:
            on_item()
        if keeper.should_stop():
            raise Stopped

    full = engine.max_batch_size
    batch, pause = full, settings.retry_backoff
    suspects: set[int] = set()  # failed in this run: they run alone from now on
    remaining = sorted(requests)
    try:
        while remaining:
            alone = [i for i in remaining if i in suspects]
            groups = [[i] for i in alone] + [[i for i in remaining if i not in suspects]]
            try:
                for group in filter(None, groups):
                    engine.max_batch_size = batch
                    engine.generate([requests[i] for i in group], on_result=seen, job=job)
                break
            except Stopped:
                raise
            except Exception as exc:  # noqa: BLE001 (every engine fault is judged here)
                tally.faults += 1
                active = [int(i) for i in engine.active_ids() if int(i) not in finished]
                active = active or [i for i in remaining if i not in finished]
                engine.reset()
                device.free_memory(engine.target.device)
                remaining = [i for i in remaining if i not in finished]
                if device.is_device_lost(exc):
                    raise device.DeviceLost(str(exc)) from exc
                error = f"{type(exc).__name__}: {exc}"[:2000]
                if device.is_out_of_memory(exc) and min(batch, len(active)) > 1:
                    batch = max(1, min(batch, len(active)) // 2)
                    log.warning("out of memory at %d rows (%s); retrying %d items at batch "
                                "size %d", len(active), error, len(remaining), batch)
                    continue
                log.warning("engine failure on items %s (%s); %d items left", active, error,
                            len(remaining), exc_info=not device.is_out_of_memory(exc))
                keeper.failed(active, error)
                for i in active:
                    attempts[i] += 1
                    suspects.add(i)
                    if attempts[i] >= limit[i]:
                        keeper.put(item_outcome(i, Result(id=i, error=error), hostname,
                                                started, utcnow()))
                        finished.add(i)
                        tally.failed += 1
                remaining = [i for i in remaining if i not in finished]
                if remaining:
                    time.sleep(pause)
                    pause = min(settings.retry_backoff_max, pause * 2)
    finally:
        engine.max_batch_size = full
    return tally


def item_outcome(index: int, res: Result, hostname: str, started: Any, finished: Any
                 ) -> Outcome:
    """What a result writes to its item: the output, or the error that stopped it."""
    if res.error:
        return Outcome.failure(index, storable(res.error), prompt_tokens=res.prompt_tokens,
                               counters=res.counters, worker=hostname, started_at=started,
                               finished_at=finished)
    return Outcome(index, ItemStatus.completed, output=storable(res.text),
                   token_ids=list(res.token_ids), finish_reason=res.finish_reason,
                   prompt_tokens=res.prompt_tokens, counters=res.counters, worker=hostname,
                   started_at=started, finished_at=finished)


def storable(text: str | None) -> str | None:
    """Text as every database stores it: PostgreSQL text cannot hold NUL, so NUL becomes
    U+FFFD (the token ids keep the exact output); a lone surrogate becomes U+FFFD too."""
    if not text:
        return text
    return _UNSTORABLE.sub("\ufffd", text)


_UNSTORABLE = re.compile("[\x00\ud800-\udfff]")
