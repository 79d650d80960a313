"""Chunk messages: sending them to a pair's queue, and reading which ones the broker holds.

A message is a reference, (job id, start, end) as JSON; the database says what is left to
do. Every sender (a submit, a worker starting a chunk, `specq retry`, the reconciler)
marks its chunks sent in the database first (chunks.take_unsent, reopen, mark_sent), then
``deliver`` sends them: a message the broker did not take leaves no chunk marked sent.
The reconciler (broker/reconciler.py) reads the broker to tell a chunk whose message is
waiting from one whose message was lost. Reading the broker is specific to Redis, the
broker specq runs on (kombu's layout: a list per queue and priority step, and an
``unacked`` hash of delivered messages indexed by delivery time in ``unacked_index``, every
key behind the deployment's prefix: broker/names.py: broker_keyprefix).
"""

from __future__ import annotations

import base64
import json
import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, TypeVar, cast

import redis
from celery import Celery
from kombu.transport.redis import PRIORITY_STEPS, Channel
from sqlalchemy.orm import Session, sessionmaker

from specq.broker.names import GENERATE_TASK, PRIORITIES, broker_keyprefix
from specq.configs.settings import Settings
from specq.db import chunks
from specq.db.chunks import ChunkRef

log = logging.getLogger(__name__)
T = TypeVar("T")

# each publish may be retried this often (kombu's retry policy), within broker_timeout
_PUBLISH_RETRY = {"max_retries": 2, "interval_start": 0.2, "interval_step": 0.5,
                  "interval_max": 1.0}


def deliver(app: Celery, sessions: sessionmaker[Session], refs: list[ChunkRef],
            settings: Settings, priority: int | None = None) -> None:
    """Send the messages of chunks already marked sent. If the broker does not take them
    (every call bounded: broker_timeout), their marks are undone, so they wait their turn
    again and the reconciler sends them once the broker is back; the error is raised.
    A chunk of a job with no queue (run in-process: `specq run`) is never sent."""
    refs = [r for r in refs if r.queue is not None]
    if not refs:
        return
    try:
        bounded(lambda: send(app, refs, settings, priority),
                seconds=settings.broker_timeout * 3 + len(refs) / 1000)
    except Exception:
        with sessions.begin() as s:
            chunks.unsend(s, refs=refs)
        raise


def bounded(call: Callable[[], T], seconds: float) -> T:
    """call() in a thread, waited for ``seconds`` at most: TimeoutError after that (a
    broker that accepts connections but never answers must not hang the caller)."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = call()
        except BaseException as exc:  # noqa: BLE001 (handed to the caller)
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        raise TimeoutError(f"no answer within {seconds:.0f} s")
    if "error" in box:
        raise box["error"]
    return box["value"]


def send(app: Celery, refs: Iterable[ChunkRef], settings: Settings,
         priority: int | None = None) -> int:
    """Publish one task message per chunk, on its job's queue, at its job's priority
    (or ``priority``); returns how many. Raises the broker's error if it cannot be
    reached (within broker_timeout per call)."""
    n = 0
    with app.producer_or_acquire() as producer:
        for ref in refs:
            app.send_task(GENERATE_TASK, args=[ref.job_id, ref.start, ref.end],
                          queue=ref.queue, producer=producer,
                          priority=PRIORITIES[ref.priority] if priority is None else priority,
                          retry=True, retry_policy=_PUBLISH_RETRY)
            n += 1
    return n


def queue_keys(queue: str, settings: Settings) -> list[str]:
    """The Redis lists of ``queue``, one per priority step, highest priority first."""
    prefix = broker_keyprefix(settings)
    return [f"{prefix}{queue}{Channel.sep}{step}" if step else f"{prefix}{queue}"
            for step in PRIORITY_STEPS]


def held(client: redis.Redis, queues: Iterable[str], recent: float,
         settings: Settings) -> set[tuple[int, int]]:
    """(job id, start) of every chunk message waiting on these queues, or delivered to a
    worker less than ``recent`` seconds ago (it may not have taken its lease yet)."""
    out: set[tuple[int, int]] = set()
    for queue in queues:
        for key in queue_keys(queue, settings):
            for raw in client.lrange(key, 0, -1):
                ref = _chunk_of(raw)
                if ref:
                    out.add(ref)
    prefix = broker_keyprefix(settings)
    tags = cast(list[bytes], client.zrangebyscore(  # members only: no scores asked
        prefix + Channel.unacked_index_key, time.time() - recent, "+inf"))
    if tags:
        for message in client.hmget(prefix + Channel.unacked_key, tags):
            try:
                ref = _chunk_of(json.loads(message)[0]) if message else None
            except (ValueError, TypeError, IndexError):
                ref = None
            if ref:
                out.add(ref)
    return out


def _chunk_of(raw: bytes | str | dict) -> tuple[int, int] | None:
    """(job id, start) of a kombu message of GENERATE_TASK, else None."""
    try:
        msg = json.loads(raw) if isinstance(raw, (bytes, str)) else raw
        if msg.get("headers", {}).get("task") != GENERATE_TASK:
            return None
        body = msg["body"]
        if msg.get("properties", {}).get("body_encoding") == "base64":
            body = base64.b64decode(body)
        args = json.loads(body)[0]
        return int(args[0]), int(args[1])
    except (ValueError, TypeError, KeyError, IndexError, AttributeError):
        log.debug("unreadable message on the broker: %.200r", raw)
        return None
