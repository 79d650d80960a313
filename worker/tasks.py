"""Thin tasks: a chunk reference in → its pending items → the engine → outcomes out.

The same run_chunk serves the Celery task (one worker per GPU) and the embedded
`specq run` (in-process, chunk after chunk): open a run of the chunk, generate through
faults, close the run. What a run is, and the words of the job path, are worker/run.py's.
Engine failures are transient until they repeat (worker/attempts.py); a device that is
gone makes the worker exit.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path
from typing import Any, NoReturn

from celery import bootsteps
from sqlalchemy.orm import Session, sessionmaker

from specq.broker import connection, dispatch, presence
from specq.broker.app import app
from specq.broker.names import GENERATE_TASK, WORKER_PAIR_ENV
from specq.configs.presets import PairError, PresetError, UnknownPair, get_preset
from specq.configs.settings import Settings, get_settings
from specq.db import chunks
from specq.db import repository as repo
from specq.db.models import ItemStatus
from specq.db.session import session_factory
from specq.schema.generation import Request
from specq.worker import metrics, threads
from specq.worker.attempts import Stopped, generate_with_retries
from specq.worker.costs import CostCache, start_costs
from specq.worker.device import DeviceLost, is_device_lost
from specq.worker.engine.speculative import SpeculativeEngine
from specq.worker.pairs import Pair, cache_tokenizer, load_pair, resolve_device
from specq.worker.run import BrokerLives, ChunkReport, ChunkRun, Lives
from specq.worker.watch import ConsumerWatch

log = logging.getLogger(__name__)

EXIT_DEVICE_LOST = 75  # the worker's exit status when its device is unusable (EX_TEMPFAIL)
EXIT_START_FAILED = 1  # ... when its pair cannot be loaded for any other reason


# -- the pair, loaded once per worker process ------------------------------------------


def worker_pair(name: str | None = None) -> Pair:
    """The pair this process serves: ``name``, or the worker's (SPECQ_WORKER_PAIR); loaded
    on first use only."""
    return _loaded(name or _serving())


def worker_engine(name: str | None = None) -> SpeculativeEngine:
    """The engine over worker_pair(name), made once."""
    return _engine(name or _serving())


def _serving() -> str:
    name = get_settings().worker_pair
    if not name:
        raise PairError(f"{WORKER_PAIR_ENV} is not set; start workers with "
                        f"`specq worker --pair NAME`")
    return name


@lru_cache(maxsize=1)
def _loaded(name: str) -> Pair:
    settings = get_settings()
    return load_pair(get_preset(name, settings.presets_file), settings)


@lru_cache(maxsize=1)
def _engine(name: str) -> SpeculativeEngine:
    return _loaded(name).engine()


class PairStartUp(bootsteps.StartStopStep):
    """The pair loaded, warmed and calibrated before the worker consumes anything.

    A worker bootstep (broker/app.py adds it to the worker's blueprint): it starts after
    Celery has set up logging and before the consumer, the last step, takes a message. A
    pair that cannot start (a device this torch cannot use, a model that cannot be
    loaded) makes the worker exit, its error logged and kept where `specq status` finds
    it (broker/presence.py), without taking any chunk. Once the pair is ready the worker
    announces itself (broker/presence.py), writes the target's tokenizer where
    submitters look for it, and starts its reconciler thread.
    """

    label = "specq pair"

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        super().__init__(parent, **kwargs)
        self.background: list[Any] = []

    def start(self, parent: Any) -> None:
        settings = get_settings()
        hostname = parent.hostname
        try:
            pair = _serving()
            phases = start_up(settings, pair)
        except Exception as exc:  # noqa: BLE001 (anything that stops a load stops the worker)
            _exit_unstarted(settings, hostname, exc)
        log.info("pair %s ready in %.1f s (%s)", pair, sum(phases.values()),
                 ", ".join(f"{k} {v:.1f} s" for k, v in phases.items()))
        _cache_tokenizer(settings)
        if settings.metrics_port:
            _serve_metrics(settings, hostname)
        self.background.append(presence.Heartbeat(settings, pair, hostname).start())
        self.background.append(ConsumerWatch(settings, pair).start())
        _on_broker(settings, lambda r: presence.clear_start_failure(r, settings, pair),
                   "an earlier failed start is not cleared")
        if settings.reconcile_every > 0:
            from specq.broker.reconciler import Background

            self.background.append(Background(settings).start())

    def stop(self, parent: Any) -> None:
        for b in reversed(self.background):
            b.stop()
        self.background.clear()
        metrics.stop()


def _serve_metrics(settings: Settings, hostname: str) -> None:
    """Serve this worker's Prometheus metrics (worker/metrics.py); the engine reports its
    steps from now on (warm-up and calibration are not counted). A port taken costs the
    worker its metrics, said in its log, not its start."""
    preset = worker_pair().preset
    try:
        served = metrics.start(preset.name, preset.drafter, hostname, settings.metrics_port,
                               settings.metrics_host)
    except OSError as exc:
        log.error("metrics not served on %s:%d (%s)", settings.metrics_host,
                  settings.metrics_port, exc)
        return
    worker_engine().on_step = served.step


def start_up(settings: Settings, name: str | None = None) -> dict[str, float]:
    """Get a process ready to generate for the pair ``name`` (a worker's: SPECQ_WORKER_PAIR):
    its share of the host's threads, the pair loaded, one short generation so the first
    chunk does not pay the first call's set-up, and the step costs the adaptive draft
    length decides by measured. A worker and `specq run` start the same way. Returns the
    seconds of each phase: load, warm_up, calibrate (`specq bench-startup` reports them)."""
    name = name or _serving()
    clock = time.perf_counter()
    phases = {}

    def phase(name: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        phases[name], clock = now - clock, now

    threads.apply(settings.torch_threads, resolve_device(settings.device).type)
    worker_pair(name)
    phase("load")
    engine = worker_engine(name)
    engine.generate([Request(prompt="Hello", max_new_tokens=2)])
    phase("warm_up")
    _costs[name] = start_costs(engine, worker_pair(name).preset, settings.data_dir,
                               settings.calibration_budget)
    phase("calibrate")
    return phases


_costs: dict[str, CostCache] = {}  # pair -> its cost cache, once start_up has made it


def save_costs(name: str) -> None:
    """Keep the pair's step costs as its steps have refined them (worker/costs.py); a
    no-op for a pair this process did not start with start_up."""
    if name in _costs:
        _costs[name].save()


def _exit_unstarted(settings: Settings, hostname: str, exc: BaseException) -> NoReturn:
    """Log why the pair cannot start, leave it where `specq status` finds it, and exit:
    status 75 when the device failed (its supervisor may restart it), 1 otherwise."""
    code = EXIT_DEVICE_LOST if is_device_lost(exc) else EXIT_START_FAILED
    error = f"{type(exc).__name__}: {exc}"
    log.critical("pair %s cannot start on this worker: %s. The worker exits (status %d) "
                 "without taking any chunk.", settings.worker_pair, error, code,
                 exc_info=not isinstance(exc, PairError))
    if pair := settings.worker_pair:
        _on_broker(settings, lambda r: presence.record_start_failure(
            r, settings, pair, hostname, error),
            "the failed start is not recorded on the broker")
    raise SystemExit(code)


def _on_broker(settings: Settings, call: Callable[[Any], None], failed: str) -> None:
    """call(a Redis client on the broker), best effort: a broker away costs a note in
    `specq status`, not the worker its start (``failed`` is logged)."""
    try:
        client = connection.broker_client(settings)
        try:
            call(client)
        finally:
            client.close()
    except Exception as exc:  # noqa: BLE001 (the broker's errors vary by transport)
        log.warning("%s (%s)", failed, exc)


def _cache_tokenizer(settings: Settings) -> None:
    """Best effort: a data directory this worker cannot write costs submitters their
    prompt checks (they say so), not the worker its start."""
    try:
        folder = cache_tokenizer(worker_pair(), settings.data_dir)
        log.info("tokenizer for submitters' prompt checks in %s", folder)
    except Exception as exc:  # noqa: BLE001 (a full disk, a read-only mount, ...)
        log.warning("the tokenizer was not written to %s (%s: %s); submitters skip prompt "
                    "length checks unless it is cached there", settings.data_dir,
                    type(exc).__name__, exc)


def worker_sessions(settings: Settings) -> sessionmaker[Session]:
    """A worker's sessions: each call bounded by db_timeout, and a transaction the worker
    fell silent in (a stalled connection) ended by the server after as long, so its locks
    never block the run that takes the chunk over."""
    return session_factory(settings.sqlalchemy_url, settings.db_timeout,
                           hold=settings.db_timeout)


@app.task(name=GENERATE_TASK, bind=True)
def generate_chunk(self, job_id: int, start: int, end: int) -> dict[str, Any]:
    settings = get_settings()
    try:
        report = run_chunk(
            sessions=worker_sessions(settings),
            engine=worker_engine(), pair=worker_pair().preset.name, job_id=job_id,
            start=start, end=end,
            hostname=self.request.hostname or socket.gethostname(), settings=settings,
            send_next=True, lives=BrokerLives(settings, worker_pair().preset.name),
        )
        save_costs(worker_pair().preset.name)
    except DeviceLost as exc:
        log.critical("the device is unusable (%s): this worker exits (status %d) for its "
                     "supervisor to restart it; chunk [%d, %d) of job %d goes to another",
                     exc.__cause__ or exc, EXIT_DEVICE_LOST, start, end, job_id)
        logging.shutdown()
        os._exit(EXIT_DEVICE_LOST)
    except Exception as exc:
        _note_failure(settings, job_id, start, end, self.request.hostname, exc)
        raise
    return report.as_dict()


def _note_failure(settings: Settings, job_id: int, start: int, end: int,
                  hostname: str | None, exc: Exception) -> None:
    """A chunk that failed outside the engine (whose faults are items' attempts): keep why
    on its job, where `specq status` shows it. The reconciler sends the chunk again, up to
    max_chunk_runs sends in all (broker/reconciler.py)."""
    first = str(exc).splitlines()[0] if str(exc) else ""
    error = f"chunk [{start}, {end}) failed on worker {hostname}: {type(exc).__name__}: {first}"
    try:
        with worker_sessions(settings).begin() as s:
            repo.note_job_error(s, job_id=job_id, error=error)
    except Exception as err:  # noqa: BLE001 (the database away: the log says it)
        log.warning("job %d: the failure is not recorded (%s)", job_id, err)


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
    settings: Settings | None = None,
    on_item: Callable[[], object] | None = None,
    send_next: bool = False,
    lives: Lives | None = None,
) -> ChunkReport:
    """One run of the chunk (worker/run.py): open it, generate its pending items through
    faults, close it. Database outages are waited out (db_patience). Raises DeviceLost when
    the device is gone (the outcomes finished so far are written and the lease given back
    first). ``send_next`` (the Celery task): the chunk's first run sends its job's next
    chunk, taking the turn this one's message had. ``lives``: what a takeover knows of
    earlier runs (BrokerLives, a worker's)."""
    settings = settings or get_settings()
    run = ChunkRun(sessions=sessions, settings=settings, pair=pair, job_id=job_id,
                   start=start, end=end, hostname=hostname,
                   price=device_hour_price(settings, pair), lives=lives)
    work = run.open(send_next=send_next)
    if work is None:
        return run.report
    _send_next(work.turn, sessions, settings, run.where)
    tally = None
    try:
        tally = generate_with_retries(engine, work.items, work.params, hostname, run,
                                      settings, on_item, job=job_id)
    except Stopped:
        pass  # the lease went to another worker or was given up, or the job is cancelling
    finally:
        report = run.close(tally)
    metrics.active().chunks_run.inc()
    log.info("%s: %d written, %d skipped, %d failed, %d faults%s; job %s", run.where,
             report.written, report.skipped, report.failed, report.faults,
             f", {report.note}" if report.note else "", report.job_status)
    return report


def device_hour_price(settings: Settings, pair: str) -> float | None:
    """What an hour of this worker's device costs: SPECQ_DEVICE_HOUR_PRICE (its class's), or
    the pair preset's; None where neither says."""
    if settings.device_hour_price is not None:
        return settings.device_hour_price
    extra = settings.presets_file
    try:  # read once per version of the presets file, not once per chunk
        stamp = Path(extra).stat().st_mtime_ns if extra else None
    except OSError:
        stamp = None
    return _preset_price(pair, extra, stamp)


@lru_cache(maxsize=16)
def _preset_price(pair: str, extra: Path | None, stamp: int | None) -> float | None:
    try:
        return get_preset(pair, extra).device_hour_price
    except (UnknownPair, PresetError):  # a pair no preset names (a test's): unpriced
        return None


def _send_next(refs: list[chunks.ChunkRef], sessions: sessionmaker[Session],
               settings: Settings, where: str) -> None:
    """Send the job's next chunk (its turn taken with this chunk's lease). A broker error
    is logged, and the chunk waits its turn again: the reconciler sends it."""
    try:
        dispatch.deliver(app, sessions, refs, settings)
    except Exception as exc:  # noqa: BLE001 (the broker's own errors vary by transport)
        log.warning("%s: the job's next chunk was not sent (%s: %s); the reconciler sends "
                    "it", where, type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")


def run_inline(
    *, sessions: sessionmaker[Session], engine: SpeculativeEngine, pair: str, job_id: int,
    progress: bool = True, settings: Settings | None = None,
) -> None:
    """The embedded mode: every chunk of the job, in this process, with a progress bar."""
    from tqdm import tqdm

    with sessions() as s:
        job = repo.require_job(s, job_id=job_id)
        chunk_list = chunks.ranges(s, job_id=job_id)
        done = job.total - repo.status_counts(s, job_id=job_id)[ItemStatus.pending.value]
    hostname = f"{socket.gethostname()} (embedded)"
    with tqdm(total=job.total, initial=done, desc=f"job {job_id}", unit="item",
              disable=not progress) as bar:
        for start, end in chunk_list:
            run_chunk(sessions=sessions, engine=engine, pair=pair, job_id=job_id, start=start,
                      end=end, hostname=hostname, settings=settings,
                      on_item=lambda: bar.update(1))
            save_costs(pair)
