"""The Python client: submit a job, follow it, read its results and metrics, cancel it.

    client = Client()                                   # URLs from SPECQ_* settings
    job = client.submit("prompts.jsonl", pair="tiny", max_new_tokens=64)
    job.wait(progress=True)
    for item in job.results(): ...
    print(job.metrics().as_dict())
"""

from __future__ import annotations

import logging
import math
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, fields
from datetime import datetime
from functools import cached_property
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError
from sqlalchemy.orm import Session, sessionmaker

from specq.api.inputs import (
    MAX_PROBLEMS,
    ArgumentError,
    Entry,
    InputError,
    Refused,
    Source,
    check_count,
    check_job_id,
    describe,
    open_source,
    parse_entries,
)
from specq.api.tokenizer import (
    PromptTokenizer,
    TokenizerUnavailable,
    grammar_problem,
    prompt_tokenizer,
    target_context,
    unchecked_note,
)
from specq.broker.names import PRIORITIES, queue_name
from specq.configs.presets import PairPreset, UnknownPair, get_preset
from specq.configs.settings import Settings, get_settings, mask_url
from specq.db import batches, chunks
from specq.db import repository as repo
from specq.db.models import ItemStatus, JobStatus, as_utc
from specq.db.session import migrate, session_factory
from specq.schema.counters import ARRAYS, SCALARS, Counters
from specq.schema.counters import kinds as counter_kinds
from specq.schema.errors import NotFound
from specq.schema.generation import RequestError, SamplingParams, fits_by_size
from specq.schema.grammar import grammar

if TYPE_CHECKING:
    from celery import Celery

log = logging.getLogger(__name__)
RUNNABLE = (JobStatus.queued.value, JobStatus.in_progress.value)  # waiting for workers


@dataclass
class _Check:
    """What checking a submission found besides its problems."""

    unchecked: str | None = None  # why prompt lengths were not checked


def _defaults(sampling: dict[str, Any]) -> dict[str, Any]:
    """A job's SamplingParams as stored; InputError naming each bad one."""
    try:
        return SamplingParams(**sampling).model_dump()
    except ValidationError as exc:
        raise InputError([f"sampling parameter {p}" for p in describe(exc)]) from None


@dataclass
class JobState:
    """Where a job stands: its status and item counts, and a note when nothing serves it."""

    id: int
    status: str
    pair: str
    total: int
    completed: int
    failed: int
    cancelled: int
    pending: int
    created_at: datetime | None = None
    finished_at: datetime | None = None
    error: str | None = None
    note: str | None = None
    # faults its chunks met (engine exceptions, workers that died with items in flight), the
    # earliest one's error, and the items that ran alone after one (at batch size 1: slow)
    engine_faults: int = 0
    first_fault: str | None = None
    items_isolated: int = 0

    def __post_init__(self) -> None:
        self.created_at, self.finished_at = as_utc(self.created_at), as_utc(self.finished_at)

    @property
    def finished(self) -> bool:
        return JobStatus(self.status).finished

    @property
    def ended(self) -> int:
        """Items that ended: completed, failed or cancelled (no longer pending)."""
        return self.total - self.pending

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for k in ("created_at", "finished_at"):
            d[k] = d[k].isoformat() if d[k] else None
        return d


@dataclass
class JobSummary(JobState):
    """A job as `specq jobs` lists it: its state, how its pair drafts, and its figures, all
    read from the view job_metrics (db/views.py; figures defined in SQL, None where the view
    says NULL). The figures are those of JobMetrics, tested equal on both databases."""

    started_at: datetime | None = None
    drafter: str | None = None
    draft_model: str | None = None
    draft_length: int | None = None
    draft_mode: str | None = None
    spec: str | None = None
    schedule: str | None = None
    new_tokens: int = 0
    wall_time: float | None = None
    acceptance_rate: float | None = None
    mean_acceptance_length: float | None = None
    mean_draft_length: float | None = None
    tokens_per_pass: float | None = None
    tokens_per_second: float | None = None
    engine_tokens_per_second: float | None = None
    estimated_speedup: float | None = None
    # what it cost (job_metrics; docs/metrics.md): tokens in, device time held, what
    # speculation saved, the price of that time where its workers had one
    prompt_tokens: int = 0
    worker_seconds: float = 0.0
    passes_saved: int = 0
    device_seconds_saved: float | None = None
    estimated_cost: float | None = None
    forced_acceptance_rate: float | None = None  # of the grammar's drafts (shaped rows)
    tenant: str | None = None  # whose batch it runs (the HTTP door); None: client or CLI

    def __post_init__(self) -> None:
        super().__post_init__()
        self.started_at = as_utc(self.started_at)

    @classmethod
    def from_row(cls, row: Any) -> JobSummary:
        """From a job_metrics row (a mapping of its columns)."""
        names = {f.name for f in fields(cls)} - {"id", "note", "tenant"}
        values = {k: row[k] for k in names}
        for name in ("acceptance_rate", "mean_acceptance_length", "mean_draft_length",
                     "tokens_per_pass", "tokens_per_second", "engine_tokens_per_second",
                     "estimated_speedup", "forced_acceptance_rate", "wall_time",
                     "device_seconds_saved", "estimated_cost"):
            values[name] = None if values[name] is None else float(values[name])
        values["worker_seconds"] = float(values["worker_seconds"])
        values["prompt_tokens"] = int(values["prompt_tokens"])
        values["passes_saved"] = int(values["passes_saved"])
        return cls(id=row["job_id"], **values)

    def as_dict(self) -> dict[str, Any]:
        d = super().as_dict()
        d["started_at"] = self.started_at.isoformat() if self.started_at else None
        return d


@dataclass(kw_only=True)
class JobMetrics(Counters):
    """A job's counters (schema/counters.py) summed over its items in SQL, and its item
    counts; every rate is derived from them (acceptance rate and mean acceptance length
    as for one request)."""

    job_id: int
    status: str
    total: int
    completed: int
    failed: int
    cancelled: int
    pending: int
    wall_time: float | None  # first item start → last item finish
    draft_length_over_time: list[float] = field(default_factory=list)  # mean g, by 10ths
    engine_faults: int = 0  # as JobState's
    first_fault: str | None = None
    items_isolated: int = 0
    # (seconds since the first chunk started, new tokens/s) per interval, up to 20
    throughput_over_time: list[tuple[float, float]] = field(default_factory=list)
    # how the job's pair drafts (job_metrics), for titles
    pair: str | None = None
    drafter: str | None = None
    draft_model: str | None = None
    draft_mode: str | None = None
    draft_length: int | None = None
    # what it cost: tokens in, the device time its chunks' runs held (summed over workers,
    # a killed worker's up to its last write or heartbeat), that time priced where its
    # workers had a price per device-hour (SPECQ_DEVICE_HOUR_PRICE)
    prompt_tokens: int = 0
    worker_seconds: float = 0.0
    estimated_cost: float | None = None

    @property
    def passes_saved(self) -> int:
        """Target passes speculation saved: a plain decoder makes one per token."""
        return self.new_tokens - self.target_passes

    @property
    def device_seconds_saved(self) -> float | None:
        """The device time those passes saved at the measured cost of a pass (verify time
        per target pass), less the drafting that bought them; negative where drafting cost
        more than it saved."""
        if not self.target_passes:
            return None
        return self.passes_saved * self.verify_time / self.target_passes - self.draft_time

    @property
    def mean_draft_length(self) -> float | None:
        steps = sum(self.steps_by_draft_length)
        return sum(g * n for g, n in enumerate(self.steps_by_draft_length)) / steps if steps \
            else None

    @property
    def estimated_speedup(self) -> float | None:
        """Tokens per target pass x the verify share of engine time: the speedup over plain
        decoding if a plain step cost what a verify pass did (Thm 3.8's flat-cost view;
        `specq bench` measures the real one side by side)."""
        busy = self.draft_time + self.verify_time
        if not self.target_passes or not busy:
            return None
        return self.new_tokens / self.target_passes * self.verify_time / busy

    @property
    def acceptance_by_position(self) -> list[float]:
        """Share of draft steps whose i-th draft token was accepted."""
        return [n / self.draft_steps for n in self.accepted_by_position] if self.draft_steps else []

    @property
    def tokens_per_pass(self) -> float | None:
        """New tokens per target pass (the view's tokens_per_pass): 1 without drafts."""
        return self.new_tokens / self.target_passes if self.target_passes else None

    @property
    def tokens_per_second(self) -> float | None:
        return self.new_tokens / self.wall_time if self.wall_time else None

    @property
    def engine_tokens_per_second(self) -> float | None:
        """Tokens per second of drafting + verifying time (the engine's own throughput)."""
        busy = self.draft_time + self.verify_time
        return self.new_tokens / busy if busy else None

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for name in ("acceptance_rate", "mean_acceptance_length", "acceptance_by_position",
                     "tokens_per_pass", "tokens_per_second", "engine_tokens_per_second",
                     "mean_draft_length", "estimated_speedup", "passes_saved",
                     "device_seconds_saved",
                     "forced_acceptance_rate", "mean_drafts_verified", "verified_per_token"):
            d[name] = getattr(self, name)
        return d


@dataclass
class ItemResult:
    """One item's outcome, as stored, and what was asked for: the prompt or messages and
    the line's own sampling parameters (None where the line gave none, or where results()
    was asked not to read them). ``custom_id`` is the one submitted, or request-INDEX for an
    item submitted without one (a plain prompt): `item_id`."""

    index: int
    custom_id: str
    status: str
    output: str | None
    finish_reason: str | None
    error: str | None
    prompt_tokens: int | None
    counters: dict[str, Any]
    worker: str | None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    params: dict[str, Any] | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


INPUT_COLUMNS = ("prompt", "messages", "params")  # what a line asked for, as stored


GENERATED_ID = re.compile(r"request-(0|[1-9][0-9]*)")  # item_id's for an item without one


def item_id(custom_id: str | None, index: int) -> str:
    """An item's id in every result: its custom_id, or request-INDEX when it was submitted
    without one (a plain prompt), as OpenAI Batch output lines need one per request. Stable:
    the index is the item's place in the input, 0-based."""
    return custom_id if custom_id is not None else f"request-{index}"


class Client:
    """Submits jobs and reads them back; the database and broker come from ``settings``."""

    def __init__(self, settings: Settings | None = None, *, auto_migrate: bool = False) -> None:
        self.settings = settings or get_settings()
        self.sessions: sessionmaker[Session] = session_factory(self.settings.sqlalchemy_url)
        if auto_migrate:
            migrate(self.settings.sqlalchemy_url)

    @cached_property
    def celery(self) -> Celery:
        from specq.broker.app import make_app  # the broker side, when a call needs it

        return make_app(self.settings, tasks=False)

    # -- submission -----------------------------------------------------------------

    def submit(
        self,
        source: Source,
        *,
        pair: str,
        chunk_size: int | None = None,
        enqueue: bool = True,
        origin: dict[str, Any] | None = None,
        priority: str = "normal",
        within: Callable[[Session, int], None] | None = None,
        **sampling: Any,
    ) -> Job:
        """Validate the whole spec, store the job and its items, then send its chunks.

        ``source``: a JSONL file (str or path), or an iterable of prompts (strings, chat
        message lists, or dicts shaped like JSONL lines). ``sampling``: the job's default
        SamplingParams, which a line's own parameters override. ``origin``: the job columns
        of a synthesis run (spec, schedule, synthesis). ``priority``: high, normal or low;
        a job's waiting chunks go before those of jobs of lower priority on the same
        queue (jobs of one priority take turns). Raises InputError naming every problem
        found (up to MAX_PROBLEMS) before anything is stored. ``enqueue=False``: the
        caller runs the job in-process (`specq run`: worker/tasks.py run_inline); it has
        no queue, so no worker or reconciler of a fleet on the same database touches it.
        ``within(session, job_id)``: more rows that belong with the job (the HTTP door's
        batch and files), written in the job's own transaction before it commits; what it
        raises rolls the job back. The chunks are sent only after that commit.
        """
        t0 = time.perf_counter()
        if not isinstance(priority, str) or priority not in PRIORITIES:
            raise InputError([f"priority: {priority!r} is not one of "
                              f"{', '.join(PRIORITIES)}"])
        preset = self._preset(pair)
        defaults = _defaults(sampling)
        chunk_size = (self.settings.chunk_size if chunk_size is None
                      else check_count("chunk_size", chunk_size))
        name, entries = open_source(source)
        check = _Check()
        # one pass: each entry is checked and stored as it is read, in the transaction that
        # makes the job; a problem anywhere rolls it all back (nothing stored)
        with self.sessions.begin() as s:
            job = repo.create_job(s, pair=preset.name, params=defaults, chunk_size=chunk_size,
                                  source=name,
                                  queue=queue_name(preset.name, self.settings) if enqueue
                                  else None,
                                  origin=origin, drafting=preset.drafting(),
                                  priority=priority)
            stored = repo.insert_items(s, job_id=job.id,
                                       rows=self._checked(entries, defaults, preset, check,
                                                          frozenset(sampling)))
            if stored == 0:
                raise InputError([f"{name or 'prompts'}: no prompts"])
            unchecked = check.unchecked
            job.total = stored
            job.status = JobStatus.queued.value
            chunks.insert_chunks(s, job_id=job.id, total=stored, chunk_size=chunk_size)
            # its first turn on the queue, taken as it is stored: no reconciler sees these
            # chunks waiting and sends them first
            turn = (chunks.take_unsent(s, job_id=job.id, n=self.settings.dispatch_window)
                    if enqueue else [])
            if within is not None:
                within(s, job.id)
        log.info("job %d: %d items checked and stored in %.2f s", job.id, stored,
                 time.perf_counter() - t0)
        handle = Job(self, job.id)
        handle.unchecked = unchecked
        if unchecked:
            log.info("job %d: %s", job.id, unchecked)
        if enqueue:
            handle.deliver(turn)
        return handle

    def check(self, source: Source, *, pair: str, **sampling: Any) -> None:
        """Check ``source`` as `submit` does, storing nothing: InputError naming every
        problem found (up to MAX_PROBLEMS), or None when submit would take it."""
        preset = self._preset(pair)
        defaults = _defaults(sampling)
        _, entries = open_source(source)
        for _ in self._checked(entries, defaults, preset, _Check(), frozenset(sampling)):
            pass

    def _preset(self, pair: str) -> PairPreset:
        try:
            return get_preset(pair, self.settings.presets_file)
        except UnknownPair as exc:
            raise InputError([f"pair: {exc}"]) from None

    def _checked(self, entries: Any, defaults: dict[str, Any], preset: PairPreset,
                 check: _Check, given: frozenset[str] = frozenset()
                 ) -> Iterator[dict[str, Any]]:
        """Each entry checked, the item rows of good ones (numbered in order) while no
        entry was bad; at the end, or at MAX_PROBLEMS, InputError naming every problem.
        ``check.unchecked``: why prompt lengths were not checked (None when they were). The
        target's tokenizer is loaded only when a prompt may not fit by its size alone, and
        only from files on this machine (api/tokenizer.py)."""
        try:
            context: int | None = target_context(preset, self.settings)
        except TokenizerUnavailable as exc:
            context, check.unchecked = None, unchecked_note(preset, exc)
        most = defaults.get("max_new_tokens") if "max_new_tokens" in given else None
        if context is not None and isinstance(most, int) and most >= context:
            raise InputError([f"sampling parameter max_new_tokens: {most} leaves no room for "
                              f"a prompt in the model's context of {context} tokens"])
        tokenizer: PromptTokenizer | None = None
        problems: list[str] = []
        seen: dict[str, str] = {}
        unnamed = bytearray()  # per item: 1 when it has no custom_id (its id: request-INDEX)
        for index, (where, got) in enumerate(parse_entries(entries, defaults, given)):
            if isinstance(got, Refused):
                problems.append(got.problem)
                cid = got.custom_id
            else:
                cid = got.row["custom_id"]
            if cid is not None:  # taken by a bad entry too
                if cid in seen:
                    problems.append(f"{where}: custom_id: {cid!r} is already used at "
                                    f"{seen[cid]}")
                seen[cid] = where
            if isinstance(got, Entry):
                unnamed.extend(b"\0" * (index + 1 - len(unnamed)))
                unnamed[index] = cid is None
                try:
                    if context is not None and not fits_by_size(got.request, context):
                        tokenizer = tokenizer or prompt_tokenizer(preset, self.settings)
                        tokenizer.encode(got.request, context)
                    if context is not None and grammar(got.request.response_format):
                        problem = grammar_problem(preset, self.settings)
                        if problem:
                            problems.append(f"{where}: response_format: {problem}")
                except RequestError as exc:  # named as the line names the field
                    name, rest = got.names.get(exc.field), str(exc).partition(": ")[2]
                    if name:
                        problems.append(f"{where}: body.{name}: {rest}")
                    elif exc.field in given and exc.field not in (got.row["params"] or {}):
                        problems.append(f"{where}: {exc.field} (the job's default): {rest}")
                    elif exc.field in SamplingParams.model_fields and exc.field not in (
                            got.row["params"] or {}):  # nobody set it: say whose it is
                        default = SamplingParams.model_fields[exc.field].default
                        problems.append(f"{where}: {exc.field} (specq's default, {default}; "
                                        f"set it on the line or for the job): {rest}")
                    else:
                        problems.append(f"{where}: {exc}")
                except TokenizerUnavailable as exc:
                    context, check.unchecked = None, unchecked_note(preset, exc)
                if not problems:
                    yield dict(got.row, index=index)
            if len(problems) >= MAX_PROBLEMS:
                raise InputError(problems, truncated=True)
        for cid, where in seen.items():  # an id the results give an item without one
            generated = GENERATED_ID.fullmatch(cid)
            at = int(generated.group(1)) if generated else -1
            if 0 <= at < len(unnamed) and unnamed[at]:
                problems.append(f"{where}: custom_id: {cid!r} is the id the results give "
                                f"the input's request at index {at} (its request {at + 1}, "
                                f"counted from 1), which has none: their results could not "
                                f"be told apart")
        if problems:
            raise InputError(problems[:MAX_PROBLEMS], truncated=len(problems) > MAX_PROBLEMS)

    # -- reading --------------------------------------------------------------------

    def retry(self, job_id: int) -> list[int]:
        """Send a job's failed items back to pending (attempts kept) and their chunks to
        the workers; returns their indices."""
        return self.job(job_id).retry()

    def job(self, job_id: int) -> Job:
        """A handle on a stored job; NotFound (a KeyError) if there is none (ArgumentError:
        not an id)."""
        job_id = check_job_id(job_id)
        with self.sessions() as s:
            if repo.get_job(s, job_id=job_id) is None:
                raise NotFound(f"job {job_id}: not found")
        return Job(self, job_id)

    def jobs(self, limit: int = 50, schedule: str | None = None) -> list[JobSummary]:
        """The latest jobs, newest first (only one beat schedule's runs if ``schedule``),
        with how each drafts and its figures (one query of the view job_metrics), and the
        tenant of those made over HTTP."""
        check_count("limit", limit, error=ArgumentError)  # as the command's --limit
        with self.sessions() as s:
            ids = repo.latest_job_ids(s, limit=limit, schedule=schedule)
            rows = repo.job_figures(s, job_ids=ids)
            tenants = batches.job_tenants(s, job_ids=ids)
        jobs = [JobSummary.from_row(r) for r in rows]
        for j in jobs:
            j.tenant = tenants.get(j.id)
        return jobs

    def workers_for(self, pair: str) -> list[str] | None:
        """Hostnames of the live workers serving ``pair``; None if the broker cannot be
        reached. A worker is listed once its pair is loaded and warm, for as long as it
        lives, busy or not (broker/presence.py): waiting for a name here waits for a
        worker that is ready to take chunks."""
        serving = self._serving(pair)
        return None if serving is None else serving[0]

    def _serving(self, pair: str) -> tuple[list[str], str | None] | None:
        """(live workers of ``pair``, why the last one that tried could not start), or
        None when the broker cannot be reached: one connection, every call bounded by
        broker_timeout."""
        import redis

        from specq.broker import presence
        from specq.broker.connection import broker_client

        try:
            client = broker_client(self.settings)
            try:
                workers = presence.present(client, self.settings, pair)
                failure = None if workers else presence.start_failure(client, self.settings,
                                                                       pair)
                return workers, failure
            finally:
                client.close()
        except (redis.RedisError, OSError) as exc:
            log.warning("broker %s: %s", mask_url(self.settings.broker_url), exc)
            return None

    def serving_note(self, pair: str) -> str | None:
        """Why nothing may run ``pair``'s chunks now (no live worker, a failed start, no
        broker), or None."""
        serving = self._serving(pair)
        if serving is None:
            return "the broker cannot be reached"
        workers, failure = serving
        if workers:
            return None
        queue = queue_name(pair, self.settings)
        note = (f"no worker is consuming queue {queue!r}; start one with "
                f"`specq worker --pair {pair}`")
        return f"{note} ({failure})" if failure else note


class Job:
    """A handle on one stored job."""

    def __init__(self, client: Client, job_id: int) -> None:
        self.client = client
        self.id = job_id
        self.enqueue_error: str | None = None  # why the last enqueue() sent nothing
        self.unchecked: str | None = None  # why submit() did not check prompt lengths

    def __repr__(self) -> str:
        return f"Job({self.id})"

    def enqueue(self) -> bool:
        """Send the job's first chunks (SPECQ_DISPATCH_WINDOW of them) to the pair's
        queue: references only, never prompts. Each chunk a worker starts sends the next.

        Returns False, with a warning, when the broker cannot be reached (every call is
        bounded by broker_timeout): the job stays stored and queued, and the reconciler
        (any worker's, the beat's, or `specq reconcile JOB`) sends its chunks once the
        broker is back.
        """
        with self.client.sessions.begin() as s:
            refs = chunks.take_unsent(s, job_id=self.id, n=self.client.settings.dispatch_window)
        return self.deliver(refs)

    def deliver(self, refs: list[chunks.ChunkRef]) -> bool:
        """Send the messages of the job's chunks whose turn was taken (enqueue); False, with
        a warning, when the broker cannot be reached (see enqueue)."""
        from specq.broker import dispatch

        settings = self.client.settings
        try:
            dispatch.deliver(self.client.celery, self.client.sessions, refs, settings)
        except Exception as exc:  # noqa: BLE001 (the broker's own errors vary by transport)
            self.enqueue_error = (
                f"the broker at {mask_url(settings.broker_url)} cannot be reached "
                f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); "
                f"job {self.id} is stored and its chunks will be sent when the broker is back "
                f"(by a worker's or the beat's reconciler, or `specq reconcile {self.id}`)")
            log.warning("job %d: %s", self.id, self.enqueue_error)
            return False
        log.info("job %d: its first %d chunks sent", self.id, len(refs))
        return True

    def status(self, check_workers: bool = True) -> JobState:
        with self.client.sessions() as s:
            job = repo.get_job(s, job_id=self.id)
            if job is None:
                raise NotFound(f"job {self.id}: not found")
            counts = repo.status_counts(s, job_id=self.id)
            faults = chunks.faults(s, job_id=self.id)
        state = JobState(
            id=job.id, status=job.status, pair=job.pair, total=job.total,
            completed=counts[ItemStatus.completed.value], failed=counts[ItemStatus.failed.value],
            cancelled=counts[ItemStatus.cancelled.value], pending=counts[ItemStatus.pending.value],
            created_at=job.created_at, finished_at=job.finished_at, error=job.error,
            engine_faults=faults[0], first_fault=faults[1], items_isolated=faults[2],
        )
        notes = []
        if check_workers and state.status in RUNNABLE and state.pending:
            notes.append(self.client.serving_note(job.pair))
        if state.error and not state.finished:  # kept by a worker a chunk failed on
            notes.append(f"a chunk of this job failed on a worker (error); a failed chunk "
                         f"is sent again, {self.client.settings.max_chunk_runs} times at "
                         f"most (SPECQ_MAX_CHUNK_RUNS), then its pending items fail")
        state.note = "; ".join(n for n in notes if n) or None
        return state

    def wait(
        self, progress: bool = False, poll: float = 0.5, timeout: float | None = None
    ) -> JobState:
        """Block until the job is completed, failed or cancelled; returns its last state.
        ``progress=True`` draws a progress bar on stderr (none by default: a library call
        prints nothing unasked); ``timeout`` seconds, then TimeoutError."""
        if not isinstance(poll, (int, float)) or not 0 < poll < math.inf:
            raise ValueError(f"poll: seconds between looks, more than 0, not {poll!r}")
        if timeout is not None and (not isinstance(timeout, (int, float)) or not 0 <= timeout):
            raise ValueError(f"timeout: seconds to wait at most, 0 or more (None: no limit), "
                             f"not {timeout!r}")
        deadline = None if timeout is None else time.monotonic() + timeout
        state = self.status()
        if state.note:
            log.warning("job %d: %s", self.id, state.note)
        from tqdm import tqdm  # only waiting draws a bar

        # items finished before the wait began are its start (initial), not progress: the
        # rate counts only what finishes while it watches
        bar = tqdm(total=state.total, initial=state.ended, desc=f"job {self.id}", unit="item",
                   disable=not progress)
        last_check = time.monotonic()
        try:
            while True:
                bar.update(state.ended - bar.n)
                if state.finished:
                    return state
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"job {self.id}: still {state.status} after {timeout} s "
                                       f"({state.ended}/{state.total} items ended)")
                time.sleep(poll)
                check = time.monotonic() - last_check > 30
                state = self.status(check_workers=check)
                if check:
                    last_check = time.monotonic()
                    if state.note:
                        log.warning("job %d: %s", self.id, state.note)
        finally:
            bar.close()

    def results(self, batch: int = 1000, input: bool = True) -> Iterator[ItemResult]:
        """Every item in index order, streamed from the database (only the columns read),
        ``batch`` items (a positive integer) per round trip; with ``input`` (the default)
        each carries its prompt or messages and parameters."""
        # here, not at the first item: the generator's below
        check_count("batch", batch, error=ArgumentError)
        return self._results(batch, input)

    def _results(self, batch: int, input: bool) -> Iterator[ItemResult]:
        names = SCALARS + ARRAYS
        extra = INPUT_COLUMNS if input else ()
        columns = ("index", "custom_id", "status", "output", "finish_reason", "error",
                   "prompt_tokens", "worker", *extra, *names)
        n = len(extra)
        with self.client.sessions() as s:
            for (index, custom_id, status, output, finish_reason, error, prompt_tokens, worker,
                 *rest) in repo.iter_items(s, job_id=self.id, batch=batch, columns=columns):
                item = ItemResult(
                    index=index, custom_id=item_id(custom_id, index), status=status,
                    output=output, finish_reason=finish_reason, error=error,
                    prompt_tokens=prompt_tokens, counters=dict(zip(names, rest[n:])),
                    worker=worker,
                )
                if n:
                    item.prompt, item.messages, item.params = rest[:n]
                yield item

    def metrics(self) -> JobMetrics:
        """The job's counters and counts, read from the views (db/views.py: job_metrics,
        job_acceptance_by_position, job_steps_by_draft_length, job_steps_by_drafts_verified)."""
        with self.client.sessions() as s:
            rows = repo.job_figures(s, job_ids=[self.id])
            if not rows:
                raise NotFound(f"job {self.id}: not found")
            arrays: dict[str, Any] = {
                "accepted_by_position": repo.accepted_by_position(s, job_id=self.id),
                "steps_by_draft_length": repo.steps_by_draft_length(s, job_id=self.id),
                "steps_by_drafts_verified": repo.steps_by_drafts_verified(s, job_id=self.id)}
            timeline = repo.chunk_timeline(s, job_id=self.id)
            if len(timeline) < 10 and rows[0]["total"] <= repo.ITEM_TIMELINE_MAX:
                # too few chunks for a course over time: the items', as they finished
                timeline = repo.item_timeline(s, job_id=self.id)
        row = rows[0]
        kind = counter_kinds()
        counts: dict[str, Any] = {s.value: row[s.value] for s in ItemStatus}
        sums: dict[str, Any] = {k: (float(row[k]) if kind[k] == "float" else int(row[k]))
                                for k in SCALARS}
        return JobMetrics(
            job_id=self.id, status=row["status"], total=row["total"], **counts, **sums,
            **arrays,
            wall_time=None if row["wall_time"] is None else float(row["wall_time"]),
            draft_length_over_time=_mean_g_by_tenths([(t1, steps) for _, t1, _, steps
                                                      in timeline if steps]),
            throughput_over_time=_throughput_over_time(timeline),
            **{k: row[k] for k in ("pair", "drafter", "draft_model", "draft_mode",
                                   "draft_length")},
            engine_faults=int(row["engine_faults"]), first_fault=row["first_fault"],
            items_isolated=int(row["items_isolated"]),
            prompt_tokens=int(row["prompt_tokens"]), worker_seconds=float(row["worker_seconds"]),
            estimated_cost=None if row["estimated_cost"] is None
            else float(row["estimated_cost"]),
        )

    def retry(self) -> list[int]:
        """Failed items go back to pending, with their attempts kept (each retry allows
        max_attempts more), and the job reopens; their chunks are sent (or left to the
        reconciler if the broker is down). Returns the indices sent back."""
        from specq.broker import dispatch

        with self.client.sessions.begin() as s:
            indices = repo.retry_failed(s, job_id=self.id)
            refs = chunks.reopen(s, job_id=self.id, indices=indices)
        try:
            dispatch.deliver(self.client.celery, self.client.sessions, refs,
                             self.client.settings)
        except Exception as exc:  # noqa: BLE001 (the broker's own errors vary by transport)
            log.warning("job %d: %d items back to pending, but the broker cannot be "
                        "reached (%s): the reconciler sends them when it is back",
                        self.id, len(indices), exc)
        return indices

    def cancel(self) -> JobState:
        """Stop the job at its next chunk; items already finished stay."""
        with self.client.sessions.begin() as s:
            repo.request_cancel(s, job_id=self.id)
        return self.status(check_workers=False)


def _mean_g_by_tenths(timeline: list[tuple[Any, list[int]]]) -> list[float]:
    """Mean draft length of the steps of each tenth of the timeline's rows (the job's chunks,
    or its items: Job.metrics), in finishing order."""
    n = len(timeline)
    out = []
    for k in range(min(10, n)):
        part = timeline[k * n // min(10, n):(k + 1) * n // min(10, n)]
        steps = [0] * max((len(s) for _, s in part), default=0)
        for _, s in part:
            for g, c in enumerate(s):
                steps[g] += c
        total = sum(steps)
        out.append(sum(g * c for g, c in enumerate(steps)) / total if total else 0.0)
    return out


def _throughput_over_time(timeline: list[tuple[Any, Any, int, list[int]]],
                          bins: int = 20) -> list[tuple[float, float]]:
    """New tokens per second in up to ``bins`` equal intervals from the first chunk's start
    to the last one's finish: (seconds at the interval's middle, tokens/s). A chunk's tokens
    are spread evenly over its own span (first start to last finish), all that is known of
    when they came; at most one interval per chunk."""
    spans = [(t0 or t1, t1, tokens) for t0, t1, tokens, _ in timeline if tokens]
    if not spans:
        return []
    start = min(t0 for t0, _, _ in spans)
    total = max(repo.elapsed(start, t1) or 0.0 for _, t1, _ in spans)
    if total <= 0:
        return []
    n = min(bins, len(spans))
    width = total / n
    tokens = [0.0] * n
    for t0, t1, count in spans:
        a, b = repo.elapsed(start, t0) or 0.0, repo.elapsed(start, t1) or 0.0
        if b <= a:  # no span known: all at its finish
            tokens[min(int(b / width), n - 1)] += count
            continue
        for i in range(min(int(a / width), n - 1), min(int(b / width), n - 1) + 1):
            overlap = min(b, (i + 1) * width) - max(a, i * width)
            tokens[i] += count * max(overlap, 0.0) / (b - a)
    return [((i + 0.5) * width, t / width) for i, t in enumerate(tokens)]
