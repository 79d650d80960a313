"""Jobs and their items: the source of truth for what was asked and what came back."""

from __future__ import annotations

import re
from datetime import datetime, timezone
from enum import Enum
from typing import TYPE_CHECKING, Any, ClassVar, overload

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Table,
    Text,
    UniqueConstraint,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from specq.schema.counters import kinds as counter_kinds


class JobStatus(str, Enum):
    """A job's life, named as in the OpenAI Batch API.

    validating → queued → in_progress → completed; failed when the job itself cannot run
    (a single item's failure is the item's, the job still completes); cancelling →
    cancelled once no item is pending.
    """

    validating = "validating"
    queued = "queued"
    in_progress = "in_progress"
    completed = "completed"
    failed = "failed"
    cancelling = "cancelling"
    cancelled = "cancelled"

    @property
    def finished(self) -> bool:
        return self in (JobStatus.completed, JobStatus.failed, JobStatus.cancelled)


# The two sets of job statuses the queries use, defined once.
UNFINISHED = tuple(s.value for s in JobStatus if not s.finished)  # not ended yet
# stored whole and not ended: its chunks may be sent and run, and it settles once none of
# its items is pending (a validating job is still being stored)
RUNNING = tuple(s.value for s in JobStatus if not s.finished and s != JobStatus.validating)


class ItemStatus(str, Enum):
    """One prompt's state: pending until a worker writes its outcome, once."""

    pending = "pending"
    completed = "completed"
    failed = "failed"
    cancelled = "cancelled"


OPENAI_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")  # the ids made here: file-HEX, batch_HEX, we_HEX


def could_be_id(text: str) -> bool:
    """Whether ``text`` has the shape of an id made here. Anything else (a NUL, a lone
    surrogate, a quote) is no file's or batch's, and is never sent to the database, which
    may refuse to even compare it (PostgreSQL and NUL)."""
    return OPENAI_ID.fullmatch(text) is not None


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


@overload
def as_utc(when: datetime) -> datetime: ...
@overload
def as_utc(when: None) -> None: ...
def as_utc(when: datetime | None) -> datetime | None:
    """A stored time in UTC, with its offset: SQLite hands times back without their zone
    (they are UTC), PostgreSQL in the session's zone. The one place a naive time is read
    as UTC."""
    if when is None:
        return None
    return when.astimezone(timezone.utc) if when.tzinfo else when.replace(tzinfo=timezone.utc)


NAMING = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s_%(column_1_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)
    if TYPE_CHECKING:  # every model maps one Table (the declared type is any FromClause)
        __table__: ClassVar[Table]


class Job(Base):
    __tablename__ = "jobs"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    status: Mapped[str] = mapped_column(String(16), default=JobStatus.validating.value)
    pair: Mapped[str] = mapped_column(String(200))
    params: Mapped[dict[str, Any]] = mapped_column(JSON)  # SamplingParams defaults of the job
    total: Mapped[int] = mapped_column(Integer, default=0)  # number of items
    chunk_size: Mapped[int] = mapped_column(Integer)
    queue: Mapped[str | None] = mapped_column(String(300))  # the broker queue of its chunks
    # high | normal | low: its chunks' message priority on the queue (broker/names.py)
    priority: Mapped[str] = mapped_column(String(8), default="normal")
    source: Mapped[str | None] = mapped_column(Text)  # the submitted file, if any
    # Synthesis runs (api/synthesis.py): the spec that produced the job, the beat schedule
    # that fired it (None for a run by hand), the resolved spec, and where its data set went.
    spec: Mapped[str | None] = mapped_column(String(200))
    schedule: Mapped[str | None] = mapped_column(String(200), index=True)
    synthesis: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    output_path: Mapped[str | None] = mapped_column(Text)
    # How its pair drafts, from the preset at submission (PairPreset.drafting): drafter
    # model | prompt_lookup | suffix | none, the draft model (drafter model only), the draft length
    # g and whether g adapts ('adaptive') or is pinned ('fixed'); NULL where not known.
    drafter: Mapped[str | None] = mapped_column(String(32))
    draft_model: Mapped[str | None] = mapped_column(String(300))
    draft_length: Mapped[int | None] = mapped_column(Integer)
    draft_mode: Mapped[str | None] = mapped_column(String(16))
    error: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    # when the retention sweep emptied its results (db/retention.py); NULL: not swept
    swept_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class Item(Base):
    """One prompt of a job and, once written, its outcome and counters."""

    __tablename__ = "items"
    __table_args__ = (
        UniqueConstraint("job_id", "custom_id"),
        # (job_id, status, index): a job's items of one status in index order. With the
        # primary key (job_id, index), every index the planner may pick for a hot query
        # (a chunk's pending items, the write-once UPDATE, counts by status) narrows to
        # the rows it needs, whatever the table's statistics say (a bulk insert leaves
        # them stale; tests/db/test_plans.py).
        Index("ix_items_job_id_status_index", "job_id", "status", "index"),
    )

    job_id: Mapped[int] = mapped_column(
        ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True
    )
    index: Mapped[int] = mapped_column(Integer, primary_key=True)  # 0-based, input order
    custom_id: Mapped[str | None] = mapped_column(String(512))
    prompt: Mapped[str | None] = mapped_column(Text)  # exactly one of prompt, messages
    messages: Mapped[list[dict[str, Any]] | None] = mapped_column(JSON)
    params: Mapped[dict[str, Any] | None] = mapped_column(JSON)  # per-item overrides
    status: Mapped[str] = mapped_column(String(16), default=ItemStatus.pending.value)
    output: Mapped[str | None] = mapped_column(Text)
    token_ids: Mapped[list[int] | None] = mapped_column(JSON)
    finish_reason: Mapped[str | None] = mapped_column(String(16))
    error: Mapped[str | None] = mapped_column(Text)
    prompt_tokens: Mapped[int | None] = mapped_column(Integer)
    worker: Mapped[str | None] = mapped_column(String(255))  # hostname that wrote the outcome
    writes: Mapped[int] = mapped_column(Integer, default=0)  # outcomes written since pending: 0/1
    # Engine failures while generating this item (the error of the latest is in ``error``
    # while it stays pending); it fails for good at SPECQ_MAX_ATTEMPTS x (retries + 1).
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    retries: Mapped[int] = mapped_column(Integer, default=0)  # sent back by `specq retry`
    # The engine run that holds the item in its batch now: set (and committed) when the item
    # joins a batch, cleared when its outcome or failure is written. Still set when a later
    # run opens the chunk: that run's worker died with the item in flight (worker/attempts.py).
    launch: Mapped[str | None] = mapped_column(String(300))
    # Workers that died (killed, crashed, device lost) with this item in their batch; one
    # that died with the item alone in its batch also counts an attempt.
    crashes: Mapped[int] = mapped_column(Integer, default=0)
    started_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class Chunk(Base):
    """One task's range of a job's items [start, end), and who is running it.

    A worker running the chunk holds its lease (``lease_owner`` until ``lease_until``,
    seconds since the epoch on the database's clock) and renews it by heartbeat. ``done``:
    no item of the range was pending when its last run ended. ``sent_at`` (database
    clock): when a message for it was last sent to the broker (or is about to be); NULL
    while it waits its turn: a job keeps only a few messages on the broker at a time
    (broker/dispatch.py). The reconciler re-sends a chunk that was sent, is not done, not
    leased, and that no message on the broker holds.
    """

    __tablename__ = "chunks"
    __table_args__ = (
        # (job_id, done, start): like items', any index the planner picks narrows to the
        # chunk asked for
        Index("ix_chunks_job_id_done_start", "job_id", "done", "start"),
        # the chunks no message was sent for yet, in order: dispatch takes the next ones
        Index("ix_chunks_unsent", "job_id", "start", postgresql_where=text("sent_at IS NULL"),
              sqlite_where=text("sent_at IS NULL")),
    )

    job_id: Mapped[int] = mapped_column(
        ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True
    )
    start: Mapped[int] = mapped_column(Integer, primary_key=True)
    end: Mapped[int] = mapped_column(Integer)
    done: Mapped[bool] = mapped_column(Boolean, default=False)
    lease_owner: Mapped[str | None] = mapped_column(String(300))
    lease_until: Mapped[float | None] = mapped_column(Float)
    sent_at: Mapped[float | None] = mapped_column(Float)
    sends: Mapped[int] = mapped_column(Integer, default=0)  # messages sent for it
    runs: Mapped[int] = mapped_column(Integer, default=0)  # leases taken on it
    leased_at: Mapped[float | None] = mapped_column(Float)  # when its first lease was taken
    # Its items counted by status, the sums of their counters (below, one column per
    # counter, NULL: none yet), and the first start and last finish of those that reached
    # the engine: what a job's metrics add up (the view job_metrics), so reading them
    # costs a job's chunks, not its items. Kept in the transactions that change its items
    # (db/chunks.py: add_sums, recount, resum): the chunk's own row, no job-wide hot row.
    completed: Mapped[int] = mapped_column(Integer, default=0)  # its items by status
    failed: Mapped[int] = mapped_column(Integer, default=0)
    cancelled: Mapped[int] = mapped_column(Integer, default=0)
    first_started: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    last_finished: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    # Faults met while running it: engine exceptions (out-of-memory halvings included) and
    # workers that died with its items in flight; the first one's error and when (database
    # clock); items that ran alone because a fault had struck them.
    faults: Mapped[int] = mapped_column(Integer, default=0)
    first_fault: Mapped[str | None] = mapped_column(Text)
    first_fault_at: Mapped[float | None] = mapped_column(Float)
    isolated: Mapped[int] = mapped_column(Integer, default=0)
    # What its runs cost (db/chunks.py: charge): the device seconds they held it, each run
    # from its lease to its last write or heartbeat; the database-clock time up to which the
    # current lease is charged (NULL: not leased); those seconds priced at each run's
    # worker's price per device-hour (NULL: no run had a price). And its items' tokens in.
    held_seconds: Mapped[float] = mapped_column(Float, default=0.0)
    held_since: Mapped[float | None] = mapped_column(Float)
    cost: Mapped[float | None] = mapped_column(Float)
    prompt_tokens: Mapped[int | None] = mapped_column(Integer)


# The counter columns, one per field of schema/counters.py: Counters, on items (each
# item's) and on chunks (their items' sums). Rates are derived, never stored: INTEGER,
# FLOAT, or a JSON array per draft position or length.
_COUNTER_TYPES = {"int": Integer, "float": Float, "array": JSON}
for _table in (Item, Chunk):
    for _name, _kind in counter_kinds().items():
        setattr(_table, _name, mapped_column(_name, _COUNTER_TYPES[_kind], nullable=True))


# -- the OpenAI Batch API's tenants, keys, files and batches (api/server/) ----------------


class Tenant(Base):
    """Who owns files and batches over HTTP; one tenant never sees another's."""

    __tablename__ = "tenants"
    __table_args__ = (UniqueConstraint("name", name="uq_tenants_name"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(200))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class ApiKey(Base):
    """A tenant's key, stored as the SHA-256 of the key (a random 256-bit secret, so a plain
    hash is as strong as a slow one) and its first characters, to tell keys apart."""

    __tablename__ = "api_keys"
    __table_args__ = (UniqueConstraint("key_hash", name="uq_api_keys_key_hash"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"),
                                           index=True)
    key_hash: Mapped[str] = mapped_column(String(64))
    prefix: Mapped[str] = mapped_column(String(32))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class File(Base):
    """A file of the Files API: an uploaded batch input (kind 'input', its bytes in the
    file store), or a batch's output or error file (kind 'output' | 'error', made from the
    items on download)."""

    __tablename__ = "files"
    __table_args__ = (
        UniqueConstraint("openai_id", name="uq_files_openai_id"),
        Index("ix_files_tenant_id_id", "tenant_id", "id"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    openai_id: Mapped[str] = mapped_column(String(64))
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    kind: Mapped[str] = mapped_column(String(8))
    purpose: Mapped[str] = mapped_column(String(32))
    filename: Mapped[str] = mapped_column(String(512))
    bytes: Mapped[int | None] = mapped_column(BigInteger)
    lines: Mapped[int | None] = mapped_column(Integer)
    stored_in: Mapped[str | None] = mapped_column(String(16))  # directory | database
    batch_id: Mapped[int | None] = mapped_column(ForeignKey("batches.id", ondelete="CASCADE"))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    # when the retention sweep deletes it (db/retention.py); NULL: kept
    expires_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), index=True)


class FilePart(Base):
    """A piece of an uploaded file kept in the database (SPECQ_FILE_STORE=database)."""

    __tablename__ = "file_parts"

    file_id: Mapped[int] = mapped_column(ForeignKey("files.id", ondelete="CASCADE"),
                                         primary_key=True)
    part: Mapped[int] = mapped_column(Integer, primary_key=True)
    data: Mapped[bytes] = mapped_column(LargeBinary)


class DeletedFile(Base):
    """A file deleted (through the API, or by the retention sweep) kept by its id, so that a
    listing's cursor still finds its place: the SDKs page with the last id they were given,
    which a loop deleting what it lists has just deleted. Swept once DELETED_FILES_KEPT has
    passed (db/retention.py)."""

    __tablename__ = "deleted_files"

    openai_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    seq: Mapped[int] = mapped_column(Integer)  # the file's row id: its place in a listing
    deleted_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow,
                                                 index=True)


class Batch(Base):
    """A batch of the Batch API: its request, and the job that runs it. Its status is the
    job's once the job exists (api/server/batches.py); before, validating or failed."""

    __tablename__ = "batches"
    __table_args__ = (
        UniqueConstraint("openai_id", name="uq_batches_openai_id"),
        UniqueConstraint("tenant_id", "idempotency_key"),
        Index("ix_batches_tenant_id_id", "tenant_id", "id"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    openai_id: Mapped[str] = mapped_column(String(64))
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    key_id: Mapped[int | None] = mapped_column(ForeignKey("api_keys.id", ondelete="SET NULL"))
    job_id: Mapped[int | None] = mapped_column(ForeignKey("jobs.id", ondelete="SET NULL"),
                                               index=True)
    status: Mapped[str] = mapped_column(String(16))  # validating | failed | submitted |
    # cancelled (while validating: it never had a job)
    input_file_id: Mapped[str] = mapped_column(String(64))
    endpoint: Mapped[str] = mapped_column(String(64))
    model: Mapped[str | None] = mapped_column(String(300))
    completion_window: Mapped[str] = mapped_column(String(16))
    metadata_: Mapped[dict[str, Any] | None] = mapped_column("metadata", JSON)
    errors: Mapped[list[dict[str, Any]] | None] = mapped_column(JSON)
    idempotency_key: Mapped[str | None] = mapped_column(String(255))
    request_hash: Mapped[str | None] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    expires_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    in_progress_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    failed_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    cancelling_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    expired_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    # seconds after its end when its output and error files expire (OpenAI's
    # output_expires_after); NULL: the operator's retention_outputs alone
    output_expires_after: Mapped[int | None] = mapped_column(Integer)


# -- webhooks: who is told when a batch or a job ends (db/webhooks.py) --------------------


class WebhookEndpoint(Base):
    """A URL told of the events of one tenant's batches (``tenant_id``), or, with no tenant,
    the operator's: told of every job's end. Its signing secret is kept as given out
    (``whsec_`` and base64): signing needs the secret itself, so it cannot be hashed; it
    is shown once, when made, and never logged."""

    __tablename__ = "webhook_endpoints"
    __table_args__ = (UniqueConstraint("openai_id", name="uq_webhook_endpoints_openai_id"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    openai_id: Mapped[str] = mapped_column(String(64))
    tenant_id: Mapped[int | None] = mapped_column(
        ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    name: Mapped[str] = mapped_column(String(200))
    url: Mapped[str] = mapped_column(Text)
    event_types: Mapped[list[str]] = mapped_column(JSON)
    secret: Mapped[str] = mapped_column(String(100))
    # the secret before a rotation that keeps it valid a while: posts are signed with both
    # until ``previous_until`` (seconds since the epoch)
    previous_secret: Mapped[str | None] = mapped_column(String(100))
    previous_until: Mapped[float | None] = mapped_column(Float)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class WebhookDelivery(Base):
    """The outbox: one event for one endpoint, written in the transaction that ended the
    batch or job. ``body`` is the exact JSON sent on every attempt; ``event_id`` is its
    ``webhook-id``. pending until a 2xx (delivered) or until the retries run out (failed);
    a sender holds it while it posts (``lease_until``, database clock)."""

    __tablename__ = "webhook_deliveries"
    __table_args__ = (
        UniqueConstraint("event_id", "endpoint_id"),
        Index("ix_webhook_deliveries_status_next_at", "status", "next_at"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    event_id: Mapped[str] = mapped_column(String(64))
    endpoint_id: Mapped[int] = mapped_column(
        ForeignKey("webhook_endpoints.id", ondelete="CASCADE"), index=True)
    type: Mapped[str] = mapped_column(String(64))
    body: Mapped[str] = mapped_column(Text)
    status: Mapped[str] = mapped_column(String(16), default="pending")
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    created: Mapped[float] = mapped_column(Float)  # seconds since the epoch (database clock)
    next_at: Mapped[float] = mapped_column(Float)  # not sent again before this
    lease_owner: Mapped[str | None] = mapped_column(String(300))
    lease_until: Mapped[float | None] = mapped_column(Float)
    delivered_at: Mapped[float | None] = mapped_column(Float)
    last_error: Mapped[str | None] = mapped_column(Text)


class WebhookAttempt(Base):
    """One post of a delivery: when, the answer's status code (NULL: none came), the error,
    how long it took and which sender made it."""

    __tablename__ = "webhook_attempts"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    delivery_id: Mapped[int] = mapped_column(
        ForeignKey("webhook_deliveries.id", ondelete="CASCADE"), index=True)
    at: Mapped[float] = mapped_column(Float)
    status_code: Mapped[int | None] = mapped_column(Integer)
    error: Mapped[str | None] = mapped_column(Text)
    seconds: Mapped[float] = mapped_column(Float)
    sender: Mapped[str] = mapped_column(String(300))
