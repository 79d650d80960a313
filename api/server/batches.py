"""/v1/batches: a batch is made from an uploaded file (its job submitted through
Client.submit, which checks every line in full), read back as OpenAI's Batch object with
its live counts and specq's figures, listed, cancelled, and expired when its completion
window ends.

Its status comes from its job (db/models.py: JobStatus), which the workers drive:

    validating   the batch row exists, its job not yet (a create still checking the file)
    failed       the file failed the full check (``errors`` names each line), the create
                 died before its job was stored (failed by the expiry pass), or the job failed
    in_progress  the job is queued or running
    finalizing   the window ended and the requests still running finish (then: expired)
    completed / cancelling / cancelled / expired   as the job ends

Nothing here is held in memory between requests: the database is the truth, and every
server can answer for every batch.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import secrets
import signal
import threading
import time
from datetime import datetime, timedelta
from functools import lru_cache
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Header, Query, Request
from pydantic import BaseModel, ConfigDict, Field, field_validator
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from specq.api.client import Client
from specq.api.inputs import MAX_PROBLEMS, OPENAI_URLS, SAMPLING_FIELDS, InputError
from specq.api.retention import EXPIRY_LIMITS
from specq.api.server.auth import caller
from specq.api.server.errors import NO_RETRY, ApiError, not_found
from specq.api.server.files import input_bytes, unix, upload_path
from specq.api.server.models import UnknownModel, resolve
from specq.api.server.objects import ERRORS, BatchList, BatchObject
from specq.api.server.uploads import LineScan, Problem
from specq.broker.names import PRIORITIES
from specq.db import batches as store
from specq.db import repository as repo
from specq.db.models import Batch, JobStatus, as_utc, utcnow
from specq.db.tenants import Caller

log = logging.getLogger(__name__)
router = APIRouter(responses=ERRORS)
Who = Annotated[Caller, Depends(caller)]
WINDOW = re.compile(r"([0-9]{1,8})([smhd])")  # ASCII digits: \d takes "２４" too
UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
LINE = re.compile(r"line (\d+): (.*)", re.S)
FIELD = re.compile(r"([\w.\[\]]+): ")


class OutputExpiry(BaseModel):
    """OpenAI's output_expires_after: the output and error files expire ``seconds`` after
    the batch ends (when its output file is complete: OpenAI's created_at of it)."""

    model_config = ConfigDict(extra="forbid")

    anchor: Literal["created_at"]
    seconds: int = Field(ge=EXPIRY_LIMITS[0], le=EXPIRY_LIMITS[1], strict=True)


class BatchCreate(BaseModel):
    """The create request. A field it does not name is refused, as OpenAI refuses an
    unknown argument: a misspelt one silently dropped would change what the batch does."""

    model_config = ConfigDict(extra="forbid")

    input_file_id: str = Field(max_length=64)
    endpoint: str = Field(max_length=64)
    completion_window: str = Field(max_length=16)
    metadata: dict[str, str] | None = None

    output_expires_after: OutputExpiry | None = None

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        if value is not None:
            if len(value) > 16:
                raise ValueError("at most 16 keys")
            if any(len(k) > 64 or len(v) > 512 for k, v in value.items()):
                raise ValueError("keys of at most 64 characters, values of at most 512")
            if not all(store.storable(k) and store.storable(v) for k, v in value.items()):
                raise ValueError("keys and values without NUL characters or lone surrogates")
        return value


def window_seconds(text: str, most: int) -> int:
    """'24h', '30m', '2d', '90s' in seconds, within [1, most]; ApiError otherwise."""
    found = WINDOW.fullmatch(text)
    seconds = int(found.group(1)) * UNITS[found.group(2)] if found else 0
    if not found or not 1 <= seconds <= most:
        raise ApiError(400, f"completion_window: {text[:20]!r} is not served; give a duration "
                       f"such as '24h' (units s, m, h, d) of at most {most} s",
                       param="completion_window", code="invalid_completion_window")
    return seconds


# -- the Batch object ---------------------------------------------------------------------

def status_of(batch: Batch, job_status: str | None, now: datetime) -> str:
    if batch.status in ("failed", "cancelled"):  # ended before it had a job
        return batch.status
    if job_status is None:  # a create that died while checking its file
        return "expired" if now > as_utc(batch.expires_at) else "validating"
    job = JobStatus(job_status)
    if job in (JobStatus.completed, JobStatus.failed):
        return job.value
    if batch.expired_at is not None:
        return "expired" if job == JobStatus.cancelled else "finalizing"
    if job in (JobStatus.cancelled, JobStatus.cancelling):
        return job.value
    return "in_progress"


ENDED = frozenset({"completed", "failed", "expired", "cancelled"})  # a batch's last states
FIGURES = ("acceptance_rate", "mean_acceptance_length", "tokens_per_second",
           "engine_tokens_per_second", "estimated_speedup")


def batch_object(read: store.BatchRead, note: str | None = None) -> dict[str, Any]:
    """OpenAI's Batch object of a batch read with its job's figures, files and input's
    line count (db/batches.py: read_batches); ``note``: why its requests wait (no live
    worker serves its pair)."""
    batch, row = read.batch, read.figures
    now = utcnow()
    status = status_of(batch, row["status"] if row else None, now)
    finished = unix(row["finished_at"]) if row else None
    # no job: its lines while they are read, none once validation failed (as OpenAI counts)
    counts = ({"total": row["total"], "completed": row["completed"], "failed": row["failed"]}
              if row else {"total": (read.lines or 0) if status == "validating" else 0,
                           "completed": 0, "failed": 0})
    errors = ({"object": "list", "data": batch.errors} if batch.errors else None)
    has_errors = row is not None and (row["failed"] or row["cancelled"])
    # an ended batch none of whose requests completed has no output file, as OpenAI's
    # (null output_file_id beside the error file); one still running names its file, whose
    # partial download is specq's own
    has_output = row is not None and (row["completed"] or status not in ENDED)
    out: dict[str, Any] = {
        "id": batch.openai_id, "object": "batch", "endpoint": batch.endpoint,
        "model": batch.model, "errors": errors, "input_file_id": batch.input_file_id,
        "completion_window": batch.completion_window, "status": status,
        "output_file_id": read.output_id if has_output else None,
        "error_file_id": read.error_id if has_errors else None,
        "created_at": unix(batch.created_at), "in_progress_at": unix(batch.in_progress_at),
        "expires_at": unix(batch.expires_at),
        "finalizing_at": (finished if status == "completed" else unix(batch.expired_at)),
        "completed_at": finished if status == "completed" else None,
        "failed_at": unix(batch.failed_at) or (finished if status == "failed" else None),
        "expired_at": unix(batch.expired_at),
        "cancelling_at": unix(batch.cancelling_at),
        "cancelled_at": ((finished if row else unix(batch.cancelling_at))
                         if status == "cancelled" else None),
        "request_counts": counts,
        "metadata": batch.metadata_,
    }
    out["usage"] = out["specq"] = None  # no job (yet): nothing counted
    if row is not None:
        tokens_in, tokens_out = int(row["prompt_tokens"] or 0), int(row["new_tokens"] or 0)
        out["usage"] = {"input_tokens": tokens_in, "input_tokens_details": {"cached_tokens": 0},
                        "output_tokens": tokens_out,
                        "output_tokens_details": {"reasoning_tokens": 0},
                        "total_tokens": tokens_in + tokens_out}
        # specq's own figures: an extra field every OpenAI SDK keeps
        out["specq"] = {
            "job_id": row["job_id"], "pair": row["pair"], "drafter": row["drafter"],
            "cancelled": row["cancelled"], "pending": row["pending"],
            "new_tokens": int(row["new_tokens"] or 0),
            **{k: None if row[k] is None else float(row[k]) for k in FIGURES},
            "waiting": note if status == "in_progress" and row["pending"] else None,
        }
    return out


NOTE_TTL = 5.0  # seconds a server keeps what it learnt of a pair's workers
_notes: dict[tuple[str, str], tuple[float, str | None]] = {}
_asking = threading.Lock()


def waiting_note(client: Client, row: dict[str, Any] | None) -> str | None:
    """Why the requests of a job still running wait (no live worker serves its pair, the
    broker cannot be reached), or None; asked of the broker at most every NOTE_TTL
    seconds per pair by this server, by one thread while the others answer with what was
    learnt last, so polls stay cheap and a hundred pollers never ask at once."""
    if row is None or JobStatus(row["status"]).finished or not row["pending"]:
        return None
    pair = (client.settings.queue_prefix, row["pair"])
    seen = _notes.get(pair)
    if seen is not None and time.monotonic() - seen[0] <= NOTE_TTL:
        return seen[1]
    if not _asking.acquire(blocking=seen is None):
        assert seen is not None  # (a blocking acquire does not fail)
        return seen[1]  # another thread asks now
    try:
        seen = _notes.get(pair)
        if seen is None or time.monotonic() - seen[0] > NOTE_TTL:
            seen = (time.monotonic(), client.serving_note(row["pair"]))
            _notes[pair] = seen
        return seen[1]
    finally:
        _asking.release()


def read_objects(client: Client, batches: list[Batch]) -> list[dict[str, Any]]:
    """The Batch objects of these rows (one tenant's), newest first: one statement."""
    if not batches:
        return []
    with reads(client.sessions)() as s:
        found = store.read_batches(s, tenant_id=batches[0].tenant_id,
                                   batch_ids=[b.id for b in batches])
    return [batch_object(r, waiting_note(client, r.figures)) for r in found]


@lru_cache(maxsize=8)
def reads(sessions: sessionmaker[Session]) -> sessionmaker[Session]:
    """Sessions of ``sessions``' engine for a read of one statement: autocommit, so no
    BEGIN nor ROLLBACK goes to the database around it (two round trips of the three a
    GET made). One statement is one snapshot all the same."""
    engine = sessions.kw["bind"]
    return sessionmaker(engine.execution_options(isolation_level="AUTOCOMMIT"),
                        expire_on_commit=False)


# -- expiry -------------------------------------------------------------------------------

def expire(client: Client, batch_id: int, job_id: int) -> None:
    """The window ended: the job's unfinished requests are cancelled (a chunk running now
    finishes its own), and the batch is expired once they are."""
    with client.sessions.begin() as s:
        if store.mark(s, batch_id=batch_id, column="expired_at"):
            repo.request_cancel(s, job_id=job_id)
            log.info("batch %d: completion window ended; job %d cancelled", batch_id, job_id)


def expire_overdue(client: Client) -> int:
    """One expiry pass: the batches past their window, and the creates that died (a batch
    validating past api_validating_timeout with no job) failed."""
    with client.sessions.begin() as s:
        stuck = store.fail_stale(s, before=_stale_before(client))
    if stuck:
        log.warning("%d batches whose create died before their job was stored: failed",
                    stuck)
    with client.sessions() as s:
        due = store.overdue(s)
    for batch_id, job_id in due:
        expire(client, batch_id, job_id)
    return len(due) + stuck


def _stale_before(client: Client) -> datetime:
    return utcnow() - timedelta(seconds=client.settings.api_validating_timeout)


def _fresh(client: Client, who: Caller, batch_id: str) -> dict[str, Any]:
    """The tenant's batch as a Batch object, expired first if its window ended (so an
    answer never waits on the next expiry pass): one statement (db/batches.py:
    read_batches)."""
    with reads(client.sessions)() as s:
        found = store.read_batches(s, tenant_id=who.tenant_id, openai_id=batch_id)
    if not found:
        raise not_found("Batch", batch_id, param="batch_id")
    read = found[0]
    batch, row = read.batch, read.figures
    if (row is not None and batch.expired_at is None
            and not JobStatus(row["status"]).finished and utcnow() > as_utc(batch.expires_at)):
        assert batch.job_id is not None  # its job's figures were read
        expire(client, batch.id, batch.job_id)
        return _fresh(client, who, batch_id)
    return batch_object(read, waiting_note(client, row))


# -- routes -------------------------------------------------------------------------------

@router.get("/v1/batches/{batch_id}", response_model=BatchObject,
            response_model_exclude_unset=True)
def get_batch(request: Request, batch_id: str, who: Who) -> dict[str, Any]:
    return _fresh(request.app.state.client, who, batch_id)


@router.get("/v1/batches", response_model=BatchList,
            response_model_exclude_unset=True)
def list_batches(request: Request, who: Who,
                 after: Annotated[str | None, Query(max_length=64)] = None,
                 limit: Annotated[int, Query(ge=1, le=100)] = 20) -> dict[str, Any]:
    client = request.app.state.client
    with client.sessions() as s:
        try:
            rows, more = store.list_batches(s, tenant_id=who.tenant_id, after=after,
                                            limit=limit)
        except KeyError:
            raise not_found("Batch", after or "", param="after") from None
    data = read_objects(client, rows)
    return {"object": "list", "data": data, "has_more": more,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None}


@router.post("/v1/batches/{batch_id}/cancel", response_model=BatchObject,
             response_model_exclude_unset=True)
def cancel_batch(request: Request, batch_id: str, who: Who) -> dict[str, Any]:
    client = request.app.state.client
    current = _fresh(client, who, batch_id)
    if current["status"] == "cancelling":  # a cancel sent again (a client's retry after a
        return current  # timeout): answered as the first was (llm-d's batch gateway too)
    if current["status"] not in ("in_progress", "validating"):
        raise ApiError(400, f"Cannot cancel a batch that is {current['status']}: only a batch "
                       "validating or in progress can be", param="batch_id",
                       code="batch_not_cancellable")
    with client.sessions.begin() as s:
        batch = store.get_batch(s, tenant_id=who.tenant_id, openai_id=batch_id)
        if batch is None:
            raise not_found("Batch", batch_id, param="batch_id")
        # validating (its create running, or dead with its server): cancelled before any
        # job is stored, or, if its job was attached meanwhile, that job is cancelled
        if batch.job_id is not None or not store.cancel_validating(s, batch_id=batch.id):
            s.refresh(batch)
            if batch.job_id is not None:  # (None: failed meanwhile as stale; nothing runs)
                store.mark(s, batch_id=batch.id, column="cancelling_at")
                repo.request_cancel(s, job_id=batch.job_id)
    return _fresh(client, who, batch_id)


@router.post("/v1/batches", response_model=BatchObject,
             response_model_exclude_unset=True)
def create_batch(request: Request, body: BatchCreate, who: Who,
                 idempotency_key: Annotated[str | None, Header(max_length=255)] = None
                 ) -> dict[str, Any]:
    client: Client = request.app.state.client
    settings = client.settings
    digest = hashlib.sha256(json.dumps(body.model_dump(mode="json"), sort_keys=True)
                            .encode()).hexdigest()
    if idempotency_key is not None and not store.storable(idempotency_key):
        raise ApiError(400, "Idempotency-Key: must not hold NUL characters", code="invalid_value",
                       param="Idempotency-Key")
    if idempotency_key is not None:
        seen = _replay(client, who, idempotency_key, digest)
        if seen is not None:
            return seen
    if body.endpoint not in OPENAI_URLS:
        raise ApiError(400, f"endpoint: {body.endpoint!r} is not served; one of "
                       f"{', '.join(OPENAI_URLS)}", param="endpoint", code="unsupported_endpoint")
    seconds = window_seconds(body.completion_window, settings.api_max_window)
    priority = (body.metadata or {}).get("priority", "normal")
    if priority not in PRIORITIES:
        raise ApiError(400, f"metadata.priority: {priority[:20]!r} is not one of "
                       f"{', '.join(PRIORITIES)}", param="metadata.priority",
                       code="invalid_priority")
    with client.sessions() as s:
        f = store.get_file(s, tenant_id=who.tenant_id, openai_id=body.input_file_id)
    if f is None:
        raise not_found("File", body.input_file_id, param="input_file_id")
    if f.kind != "input":
        raise ApiError(400, f"input_file_id: {body.input_file_id} is a batch's {f.kind} file "
                       f"(purpose {f.purpose}); a batch reads a file uploaded with purpose "
                       f"batch", param="input_file_id", code="invalid_input_file")
    scan = read_requests(client, f, request.app.state.presets)
    # the request's own problems are a 400 (above); the lines' fail the batch, each named
    failed = [line_error(p) for p in scan.problems]
    if failed and not scan.done:
        failed = every_bad_line(client, f, failed, scan.model, body.endpoint,
                                request.app.state.presets)
    if not failed and scan.url != body.endpoint:
        raise ApiError(400, f"endpoint: the file's requests are for {scan.url}, not "
                       f"{body.endpoint} (one endpoint per batch)", param="endpoint",
                       code="endpoint_mismatch")
    if not failed:
        preset = resolve(scan.model or "", request.app.state.presets)
    now = utcnow()  # one instant for both: expires_at - created_at is the window exactly
    try:
        with client.sessions.begin() as s:
            if not failed:  # checked and stored in one transaction, one create at a time
                _check_quota(client, s, who, scan.lines)
            batch = store.add_batch(
                s, openai_id="batch_" + secrets.token_hex(12), tenant_id=who.tenant_id,
                key_id=who.key_id, status="failed" if failed else "validating",
                errors=failed or None, failed_at=now if failed else None,
                input_file_id=f.openai_id, endpoint=body.endpoint, model=scan.model,
                completion_window=body.completion_window,
                metadata_=body.metadata, idempotency_key=idempotency_key, request_hash=digest,
                output_expires_after=(body.output_expires_after.seconds
                                      if body.output_expires_after else None),
                created_at=now, expires_at=now + timedelta(seconds=seconds))
    except IntegrityError:  # the same key, at the same moment, from another request
        seen = _replay(client, who, idempotency_key or "", digest)
        if seen is None:
            raise
        return seen
    if not failed:
        _submit(client, batch, f, preset.name, priority)
    with reads(client.sessions)() as s:
        (read,) = store.read_batches(s, tenant_id=who.tenant_id, openai_id=batch.openai_id)
    return batch_object(read, waiting_note(client, read.figures))


def read_requests(client: Client, f: Any, presets: dict[str, Any]) -> LineScan:
    """The file's lines read as requests (uploads.LineScan): its ``problems`` name every
    line that is not one (up to MAX_PROBLEMS)."""

    def check_model(model: str) -> str | None:
        try:
            resolve(model, presets)
        except UnknownModel as exc:
            return str(exc)
        return None

    scan = LineScan(max_lines=client.settings.api_max_file_lines, check_model=check_model)
    for data in input_bytes(client, client.settings, f):
        scan.feed(data)
        if scan.done:
            break
    else:
        scan.finish()
    return scan


def every_bad_line(client: Client, f: Any, failed: list[dict[str, Any]], model: str | None,
                   endpoint: str, presets: dict[str, Any]) -> list[dict[str, Any]]:
    """The errors of a file the scan refused: the scan's own (``failed``), and what the
    full check (Client.check) finds on the lines the scan let pass. One error per line, in
    line order, up to MAX_PROBLEMS. The full check needs the pair of the file's model, so
    a file whose model is not served has the scan's errors alone."""
    try:
        pair = resolve(model or "", presets).name
    except UnknownModel:
        return failed
    path, temporary = upload_path(client, f)
    try:
        client.check(path, pair=pair)
        checked = []
    except InputError as exc:
        checked = batch_errors(exc, endpoint)
    finally:
        if temporary:
            path.unlink(missing_ok=True)
    named: dict[int | None, dict[str, Any]] = {}
    for error in failed + checked:  # the scan's go first
        named.setdefault(error["line"], error)
    return sorted(named.values(), key=lambda e: e["line"] or 0)[:MAX_PROBLEMS]


def line_error(problem: Problem) -> dict[str, Any]:
    """A problem of the file's as one of OpenAI's batch errors."""
    return {"code": problem.code, "line": problem.line, "message": problem.message,
            "param": problem.param}


def _replay(client: Client, who: Caller, key: str, digest: str) -> dict[str, Any] | None:
    """The batch an earlier create with this Idempotency-Key made (409 if its body was
    another), or None."""
    with client.sessions() as s:
        batch = store.by_idempotency_key(s, tenant_id=who.tenant_id, key=key)
    if batch is None:
        return None
    if batch.job_id is None and batch.status == "validating":
        with client.sessions.begin() as s:  # a create that died: failed now, key freed
            if store.fail_stale(s, before=_stale_before(client), batch_id=batch.id):
                return None
    if batch.request_hash != digest:
        raise ApiError(409, "This Idempotency-Key was used with another request body; use a "
                       "new key for a new batch", code="idempotency_key_reused",
                       headers=NO_RETRY)
    return read_objects(client, [batch])[0]


def _check_quota(client: Client, s: Any, who: Caller, lines: int) -> None:
    """429 when the tenant's unfinished requests and this batch's pass the quota; in the
    transaction ``s`` that stores the batch, the tenant's row held (store.lock_tenant), so
    that creates at the same moment cannot each count without the others."""
    quota = client.settings.api_quota_items
    if not quota:
        return
    store.lock_tenant(s, who.tenant_id)
    unfinished = store.unfinished_items(s, tenant_id=who.tenant_id)
    if unfinished + lines > quota:
        raise ApiError(429, f"Quota exceeded: your batches have {unfinished} unfinished "
                       f"requests and this one has {lines}; at most {quota} may be "
                       f"unfinished at once (SPECQ_API_QUOTA_ITEMS). Wait for batches to "
                       f"finish, or cancel some.", code="quota_exceeded", headers=NO_RETRY)


class _Gone(Exception):
    """The batch stopped validating while its job was being stored (failed as stale)."""


def fault(point: str) -> None:
    """Tests only: SPECQ_API_FAULT=POINT kills this server (SIGKILL) at that point of a
    create, as a crash would (tests/pipeline/test_http_abuse.py)."""
    if os.environ.get("SPECQ_API_FAULT") == point:
        log.warning("SPECQ_API_FAULT=%s: killing the server", point)
        os.kill(os.getpid(), signal.SIGKILL)


def _submit(client: Client, batch: Batch, f: Any, pair: str, priority: str) -> None:
    """The job of the batch: every line checked (Client.submit), then the job, its items,
    the batch's link to it and its output and error files stored in one transaction; the
    job is sent only after it commits. A line that fails the check fails the batch, naming
    it, and nothing else is stored. A crash before the commit leaves the batch validating
    with no job, which the expiry pass fails (`fail_stale`); after it, the whole batch."""
    fault("batch")

    def attach(s: Any, job_id: int) -> None:
        if not store.attach_job(s, batch_id=batch.id, job_id=job_id):
            raise _Gone
        for kind in ("output", "error"):
            store.add_file(s, openai_id="file-" + secrets.token_hex(12),
                           tenant_id=batch.tenant_id, kind=kind, purpose="batch_output",
                           filename=f"{batch.openai_id}_{kind}.jsonl", batch_id=batch.id)
        fault("job")

    path, temporary = upload_path(client, f)
    try:
        job = client.submit(path, pair=pair, priority=priority, within=attach)
    except InputError as exc:
        with client.sessions.begin() as s:
            store.fail_batch(s, batch_id=batch.id, errors=batch_errors(exc, batch.endpoint))
        return
    except _Gone:
        log.warning("batch %s: no longer validating (cancelled, or failed as stale) while "
                    "its job was stored; job rolled back", batch.openai_id)
        return
    except Exception as exc:
        with client.sessions.begin() as s:
            store.fail_batch(s, batch_id=batch.id, release_key=True, errors=[{
                "code": "server_error", "line": None, "param": None,
                "message": f"the batch could not be stored ({type(exc).__name__})"}])
        raise
    finally:
        if temporary:
            path.unlink(missing_ok=True)
    fault("sent")
    log.info("batch %s: job %d, %d requests on pair %s", batch.openai_id, job.id,
             f.lines or 0, pair)


def batch_errors(exc: InputError, endpoint: str) -> list[dict[str, Any]]:
    """InputError's problems ('line 7: body.temperature: ...') as OpenAI's batch errors,
    each ``param`` the line's own OpenAI field (``body.max_tokens``, never specq's
    ``max_new_tokens``), and the message led by it."""
    out = []
    for problem in exc.problems:
        found = LINE.fullmatch(problem)
        line, text = (int(found.group(1)), found.group(2)) if found else (None, problem)
        field = FIELD.match(text)
        param = None
        if field:
            rest = text[field.end():]
            param, rest = openai_field(field.group(1), rest, endpoint)
            text = f"{param}: {rest}"
        out.append({"code": "invalid_request", "line": line, "message": text, "param": param})
    return out


SPECQ_FIELDS = {"max_new_tokens": "max_tokens"}  # specq's names of OpenAI's fields
PROMPT_AT = re.compile(r"(.*) at (body\.[\w.\[\]]+)(.*)", re.S)


def openai_field(field: str, rest: str, endpoint: str) -> tuple[str, str]:
    """The OpenAI field of a line that specq's check named ``field`` (prompt, temperature,
    max_new_tokens, body.n, custom_id), and the message's rest."""
    if field == "prompt":
        at = PROMPT_AT.fullmatch(rest)  # 'contains a NUL ... at body.messages[0].content'
        if at:
            return at.group(2), at.group(1) + at.group(3)
        return ("body.messages" if endpoint == "/v1/chat/completions" else "body.prompt"), rest
    if field in SAMPLING_FIELDS:  # a parameter, by specq's name: the body's field
        return f"body.{SPECQ_FIELDS.get(field, field)}", rest
    return field, rest  # the line's own place (body.n, custom_id, a top-level field)
