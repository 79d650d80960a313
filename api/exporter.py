"""The control plane's Prometheus metrics: what is left to do, what is waiting, what the
reconcilers did, and whether the database and the broker answer.

`specq exporter --port N` serves them (one per deployment is enough; more do no harm), and
`specq serve` mounts the same collector at /metrics. Each scrape reads the database and the
broker afresh, and reads little: the chunk rows of unfinished jobs (their counts by status,
kept as items are written: db/chunks.py), never the items, so a scrape costs the same with
a million items stored as with ten (tests/db/test_plans.py holds its plan to that).

    specq_unfinished_items{pair,priority}      items not ended yet (what an autoscaler reads)
    specq_unfinished_chunks{pair,priority}     chunks not done
    specq_waiting_chunks{pair,priority}        of them, no live lease holds (queued, or lost)
    specq_oldest_waiting_seconds{pair}         age of the oldest job with a waiting chunk
    specq_jobs{status}                         jobs by status
    specq_reconciler_actions_total{action}     runs, resent, settled, refilled, abandoned,
                                               database_errors (broker/reconciler.py)
    specq_webhook_deliveries{status}           webhook deliveries pending, and given up
                                               (failed) (db/webhooks.py)
    specq_webhook_oldest_pending_seconds       age of the oldest delivery not made yet
    specq_retention_swept_total{what}          what retention sweeps deleted or emptied:
                                               files, file_bytes, outputs, jobs_emptied,
                                               items_emptied, jobs_deleted, items_deleted,
                                               deliveries
    specq_database_up, specq_broker_up         1 when the scrape read it, else 0
    specq_exporter_errors_total{source}        scrapes the database or the broker failed
"""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Iterator
from typing import Any

from sqlalchemy import and_, false, func, or_, select
from sqlalchemy.orm import Session, sessionmaker

from specq.api.retention import read_swept
from specq.broker import connection
from specq.broker.reconciler import ACTIONS, read_actions
from specq.configs.settings import Settings, get_settings
from specq.db import webhooks
from specq.db.clock import db_now
from specq.db.models import RUNNING, Chunk, Job, JobStatus, as_utc
from specq.db.session import session_factory

log = logging.getLogger(__name__)


def unfinished(session: Session) -> list[Any]:
    """One row per unfinished job (stored whole): pair, priority, created_at, its chunks not
    done, their items not ended, those of them no live lease holds, and the database's
    clock. Each count is a subquery over the job's own chunks not done (the index
    (job_id, done, start)), never over its items."""
    c = Chunk.__table__.c
    mine = and_(c.job_id == Job.id, c.done == false())  # "= false": the index's, not IS

    def over_chunks(what: Any, *where: Any) -> Any:
        return select(what).where(mine, *where).scalar_subquery()

    waiting = or_(c.lease_owner.is_(None), c.lease_until < db_now())
    return list(session.execute(
        select(Job.pair, Job.priority, Job.created_at,
               over_chunks(func.count()).label("chunks"),
               over_chunks(func.coalesce(func.sum(
                   c.end - c.start - c.completed - c.failed - c.cancelled), 0)).label("items"),
               over_chunks(func.count(), waiting).label("waiting"),
               db_now().label("now"))
        .where(Job.status.in_(RUNNING))
    ).all())


def jobs_by_status(session: Session) -> dict[str, int]:
    counts = dict(session.execute(select(Job.status, func.count()).group_by(Job.status)).all())
    return {s.value: int(counts.get(s.value, 0)) for s in JobStatus}


class ControlPlane:
    """A prometheus_client collector: collect() reads the database and the broker."""

    def __init__(self, settings: Settings, sessions: sessionmaker[Session] | None = None
                 ) -> None:
        self.settings = settings
        self.sessions = sessions or session_factory(settings.sqlalchemy_url)
        self.errors = {"database": 0, "broker": 0}

    def describe(self) -> list:
        return []  # collected on scrape only (registering must not touch the database)

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        db_up = broker_up = 1
        try:
            with self.sessions() as s:
                rows = unfinished(s)
                jobs = jobs_by_status(s)
                hooks = webhooks.backlog(s)
        except Exception as exc:  # noqa: BLE001 (the database away: a gauge says so)
            log.warning("exporter: the database did not answer (%s: %s)", type(exc).__name__,
                        str(exc).splitlines()[0] if str(exc) else "")
            self.errors["database"] += 1
            db_up, rows, jobs, hooks = 0, None, None, None
        try:
            client = connection.broker_client(self.settings)
            try:
                actions = read_actions(client, self.settings)
                swept = read_swept(client, self.settings)
            finally:
                client.close()
        except Exception as exc:  # noqa: BLE001 (the broker's errors vary by transport)
            log.warning("exporter: the broker did not answer (%s)", exc)
            self.errors["broker"] += 1
            broker_up, actions, swept = 0, None, None

        if rows is not None and jobs is not None:
            yield from self._queue(rows, GaugeMetricFamily)
            g = GaugeMetricFamily("specq_jobs", "Jobs by status", labels=["status"])
            for status, n in jobs.items():
                g.add_metric([status], n)
            yield g
        if hooks is not None:
            g = GaugeMetricFamily("specq_webhook_deliveries", "Webhook deliveries pending, and "
                                  "given up after their retries (failed)", labels=["status"])
            g.add_metric(["pending"], hooks[0])
            g.add_metric(["failed"], hooks[1])
            yield g
            yield GaugeMetricFamily("specq_webhook_oldest_pending_seconds", "Age of the oldest "
                                    "webhook delivery not made yet", value=hooks[2])
        if swept is not None:
            c = CounterMetricFamily("specq_retention_swept", "What retention sweeps deleted "
                                    "or emptied, added up", labels=["what"])
            for name, n in swept.items():
                c.add_metric([name], n)
            yield c
        if actions is not None:
            c = CounterMetricFamily("specq_reconciler_actions",
                                    "What the deployment's reconcilers did, added up",
                                    labels=["action"])
            for name in ACTIONS:
                c.add_metric([name], actions[name])
            yield c
        for name, up, what in (("specq_database_up", db_up, "database"),
                               ("specq_broker_up", broker_up, "broker")):
            yield GaugeMetricFamily(name, f"1 when the last scrape read the {what}, else 0",
                                    value=up)
        c = CounterMetricFamily("specq_exporter_errors",
                                "Scrapes that could not read the database or the broker",
                                labels=["source"])
        for source, n in self.errors.items():
            c.add_metric([source], n)
        yield c

    @staticmethod
    def _queue(rows: list[Any], gauge: Any) -> Iterator[Any]:
        items = gauge("specq_unfinished_items", "Items of unfinished jobs not ended yet",
                      labels=["pair", "priority"])
        chunks = gauge("specq_unfinished_chunks", "Chunks of unfinished jobs not done",
                       labels=["pair", "priority"])
        waiting = gauge("specq_waiting_chunks", "Unfinished chunks no live lease holds "
                        "(queued, waiting their turn, or lost)", labels=["pair", "priority"])
        oldest = gauge("specq_oldest_waiting_seconds", "Seconds since the oldest unfinished "
                       "job with a waiting chunk was submitted", labels=["pair"])
        sums: dict[tuple[str, str], list[int]] = {}
        ages: dict[str, float] = {}
        for r in rows:
            got = sums.setdefault((r.pair, r.priority), [0, 0, 0])
            got[0] += r.items
            got[1] += r.chunks
            got[2] += r.waiting
            if r.waiting:
                created = as_utc(r.created_at)  # SQLite's come back naive
                ages[r.pair] = max(ages.get(r.pair, 0.0), float(r.now) - created.timestamp())
        for (pair, priority), (n_items, n_chunks, n_waiting) in sorted(sums.items()):
            items.add_metric([pair, priority], n_items)
            chunks.add_metric([pair, priority], n_chunks)
            waiting.add_metric([pair, priority], n_waiting)
        for pair, age in sorted(ages.items()):
            oldest.add_metric([pair], max(age, 0.0))
        yield from (items, chunks, waiting, oldest)


def registry(settings: Settings, sessions: sessionmaker[Session] | None = None) -> Any:
    """A registry holding the control-plane collector alone."""
    from prometheus_client import CollectorRegistry

    reg = CollectorRegistry(auto_describe=False)
    reg.register(ControlPlane(settings, sessions))
    return reg


# -- `specq exporter` -------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    """Serve the control plane's metrics until stopped."""
    try:
        from prometheus_client import start_http_server
    except ImportError:
        raise SystemExit("specq exporter needs prometheus-client: pip install "
                         "'specq[exporter]'") from None
    settings = get_settings()
    start_http_server(args.port, addr=args.host, registry=registry(settings))
    log.info("control-plane metrics on http://%s:%d/metrics", args.host, args.port)
    print(f"specq exporter: http://{args.host}:{args.port}/metrics", flush=True)
    while True:
        time.sleep(3600)
