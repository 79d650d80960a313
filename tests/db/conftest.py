"""Each db test runs on SQLite (a temporary file, WAL) and on a fresh PostgreSQL database."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone

import pytest

from specq.api.client import JobMetrics
from specq.configs.presets import PairPreset, get_preset
from specq.db import chunks
from specq.db import repository as repo
from specq.db.models import ItemStatus, JobStatus
from specq.db.outcomes import Outcome
from specq.db.session import migrate, session_factory
from specq.schema.counters import Counters
from specq.schema.counters import kinds as counter_kinds


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request, tmp_path_factory):
    """A migrated database URL; the PostgreSQL one is shared by the session's tests."""
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path_factory.mktemp('sqlite') / 'specq.db'}"
    else:
        url = request.getfixturevalue("pg_url")
    migrate(url)
    return url


@pytest.fixture
def sessions(db_url):
    return session_factory(db_url)


def queued_job(sessions, n=10, chunk_size=4, queue="q.tiny") -> int:
    """A queued job of n prompts p0, p1, ... on pair tiny, its chunks stored; its id."""
    with sessions.begin() as s:
        job = repo.create_job(s, pair="tiny", params={}, chunk_size=chunk_size, source=None,
                              queue=queue)
        rows = ({"index": i, "custom_id": None, "prompt": f"p{i}", "messages": None,
                 "params": None} for i in range(n))
        job.total = repo.insert_items(s, job_id=job.id, rows=rows)
        job.status = JobStatus.queued.value
        chunks.insert_chunks(s, job_id=job.id, total=n, chunk_size=chunk_size)
        return job.id


# Jobs with known outcomes, written through db/repository.py as workers write them: what the
# views and the worked queries of docs/database.md are checked against.

T0 = datetime(2026, 12, 1, 9, 0, 0, tzinfo=timezone.utc)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def counters(accepted_by_position: list[int], draft_steps: int, proposed: int,
             steps_by_draft_length: list[int], target_passes: int, new_tokens: int,
             draft_time: float, verify_time: float) -> Counters:
    return Counters(draft_steps=draft_steps, proposed=proposed,
                    accepted=sum(accepted_by_position), accepted_by_position=accepted_by_position,
                    target_passes=target_passes, new_tokens=new_tokens,
                    steps_by_draft_length=steps_by_draft_length, draft_time=draft_time,
                    verify_time=verify_time)


def done(index: int, c: Counters, start: float, end: float) -> Outcome:
    return Outcome(index, ItemStatus.completed, output=f"out{index}", token_ids=[1, 2],
                   finish_reason="length", prompt_tokens=3, counters=c, worker="w",
                   started_at=at(start), finished_at=at(end))


@dataclass
class KnownJob:
    """A job as written, and what was written to its items (None: no counters)."""

    name: str
    id: int
    status: JobStatus
    total: int
    statuses: dict[int, str] = field(default_factory=dict)  # index -> item status
    written: dict[int, Outcome] = field(default_factory=dict)  # index -> outcome written


def make_job(sessions, *, name: str, n: int, pair: str = "tiny", schedule: str | None = None,
             outcomes: list[Outcome] = (), cancel: bool = False,
             preset: PairPreset | None = None) -> KnownJob:
    """A job of ``n`` items whose ``outcomes`` are written by a worker; ``cancel``: the rest
    are cancelled (the job ends cancelled), else the job settles (completed once none is
    pending). With no outcomes and no cancel the job stays queued."""
    drafting = (preset or get_preset(pair)).drafting()
    with sessions.begin() as s:
        job = repo.create_job(s, pair=pair, params={"max_new_tokens": 8}, chunk_size=4,
                              source=f"{name}.jsonl", origin={"schedule": schedule,
                                                              "spec": schedule and "spec"},
                              drafting=drafting)
        rows = ({"index": i, "custom_id": f"{name}-{i}", "prompt": f"p{i}", "messages": None,
                 "params": None} for i in range(n))
        job.total = repo.insert_items(s, job_id=job.id, rows=rows)
        job.status = JobStatus.queued.value
        chunks.insert_chunks(s, job_id=job.id, total=n, chunk_size=job.chunk_size)
        job_id = job.id
    if outcomes:
        with sessions.begin() as s:
            repo.lock_job(s, job_id=job_id)
            repo.start_job(s, job_id=job_id)
            assert repo.write_outcomes(s, job_id=job_id, outcomes=list(outcomes)) == len(outcomes)
    if cancel:
        with sessions.begin() as s:
            status = repo.request_cancel(s, job_id=job_id)
        if status == JobStatus.cancelling:  # a worker cancels the rest at its next chunk
            with sessions.begin() as s:
                repo.lock_job(s, job_id=job_id)
                repo.cancel_pending(s, job_id=job_id)
                repo.settle_job(s, job_id=job_id)
    elif outcomes:
        with sessions.begin() as s:
            repo.lock_job(s, job_id=job_id)
            repo.settle_job(s, job_id=job_id)
    with sessions() as s:
        status = JobStatus(repo.get_job(s, job_id=job_id).status)
        statuses = {it.index: it.status for it in repo.iter_items(s, job_id=job_id)}
    return KnownJob(name, job_id, status, n, statuses, {o.index: o for o in outcomes})


def known_jobs(sessions, schedule: str) -> dict[str, KnownJob]:
    """A job with drafting, one without (drafter none: no draft steps), one with failed items
    (one after generating, one before), one cancelled while running, one queued with
    nothing written, one cancelled before it ran: the first four fired by ``schedule``."""
    c = counters
    jobs = {}
    jobs["drafting"] = make_job(sessions, name="drafting", n=4, schedule=schedule, outcomes=[
        done(0, c([5, 3, 1], 6, 20, [1, 2, 0, 3], 9, 21, 0.5, 1.25), 0.000001, 2.5),
        done(1, c([2, 1], 3, 9, [0, 1, 0, 2], 5, 9, 0.25, 0.75), 0.5, 1.999950),
        done(2, c([4], 5, 5, [2, 5], 8, 12, 0.125, 1.0), 1.0, 3.000001),
        done(3, c([1], 2, 7, [3, 0, 0, 2], 6, 4, 0.0625, 0.5), 2.0, 2.75),
    ])
    plain = PairPreset(name="tiny-plain", target={"tiny": "target"}, drafter="none")
    jobs["no-drafting"] = make_job(sessions, name="no-drafting", n=3, pair="tiny-plain",
                                   preset=plain, schedule=schedule, outcomes=[
        done(0, c([], 0, 0, [7], 8, 7, 0.0, 0.7), 10.0, 11.5),
        done(1, c([], 0, 0, [4], 5, 4, 0.0, 0.4), 10.25, 11.0),
        done(2, c([], 0, 0, [9], 10, 9, 0.0, 0.9), 10.5, 12.25),
    ])
    jobs["failures"] = make_job(sessions, name="failures", n=5, pair="tiny-lookup",
                                schedule=schedule, outcomes=[
        done(0, c([3, 2], 4, 8, [0, 0, 4], 6, 9, 0.0, 0.6), 20.0, 21.0),
        done(1, c([1], 2, 4, [1, 0, 2], 4, 3, 0.0, 0.3), 20.5, 22.0),
        done(3, c([2, 2, 1], 3, 6, [0, 0, 3], 5, 8, 0.0, 0.5), 21.0, 21.5),
        Outcome.failure(2, "CUDA error: device-side assert", worker="w",
                        counters=c([1], 1, 2, [0, 0, 1], 3, 2, 0.0, 0.2),
                        started_at=at(20.25), finished_at=at(23.0)),
        Outcome.failure(4, "prompt too long", worker="w", finished_at=at(25.0)),
    ])
    jobs["cancelled"] = make_job(sessions, name="cancelled", n=6, schedule=schedule, cancel=True,
                                 outcomes=[
        done(0, c([2, 1], 2, 8, [0, 0, 0, 0, 2], 4, 6, 0.25, 0.5), 30.0, 31.0),
        done(1, c([4, 3, 2, 1], 3, 12, [0, 0, 0, 0, 3], 5, 14, 0.5, 0.75), 30.0, 32.0),
    ])
    jobs["queued"] = make_job(sessions, name="queued", n=2)
    jobs["cancelled-queued"] = make_job(sessions, name="cancelled-queued", n=3, cancel=True)
    return jobs


def python_metrics(job: KnownJob) -> JobMetrics:
    """The job's metrics as Python computes them (api/client.py: JobMetrics over the
    Counters written), from what was written, not from the database."""
    counted = [o for o in job.written.values() if o.counters is not None]
    sums: dict = {}
    for name, kind in counter_kinds().items():
        values = [getattr(o.counters, name) for o in counted]
        if kind == "array":
            out = [0] * max((len(v) for v in values), default=0)
            for v in values:
                for i, n in enumerate(v):
                    out[i] += n
            sums[name] = out
        else:
            sums[name] = sum(values, 0.0 if kind == "float" else 0)
    counts = {s.value: list(job.statuses.values()).count(s.value) for s in ItemStatus}
    starts = [o.started_at for o in counted if o.started_at]
    ends = [o.finished_at for o in counted if o.finished_at]
    wall = (max(ends) - min(starts)).total_seconds() if starts and ends else None
    return JobMetrics(job_id=job.id, status=job.status.value, total=job.total, **counts,
                      wall_time=wall, **sums,
                      prompt_tokens=sum(o.prompt_tokens or 0 for o in counted))


def item_python_metrics(job: KnownJob, index: int) -> JobMetrics | None:
    """One item's figures as Python computes them: JobMetrics over its counters alone."""
    o = job.written.get(index)
    if o is None or o.counters is None:
        return None
    wall = ((o.finished_at - o.started_at).total_seconds()
            if o.started_at and o.finished_at else None)
    return JobMetrics(job_id=job.id, status=o.status.value, total=1, completed=0, failed=0,
                      cancelled=0, pending=0, wall_time=wall, **o.counters.as_dict())
