"""Webhook endpoints and the outbox of their events. Keyword-only functions over a Session,
like db/repository.py.

An event is written in the transaction that ends its batch or job (job_ended, batch_failed,
called where the status changes), one row per endpoint that wants it: the status change
and its announcement commit together or not at all. A sender (broker/webhooks.py) claims
due rows under a lease, posts them, and records each attempt (record): a 2xx makes the row
delivered, and a delivered row is never claimed again; anything else schedules a retry
with exponential back-off until the event is ``retry_for`` seconds old. A sender killed
mid-post leaves its lease to run out, and the row is posted again (at least once: a
receiver keeps the ``webhook-id`` it has seen).

Two kinds of endpoint:

    a tenant's      told of its batches: batch.completed | failed | expired | cancelled,
                    the events OpenAI's Batch API sends, with the Batch's ids and counts
    the operator's  (no tenant) told of every job: job.completed | failed | cancelled,
                    whatever door submitted it (client, CLI, a beat schedule's synthesis run)

The signing secret is ``whsec_`` and 32 random bytes in base64 (Standard Webhooks). It is
stored as it is given out: an HMAC needs the key itself, so a hash would not do. It is
shown once, when the endpoint is made; lists show its first characters only.
"""

from __future__ import annotations

import base64
import json
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import func, or_, select, update
from sqlalchemy.orm import Session

from specq.db.clock import db_now
from specq.db.models import (
    Batch,
    File,
    Job,
    JobStatus,
    Tenant,
    WebhookAttempt,
    WebhookDelivery,
    WebhookEndpoint,
    could_be_id,
    utcnow,
)
from specq.schema.addresses import check_url

SECRET_PREFIX = "whsec_"
SHOWN = len(SECRET_PREFIX) + 4  # characters of a secret that lists show
BATCH_EVENTS = ("batch.completed", "batch.failed", "batch.expired", "batch.cancelled")
JOB_EVENTS = ("job.completed", "job.failed", "job.cancelled")
PENDING, DELIVERED, FAILED = "pending", "delivered", "failed"
GONE = "gone"  # what record() returns for a row deleted meanwhile (its endpoint deleted)


def new_secret() -> str:
    return SECRET_PREFIX + base64.b64encode(secrets.token_bytes(32)).decode()


def _unix(when: datetime | None) -> int | None:
    return None if when is None else int(when.timestamp())


# -- endpoints ----------------------------------------------------------------------------

@dataclass(frozen=True)
class EndpointInfo:
    """An endpoint as lists show it (no secret), with its deliveries by status."""

    id: str
    tenant: str | None
    name: str
    url: str
    event_types: list[str]
    secret_hint: str
    created_at: datetime
    updated_at: datetime
    deliveries: dict[str, int]

    def as_object(self) -> dict[str, Any]:
        """OpenAI's WebhookEndpoint object."""
        return {"id": self.id, "object": "webhook_endpoint", "name": self.name,
                "url": self.url, "event_types": self.event_types,
                "signing_secret_hint": self.secret_hint,
                "created_at": _unix(self.created_at), "updated_at": _unix(self.updated_at)}


def check_event_types(event_types: Sequence[str] | None, *, tenant: bool) -> list[str]:
    """The event types an endpoint of a tenant (batch.*) or of the operator (job.*) may
    want; all of them if None. ValueError naming the one that is not."""
    known = BATCH_EVENTS if tenant else JOB_EVENTS
    if event_types is None:
        return list(known)
    wanted = list(dict.fromkeys(event_types))
    if not wanted:
        raise ValueError("event_types: at least one")
    for t in wanted:
        if t not in known:
            raise ValueError(f"event_types: {str(t)[:64]!r} is not sent to "
                             f"{'a tenant' if tenant else 'the operator'}; one of "
                             f"{', '.join(known)}")
    return wanted


def add_endpoint(session: Session, *, url: str, tenant_id: int | None, name: str = "",
                 event_types: Sequence[str] | None = None, allow_private: bool = False,
                 allow_http: bool = False) -> tuple[EndpointInfo, str]:
    """A new endpoint (``tenant_id`` None: the operator's) and its secret, shown this once.
    TargetError (a ValueError) for a URL that is refused (schema/addresses.py), ValueError
    for an event type that is not sent to such an endpoint."""
    check_url(url, allow_private=allow_private, allow_http=allow_http)
    types = check_event_types(event_types, tenant=tenant_id is not None)
    secret = new_secret()
    row = WebhookEndpoint(openai_id="we_" + secrets.token_hex(12), tenant_id=tenant_id,
                          name=name[:200], url=url, event_types=types, secret=secret)
    session.add(row)
    session.flush()
    return _info(session, row, {}), secret


def tenant_id_of(session: Session, *, tenant: str) -> int:
    """The tenant's id; KeyError naming it if there is none."""
    found = session.scalar(select(Tenant.id).where(Tenant.name == tenant))
    if found is None:
        raise KeyError(f"tenant {tenant!r}: not found (a tenant is made with its first key: "
                       "specq keys create NAME)")
    return found


def _info(session: Session, row: WebhookEndpoint, counts: dict[str, int],
          names: dict[int, str] | None = None) -> EndpointInfo:
    if row.tenant_id is None:
        tenant = None
    elif names is not None:
        tenant = names.get(row.tenant_id)
    else:
        tenant = session.scalar(select(Tenant.name).where(Tenant.id == row.tenant_id))
    return EndpointInfo(row.openai_id, tenant, row.name, row.url, list(row.event_types),
                        row.secret[:SHOWN] + "...", row.created_at, row.updated_at,
                        {s: counts.get(s, 0) for s in (PENDING, DELIVERED, FAILED)})


_ANY: Any = object()


def list_endpoints(session: Session, *, tenant_id: int | None = _ANY, after: str | None = None,
                   limit: int | None = None) -> tuple[list[EndpointInfo], bool]:
    """Endpoints oldest first (of one tenant, or the operator's with None; every one by
    default), paged after the one whose id is ``after``; and whether more follow."""
    stmt = select(WebhookEndpoint).order_by(WebhookEndpoint.id)
    if tenant_id is not _ANY:
        stmt = stmt.where(WebhookEndpoint.tenant_id.is_(None) if tenant_id is None
                          else WebhookEndpoint.tenant_id == tenant_id)
    if after is not None:
        if not could_be_id(after):
            raise KeyError(after)
        seq = session.scalar(stmt.with_only_columns(WebhookEndpoint.id)
                             .where(WebhookEndpoint.openai_id == after))
        if seq is None:
            raise KeyError(after)
        stmt = stmt.where(WebhookEndpoint.id > seq)
    if limit is not None:
        stmt = stmt.limit(limit + 1)
    rows = list(session.scalars(stmt))
    more = limit is not None and len(rows) > limit
    rows = rows[:limit] if limit is not None else rows
    counts: dict[int, dict[str, int]] = {}
    if rows:
        d = WebhookDelivery
        for endpoint_id, status, n in session.execute(
                select(d.endpoint_id, d.status, func.count())
                .where(d.endpoint_id.in_([r.id for r in rows]))
                .group_by(d.endpoint_id, d.status)):
            counts.setdefault(endpoint_id, {})[status] = n
    tenant_ids = {r.tenant_id for r in rows if r.tenant_id is not None}
    names = dict(session.execute(select(Tenant.id, Tenant.name)
                                 .where(Tenant.id.in_(tenant_ids))).all()) if tenant_ids else {}
    return [_info(session, r, counts.get(r.id, {}), names) for r in rows], more


def get_endpoint(session: Session, *, openai_id: str, tenant_id: int | None = _ANY
                 ) -> EndpointInfo | None:
    if not could_be_id(openai_id):  # a NUL or a quote: no endpoint's, and no query
        return None
    stmt = select(WebhookEndpoint).where(WebhookEndpoint.openai_id == openai_id)
    if tenant_id is not _ANY:
        stmt = stmt.where(WebhookEndpoint.tenant_id.is_(None) if tenant_id is None
                          else WebhookEndpoint.tenant_id == tenant_id)
    row = session.scalar(stmt)
    return None if row is None else _info(session, row, {})


def _own(session: Session, *, openai_id: str, tenant_id: int | None) -> WebhookEndpoint | None:
    if not could_be_id(openai_id):
        return None
    stmt = select(WebhookEndpoint).where(WebhookEndpoint.openai_id == openai_id)
    if tenant_id is not _ANY:
        stmt = stmt.where(WebhookEndpoint.tenant_id.is_(None) if tenant_id is None
                          else WebhookEndpoint.tenant_id == tenant_id)
    return session.scalar(stmt)


def update_endpoint(session: Session, *, openai_id: str, tenant_id: int | None = _ANY,
                    name: str | None = None, url: str | None = None,
                    event_types: Sequence[str] | None = None, allow_private: bool = False,
                    allow_http: bool = False) -> EndpointInfo | None:
    """Change what is given (the URL checked as at creation); None: no such endpoint."""
    row = _own(session, openai_id=openai_id, tenant_id=tenant_id)
    if row is None:
        return None
    if url is not None:
        check_url(url, allow_private=allow_private, allow_http=allow_http)
        row.url = url
    if event_types is not None:
        row.event_types = check_event_types(event_types, tenant=row.tenant_id is not None)
    if name is not None:
        row.name = name[:200]
    row.updated_at = utcnow()
    session.flush()
    return _info(session, row, {})


def rotate_secret(session: Session, *, openai_id: str, tenant_id: int | None = _ANY,
                  keep_old_for: float = 0.0) -> tuple[EndpointInfo, str] | None:
    """A new secret for the endpoint, shown this once; the old one signs too for
    ``keep_old_for`` seconds (0: it is dropped now). None: no such endpoint."""
    row = _own(session, openai_id=openai_id, tenant_id=tenant_id)
    if row is None:
        return None
    secret = new_secret()
    row.previous_secret = row.secret if keep_old_for > 0 else None
    row.previous_until = time.time() + keep_old_for if keep_old_for > 0 else None
    row.secret = secret
    row.updated_at = utcnow()
    session.flush()
    return _info(session, row, {}), secret


def remove_endpoint(session: Session, *, openai_id: str, tenant_id: int | None = _ANY) -> bool:
    """Delete the endpoint (of that tenant, if given) with its deliveries, sent or not, and
    their attempts; whether there was one."""
    if not could_be_id(openai_id):
        return False
    stmt = select(WebhookEndpoint.id).where(WebhookEndpoint.openai_id == openai_id)
    if tenant_id is not _ANY:
        stmt = stmt.where(WebhookEndpoint.tenant_id.is_(None) if tenant_id is None
                          else WebhookEndpoint.tenant_id == tenant_id)
    found = session.scalar(stmt)
    if found is None:
        return False
    deliveries = select(WebhookDelivery.id).where(WebhookDelivery.endpoint_id == found)
    session.execute(WebhookAttempt.__table__.delete()
                    .where(WebhookAttempt.delivery_id.in_(deliveries)))
    session.execute(WebhookDelivery.__table__.delete()
                    .where(WebhookDelivery.endpoint_id == found))
    session.execute(WebhookEndpoint.__table__.delete().where(WebhookEndpoint.id == found))
    return True


# -- events: written where a batch or a job ends -----------------------------------------

def _subscribers(session: Session, *, tenant_id: int | None, event_type: str) -> list[int]:
    stmt = select(WebhookEndpoint.id, WebhookEndpoint.event_types)
    stmt = stmt.where(WebhookEndpoint.tenant_id.is_(None) if tenant_id is None
                      else WebhookEndpoint.tenant_id == tenant_id)
    return [i for i, types in session.execute(stmt) if event_type in (types or [])]


def _enqueue(session: Session, *, endpoint_ids: list[int], event_type: str,
             data: dict[str, Any]) -> str | None:
    """One event, one outbox row per endpoint; its id (None: nobody wants it)."""
    if not endpoint_ids:
        return None
    event_id = "evt_" + secrets.token_hex(16)
    body = json.dumps({"id": event_id, "object": "event", "type": event_type,
                       "created_at": int(utcnow().timestamp()), "data": data},
                      separators=(",", ":"), default=str)
    now = float(session.execute(select(db_now())).scalar_one())
    session.execute(WebhookDelivery.__table__.insert(), [
        {"event_id": event_id, "endpoint_id": e, "type": event_type, "body": body,
         "status": PENDING, "attempts": 0, "created": now, "next_at": now}
        for e in endpoint_ids])
    return event_id


def batch_event_type(batch: Batch, job_status: str) -> str | None:
    """The batch.* event a batch's job ending in ``job_status`` is (api/server/batches.py:
    status_of): expired if its window ended first, else as the job ended."""
    status = JobStatus(job_status)
    if status == JobStatus.cancelled:
        return "batch.expired" if batch.expired_at is not None else "batch.cancelled"
    if status in (JobStatus.completed, JobStatus.failed):
        return f"batch.{status.value}"
    return None


def job_ended(session: Session, *, job_id: int, batch_only: bool = False) -> list[str]:
    """The events of a job that has just ended (call in the transaction that ended it):
    job.* for the operator's endpoints, and batch.* for its batch's tenant's (only those
    with ``batch_only``). Returns the event ids written (none when the job has not ended or
    no endpoint wants them: a query or two, nothing stored)."""
    from specq.db.repository import status_counts  # (it calls this one)

    if session.scalar(select(WebhookEndpoint.id).limit(1)) is None:
        return []  # no endpoint at all (most installs): one query, nothing else read
    job = session.execute(select(Job.status, Job.pair, Job.source, Job.spec, Job.schedule,
                                 Job.error).where(Job.id == job_id)).one_or_none()
    if job is None:
        return []
    status = JobStatus(job.status)
    if not status.finished:
        return []
    batch = session.scalar(select(Batch).where(Batch.job_id == job_id)
                           .execution_options(populate_existing=True))
    batch_type = batch_event_type(batch, status.value) if batch is not None else None
    to_operator = [] if batch_only else _subscribers(session, tenant_id=None,
                                                     event_type=f"job.{status.value}")
    to_tenant = (_subscribers(session, tenant_id=batch.tenant_id, event_type=batch_type)
                 if batch is not None and batch_type else [])
    if not to_operator and not to_tenant:
        return []
    counts = status_counts(session, job_id=job_id)
    written = []
    job_data: dict[str, Any] = {
        "id": job_id, "status": status.value, "pair": job.pair,
        "request_counts": {"total": sum(counts.values()), **counts},
        "error": job.error, "source": job.source}
    if job.spec is not None:  # a synthesis run: its spec, and the schedule that fired it
        job_data["synthesis"] = {"spec": job.spec, "schedule": job.schedule}
    if batch is not None:
        job_data["batch_id"] = batch.openai_id
    written.append(_enqueue(session, endpoint_ids=to_operator,
                            event_type=f"job.{status.value}", data=job_data))
    if batch is not None and batch_type:
        files = {f.kind: f.openai_id for f in session.scalars(
            select(File).where(File.batch_id == batch.id))}
        has_errors = counts.get("failed", 0) + counts.get("cancelled", 0) > 0
        written.append(_enqueue(session, endpoint_ids=to_tenant, event_type=batch_type, data={
            "id": batch.openai_id, "status": batch_type.removeprefix("batch."),
            "request_counts": {"total": sum(counts.values()),
                               "completed": counts.get("completed", 0),
                               "failed": counts.get("failed", 0)},
            "output_file_id": files.get("output") if counts.get("completed") else None,
            "error_file_id": files.get("error") if has_errors else None,
            "metadata": batch.metadata_,
            "specq": {"job_id": job_id, "cancelled": counts.get("cancelled", 0)}}))
    return [w for w in written if w is not None]


def batch_failed(session: Session, *, batch_id: int) -> str | None:
    """The batch.failed event of a batch whose file failed its checks (no job was made):
    call in the transaction that fails it."""
    return batch_ended_without_job(session, batch_id=batch_id, status="failed")


def batch_ended_without_job(session: Session, *, batch_id: int, status: str) -> str | None:
    """The batch.failed or batch.cancelled event of a batch that ended before it had a job
    (its file failed its checks; it was cancelled while validating): call in the
    transaction that ends it."""
    batch = session.scalar(select(Batch).where(Batch.id == batch_id)
                           .execution_options(populate_existing=True))
    if batch is None:
        return None
    to = _subscribers(session, tenant_id=batch.tenant_id, event_type=f"batch.{status}")
    data: dict[str, Any] = {"id": batch.openai_id, "status": status,
                            "request_counts": {"total": 0, "completed": 0, "failed": 0},
                            "metadata": batch.metadata_}
    if status == "failed":
        data["errors"] = (batch.errors or [])[:10]
    return _enqueue(session, endpoint_ids=to, event_type=f"batch.{status}", data=data)


# -- the sender's side --------------------------------------------------------------------

@dataclass(frozen=True)
class Due:
    """A delivery a sender holds: what to post, where, signed with what."""

    id: int
    event_id: str
    body: str
    url: str
    secrets: tuple[str, ...]  # the secret, and one rotated out that still signs
    attempts: int


def claim_due(session: Session, *, owner: str, hold: float, limit: int) -> list[Due]:
    """Take up to ``limit`` pending deliveries that are due and that no live lease holds,
    for ``hold`` seconds (longer than a post may take); commit before posting."""
    d, e = WebhookDelivery, WebhookEndpoint
    now = db_now()
    ids = list(session.scalars(
        select(d.id).where(d.status == PENDING, d.next_at <= now,
                           or_(d.lease_until.is_(None), d.lease_until < now))
        .order_by(d.next_at, d.id).limit(limit).with_for_update(skip_locked=True)))
    if not ids:
        return []
    # the lease's test again in the write: where the select took no row lock (SQLite) a
    # second sender read the same rows, and its write, after this one, must take none
    session.execute(update(d).where(d.id.in_(ids), d.status == PENDING,
                                    or_(d.lease_until.is_(None), d.lease_until < db_now()))
                    .values(lease_owner=owner, lease_until=db_now() + hold),
                    execution_options={"synchronize_session": False})
    rows = session.execute(
        select(d.id, d.event_id, d.body, e.url, e.secret, e.previous_secret, e.previous_until,
               d.attempts)
        .join(e, e.id == d.endpoint_id).where(d.id.in_(ids), d.lease_owner == owner)
        .order_by(d.id))
    wall = time.time()
    return [Due(i, event_id, body, url,
                (secret, previous) if previous and (until or 0) > wall else (secret,), attempts)
            for i, event_id, body, url, secret, previous, until, attempts in rows]


def record(session: Session, *, delivery_id: int, owner: str, status_code: int | None,
           error: str | None, seconds: float, backoff: float, backoff_max: float,
           retry_for: float) -> str:
    """One attempt's outcome: a 2xx delivers the row (for good); anything else makes it due
    again after ``backoff`` x 2^(attempts before), at most ``backoff_max``, or fails it
    once the event is ``retry_for`` seconds old. Returns the row's status after (GONE: the
    row was deleted meanwhile, with its endpoint). The attempt is kept in any case; the
    row changes only while ``owner`` holds its lease: a sender whose lease ran out (its
    post outlived it) leaves the row to the one that took it over."""
    d = WebhookDelivery
    ok = status_code is not None and 200 <= status_code < 300
    found = session.execute(
        select(d.attempts, db_now() - d.created, db_now()).where(d.id == delivery_id)
    ).one_or_none()
    if found is None:
        return GONE
    attempts, age, now = found
    session.add(WebhookAttempt(delivery_id=delivery_id, at=now, status_code=status_code,
                               error=None if error is None else error[:2000],
                               seconds=seconds, sender=owner[:300]))
    values: dict[str, Any] = {"attempts": attempts + 1, "lease_owner": None,
                              "lease_until": None}
    if ok:
        values.update(status=DELIVERED, delivered_at=now, last_error=None)
    else:
        why = error or f"answered {status_code}"
        pause = min(backoff * 2.0 ** min(attempts, 60), backoff_max)
        values.update(last_error=why[:2000], next_at=now + pause,
                      status=FAILED if age + pause > retry_for else PENDING)
    session.execute(update(d).where(d.id == delivery_id, d.status == PENDING,
                                    d.lease_owner == owner).values(**values),
                    execution_options={"synchronize_session": False})
    return str(session.scalar(select(d.status).where(d.id == delivery_id)))


def next_due_in(session: Session) -> float | None:
    """Seconds until the next pending delivery is due (0 if one is), None if none is
    pending: how long a sender may sleep."""
    d = WebhookDelivery
    soonest = session.scalar(select(func.min(d.next_at)).where(d.status == PENDING))
    if soonest is None:
        return None
    return max(0.0, float(soonest) - float(session.scalar(select(db_now())) or 0.0))


def backlog(session: Session) -> tuple[int, int, float]:
    """Deliveries pending, deliveries given up (failed), and the age in seconds of the
    oldest pending one (0 with none): what the exporter serves."""
    d = WebhookDelivery
    counts = dict(session.execute(select(d.status, func.count())
                                  .where(d.status.in_((PENDING, FAILED))).group_by(d.status)).all())
    oldest = session.execute(select(db_now() - func.min(d.created))
                             .where(d.status == PENDING)).scalar_one()
    return int(counts.get(PENDING, 0)), int(counts.get(FAILED, 0)), max(float(oldest or 0), 0.0)
