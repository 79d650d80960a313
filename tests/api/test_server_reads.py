"""What a poll of the HTTP door costs, and that its shortcuts change no answer: a live key is
remembered for KEY_TTL seconds at most (a revoked one is refused after it), and a batch is
read in one statement whose counts are its job's chunk sums, exact, for its tenant only."""

from __future__ import annotations

import pytest
from sqlalchemy import select, update

from specq.api.server import auth
from specq.api.server.batches import batch_object, reads
from specq.api.server.errors import ApiError
from specq.db import batches as store
from specq.db import chunks, tenants
from specq.db import repository as repo
from specq.db.models import Batch, Chunk, Job, JobStatus, Tenant, utcnow
from tests.db.test_plans import captured, plans, rows_read


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def statements(db_client):
    """The statements the client's engine sends while a test runs."""
    with captured(db_client.sessions.kw["bind"]) as got:
        yield got


def test_a_live_key_is_remembered_its_ttl_and_a_revoked_one_refused_after(db_client,
                                                                            statements):
    with db_client.sessions.begin() as s:
        key = tenants.create_key(s, tenant="ttl")
    clock = Clock()
    keys = auth.Keys(ttl=auth.KEY_TTL, clock=clock)
    header = f"Bearer {key}"
    assert keys.known(header) is None  # never checked: the database decides
    who = auth.who_is(db_client, header, keys)
    with db_client.sessions.begin() as s:
        assert tenants.revoke(s, tenant="ttl") == 1
    asked = len(statements)
    clock.now += auth.KEY_TTL  # within the bound: the server has not looked again
    assert keys.known(header) == who and auth.who_is(db_client, header, keys) == who
    assert len(statements) == asked
    clock.now += 0.001  # past it: the key is looked up, and refused
    assert keys.known(header) is None
    with pytest.raises(ApiError) as refused:
        auth.who_is(db_client, header, keys)
    assert refused.value.status == 401 and key not in str(refused.value)


def test_an_unknown_or_malformed_key_is_never_remembered(db_client):
    keys = auth.Keys(clock=Clock())
    for header in (None, "Basic x", "Bearer sk-specq-unknown"):
        with pytest.raises(ApiError):
            auth.who_is(db_client, header, keys)
        assert keys.known(header) is None
    with db_client.sessions.begin() as s:  # a key made after a refusal works at once
        key = tenants.create_key(s, tenant="late")
    assert auth.who_is(db_client, f"Bearer {key}", keys).tenant == "late"


def _batch(db_client, tenant: str, total: int, done: dict[int, tuple[int, int, int]]
           ) -> tuple[int, str]:
    """A batch of ``total`` requests whose chunk at each start of ``done`` counts
    (completed, failed, cancelled); its tenant's id and the batch's openai id."""
    with db_client.sessions.begin() as s:
        tenants.create_key(s, tenant=tenant)
        tenant_id = s.query(Tenant.id).filter(Tenant.name == tenant).scalar()
        job = repo.create_job(s, pair="tiny", params={}, chunk_size=10, source=None)
        job.total, job.status = total, JobStatus.in_progress.value
        chunks.insert_chunks(s, job_id=job.id, total=total, chunk_size=10)
        for start, (completed, failed, cancelled) in done.items():
            s.execute(update(Chunk).where(Chunk.job_id == job.id, Chunk.start == start)
                      .values(completed=completed, failed=failed, cancelled=cancelled))
        now = utcnow()
        batch = store.add_batch(s, openai_id=f"batch_{tenant}", tenant_id=tenant_id,
                                status="submitted", input_file_id=f"file-{tenant}",
                                endpoint="/v1/chat/completions", model="tiny",
                                completion_window="24h", created_at=now, expires_at=now,
                                job_id=job.id)
        batch.expires_at = now.replace(year=now.year + 1)
        for kind in ("output", "error"):
            store.add_file(s, openai_id=f"file-{tenant}-{kind}", tenant_id=tenant_id, kind=kind,
                           purpose="batch_output", filename=f"{kind}.jsonl", batch_id=batch.id)
        return tenant_id, batch.openai_id


def test_a_batch_is_read_in_one_statement_with_exact_counts(db_client, statements):
    mine, batch_id = _batch(db_client, "reader", 95, {0: (10, 0, 0), 10: (7, 2, 1),
                                                      90: (0, 0, 5)})
    other, _ = _batch(db_client, "other", 30, {0: (10, 0, 0)})
    before = len(statements)
    with reads(db_client.sessions)() as s:
        (read,) = store.read_batches(s, tenant_id=mine, openai_id=batch_id)
    assert len(statements) == before + 1
    obj = batch_object(read)
    assert obj["request_counts"] == {"total": 95, "completed": 17, "failed": 2}
    assert obj["specq"]["cancelled"] == 6 and obj["specq"]["pending"] == 95 - 17 - 2 - 6
    assert obj["output_file_id"] == "file-reader-output"
    assert obj["error_file_id"] == "file-reader-error"  # a request failed
    with reads(db_client.sessions)() as s:  # another tenant's batch is none of its
        assert store.read_batches(s, tenant_id=other, openai_id=batch_id) == []
        assert store.read_batches(s, tenant_id=mine, openai_id="batch_\x00") == []
        listed = store.read_batches(s, tenant_id=mine, batch_ids=[read.batch.id])
    assert [r.batch.openai_id for r in listed] == [batch_id]


def test_a_batch_that_ended_with_nothing_completed_names_no_output_file(db_client):
    """As OpenAI's: an all-failed (or all-cancelled) batch's output_file_id is null, its
    error file named; while it runs its output file is named (specq's partial download)."""
    mine, batch_id = _batch(db_client, "all-failed", 20, {0: (0, 10, 0), 10: (0, 0, 0)})

    def read() -> dict:
        with reads(db_client.sessions)() as s:
            (got,) = store.read_batches(s, tenant_id=mine, openai_id=batch_id)
        return batch_object(got)

    running = read()
    assert running["status"] == "in_progress"
    assert running["output_file_id"] == "file-all-failed-output"
    with db_client.sessions.begin() as s:
        job_id = s.scalar(select(Batch.job_id).where(Batch.openai_id == batch_id))
        s.execute(update(Chunk).where(Chunk.job_id == job_id, Chunk.start == 10)
                  .values(failed=10))
        s.execute(update(Job).where(Job.id == job_id).values(
            status=JobStatus.completed.value, finished_at=utcnow()))
    done = read()
    assert done["status"] == "completed" and done["request_counts"]["completed"] == 0
    assert done["output_file_id"] is None and done["error_file_id"] == "file-all-failed-error"


def test_a_batch_read_sums_only_its_own_jobs_chunks(pg_url):
    """On PostgreSQL the job's figures are summed from its own chunks only, however many
    other jobs there are (the LATERAL read is fenced; unfenced, every job is summed)."""
    from specq.api.client import Client
    from specq.configs.settings import Settings

    client = Client(Settings(database_url=pg_url, queue_prefix="specq-unused"),
                    auto_migrate=True)
    for i in range(5):
        _batch(client, f"crowd{i}-{id(client)}", 400, {})
    mine, batch_id = _batch(client, f"plan-{id(client)}", 50, {0: (10, 0, 0)})
    engine = client.sessions.kw["bind"]
    with captured(engine) as got:
        with reads(client.sessions)() as s:
            store.read_batches(s, tenant_id=mine, openai_id=batch_id)
    (found,) = plans(engine, got)
    assert rows_read(found["plan"]) <= 5 + 2  # its 5 chunks (and the job)


def _validating(db_client, tenant: str) -> tuple[int, int, str]:
    """A batch still validating, no job yet (its create running, or its server dead)."""
    with db_client.sessions.begin() as s:
        tenants.create_key(s, tenant=tenant)
        tenant_id = s.query(Tenant.id).filter(Tenant.name == tenant).scalar()
        now = utcnow()
        batch = store.add_batch(s, openai_id=f"batch_{tenant}", tenant_id=tenant_id,
                                status="validating", input_file_id=f"file-{tenant}",
                                endpoint="/v1/chat/completions", model="tiny",
                                completion_window="24h", created_at=now,
                                expires_at=now.replace(year=now.year + 1))
        return tenant_id, batch.id, batch.openai_id


def test_a_validating_batch_cancelled_ends_so_and_its_create_rolls_back(db_client):
    """Cancelled before its job is attached: cancelled, no job, its create's attach
    refused (the create rolls its job back); attached first: the cancel is the job's."""
    tenant_id, batch_id, openai_id = _validating(db_client, "cancel-first")
    with db_client.sessions.begin() as s:
        assert store.cancel_validating(s, batch_id=batch_id)
        assert not store.cancel_validating(s, batch_id=batch_id)  # once
    with db_client.sessions.begin() as s:
        job = repo.create_job(s, pair="tiny", params={}, chunk_size=10, source=None)
        assert not store.attach_job(s, batch_id=batch_id, job_id=job.id)
    with reads(db_client.sessions)() as s:
        (read,) = store.read_batches(s, tenant_id=tenant_id, openai_id=openai_id)
    obj = batch_object(read)
    assert obj["status"] == "cancelled" and obj["cancelled_at"] is not None
    assert obj["request_counts"] == {"total": 0, "completed": 0, "failed": 0}
    with db_client.sessions.begin() as s:  # the expiry pass's stale sweep leaves it alone
        assert store.fail_stale(s, before=utcnow().replace(year=utcnow().year + 2)) >= 0
    with reads(db_client.sessions)() as s:
        (read,) = store.read_batches(s, tenant_id=tenant_id, openai_id=openai_id)
    assert batch_object(read)["status"] == "cancelled"

    tenant_id, batch_id, openai_id = _validating(db_client, "attach-first")
    with db_client.sessions.begin() as s:
        job = repo.create_job(s, pair="tiny", params={}, chunk_size=10, source=None)
        assert store.attach_job(s, batch_id=batch_id, job_id=job.id)
    with db_client.sessions.begin() as s:
        assert not store.cancel_validating(s, batch_id=batch_id)
