"""Thin tasks: a chunk reference in → its pending items → the engine → outcomes out.

The same run_chunk serves the Celery task (one worker per GPU) and the embedded
`specq run` (in-process, chunk after chunk).
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from celery.signals import worker_init, worker_process_init
from pydantic import ValidationError
from sqlalchemy.exc import OperationalError, SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from configs.presets import get_preset
from configs.settings import get_settings
from db import repository as repo
from db.models import ItemStatus, JobStatus, utcnow
from db.session import session_factory
from worker.app import app
from worker.constants import GENERATE_TASK, WORKER_PAIR_ENV
from worker.engine.counters import Counters
from worker.engine.request import Request, Result
from worker.engine.speculative import SpeculativeEngine
from worker.pairs import Pair, load_pair

log = logging.getLogger(__name__)


@dataclass
class ChunkReport:
    job_id: int
    start: int
    end: int
    written: int = 0  # outcomes written by this run
    skipped: int = 0  # items already written (a redelivered chunk) or not pending
    cancelled: int = 0
    job_status: str = ""

    def as_dict(self) -> dict[str, Any]:
        return self.__dict__.copy()


# -- the pair, loaded once per worker process ------------------------------------------


@lru_cache(maxsize=1)
def worker_pair() -> Pair:
    """The pair this worker serves (SPECQ_WORKER_PAIR), loaded on first use only."""
    settings = get_settings()
    if not settings.worker_pair:
        raise RuntimeError(f"{WORKER_PAIR_ENV} is not set; start workers with specq worker --pair")
    return load_pair(get_preset(settings.worker_pair, settings.presets_file), settings)


@lru_cache(maxsize=1)
def worker_engine() -> SpeculativeEngine:
    return worker_pair().engine()


@worker_init.connect
@worker_process_init.connect
def _load_at_start(**_: Any) -> None:
    """Load the pair when the worker starts, before it takes any chunk, run one short
    generation so the first chunk does not pay the first call's set-up, and measure the
    step costs the adaptive draft length decides by."""
    if get_settings().worker_pair:
        t0 = time.perf_counter()
        pair = worker_pair()
        engine = worker_engine()
        engine.generate([Request(prompt="Hello", max_new_tokens=2)])
        engine.calibrate()
        log.info("pair %s loaded in %.1f s", pair.preset.name, time.perf_counter() - t0)


@app.task(name=GENERATE_TASK, bind=True, autoretry_for=(OperationalError,),
          retry_backoff=True, max_retries=8)
def generate_chunk(self, job_id: int, start: int, end: int) -> dict[str, Any]:
    settings = get_settings()
    report = run_chunk(
        sessions=session_factory(settings.sqlalchemy_url), engine=worker_engine(),
        pair=worker_pair().preset.name, job_id=job_id, start=start, end=end,
        hostname=self.request.hostname or socket.gethostname(),
    )
    return report.as_dict()


# -- the chunk ---------------------------------------------------------------------------


def run_chunk(
    *,
    sessions: sessionmaker[Session],
    engine: SpeculativeEngine,
    pair: str,
    job_id: int,
    start: int,
    end: int,
    hostname: str,
    on_item: Callable[[], None] | None = None,
) -> ChunkReport:
    """Generate the chunk's pending items and write their outcomes in one transaction."""
    report = ChunkReport(job_id, start, end)
    with sessions.begin() as s:
        job = repo.lock_job(s, job_id=job_id)
        if job is None:
            log.warning("job %s: not found; chunk [%d, %d) dropped", job_id, start, end)
            return report
        status = JobStatus(job.status)
        if status == JobStatus.cancelling:
            report.cancelled = repo.cancel_pending(s, job_id=job_id, start=start, end=end)
            report.job_status = repo.settle_job(s, job_id=job_id).value
            log.info("job %s: cancelling; chunk [%d, %d): %d items cancelled",
                     job_id, start, end, report.cancelled)
            return report
        if status.finished:  # e.g. a chunk redelivered after its job completed
            report.skipped = end - start
            report.job_status = status.value
            return report
        if job.pair != pair:
            raise RuntimeError(f"job {job_id} is for pair {job.pair!r}; this worker: {pair!r}")
        repo.start_job(s, job_id=job_id)
        params = dict(job.params)
        items = [(it.index, it.prompt, it.messages, it.params)
                 for it in repo.pending_items(s, job_id=job_id, start=start, end=end)]
    report.skipped = (end - start) - len(items)
    if items:
        outcomes = generate(engine, items, params, hostname, on_item)
    else:
        outcomes = []
    try:
        write(sessions, job_id, outcomes, report)
    except OperationalError:
        raise  # the database is unreachable: the task retries the chunk later
    except SQLAlchemyError as exc:  # outcomes the database refuses: the items say why
        log.exception("job %s: chunk [%d, %d): outcomes refused", job_id, start, end)
        error = f"could not store the outcome: {type(exc.orig or exc).__name__}: {exc.orig or exc}"
        write(sessions, job_id, [_outcome(o["index"], Result(id=o["index"], error=error),
                                          hostname, o["started_at"], o["finished_at"])
                                 for o in outcomes], report)
    log.info("job %s: chunk [%d, %d): %d written, %d skipped; job %s",
             job_id, start, end, report.written, report.skipped, report.job_status)
    return report


def write(sessions: sessionmaker[Session], job_id: int, outcomes: list[dict[str, Any]],
          report: ChunkReport) -> None:
    """The chunk's outcomes and the job's status, in one transaction under the job's lock."""
    with sessions.begin() as s:
        repo.lock_job(s, job_id=job_id)
        report.written = repo.write_outcomes(s, job_id=job_id, outcomes=outcomes)
        report.skipped += len(outcomes) - report.written
        report.job_status = repo.settle_job(s, job_id=job_id).value


def generate(
    engine: SpeculativeEngine,
    items: list[tuple[int, str | None, list | None, dict | None]],
    params: dict[str, Any],
    hostname: str,
    on_item: Callable[[], None] | None = None,
) -> list[dict[str, Any]]:
    """Run the engine over (index, prompt, messages, overrides) items; one outcome each.

    An item that fails (its request is invalid, or the engine reports an error for it) gets
    a failed outcome with its error; if the engine itself fails, every item does.
    """
    started = utcnow()
    finished: dict[int, Any] = {}
    outcomes: dict[int, dict[str, Any]] = {}
    requests = []
    for index, prompt, messages, overrides in items:
        try:
            requests.append(Request(id=index, prompt=prompt, messages=messages,
                                    **{**params, **(overrides or {})}))
        except ValidationError as exc:
            outcomes[index] = _outcome(index, Result(id=index, error=str(exc)), hostname,
                                       started, started)

    def seen(result: Result) -> None:
        finished[int(result.id)] = utcnow()
        if on_item:
            on_item()

    try:
        results = engine.generate(requests, on_result=seen)
    except Exception as exc:  # the whole chunk fails; its items say why
        log.exception("engine failed on %d items", len(requests))
        now = utcnow()
        results = [Result(id=r.id, error=f"{type(exc).__name__}: {exc}") for r in requests]
        finished = {int(r.id): now for r in requests}
    for res in results:
        index = int(res.id)
        outcomes[index] = _outcome(index, res, hostname, started, finished.get(index, utcnow()))
    return [outcomes[i] for i in sorted(outcomes)]


def _outcome(index: int, res: Result, hostname: str, started: Any, finished: Any) -> dict:
    c: Counters = res.counters
    text = None if res.error else _storable(res.text)
    return {
        "index": index,
        "status": (ItemStatus.failed if res.error else ItemStatus.completed).value,
        "output": text,
        "token_ids": None if res.error else list(res.token_ids),
        "finish_reason": res.finish_reason,
        "error": _storable(res.error),
        "prompt_tokens": res.prompt_tokens,
        "accepted_by_position": list(c.accepted_by_position),
        "steps_by_draft_length": list(c.steps_by_draft_length),
        "worker": hostname,
        "started_at": started,
        "finished_at": finished,
        **{name: getattr(c, name) for name in repo.COUNTER_COLUMNS},
    }


def run_inline(
    *, sessions: sessionmaker[Session], engine: SpeculativeEngine, pair: str, job_id: int,
    progress: bool = True,
) -> None:
    """The embedded mode: every chunk of the job, in this process, with a progress bar."""
    from tqdm import tqdm

    with sessions() as s:
        job = repo.get_job(s, job_id=job_id)
        chunks = job.chunks()
        done = job.total - repo.status_counts(s, job_id=job_id)[ItemStatus.pending.value]
    hostname = f"{socket.gethostname()} (embedded)"
    with tqdm(total=job.total, initial=done, desc=f"job {job_id}", unit="item",
              disable=not progress) as bar:
        for start, end in chunks:
            run_chunk(sessions=sessions, engine=engine, pair=pair, job_id=job_id, start=start,
                      end=end, hostname=hostname, on_item=lambda: bar.update(1))


def _storable(text: str | None) -> str | None:
    """Text as every database stores it: PostgreSQL text cannot hold NUL, so NUL becomes
    U+FFFD (the token ids keep the exact output)."""
    return text.replace("\x00", "\ufffd") if text else text
