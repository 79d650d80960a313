"""A worker's /metrics against the database: for the same job every counter a worker
exports equals the sum the database holds (worker/metrics.py)."""

from __future__ import annotations

import socket
import urllib.request
import uuid

import pytest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import func, select

from specq.api.client import Client
from specq.db.models import Item, JobStatus


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int) -> dict[tuple[str, frozenset], float]:
    """(sample name, its labels) -> value, from http://127.0.0.1:PORT/metrics."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text.decode())
            for s in fam.samples}


def one(samples: dict, name: str, **labels: str) -> float:
    """The value of the sample ``name`` whose labels include ``labels``, summed over the rest."""
    found = [v for (n, ls), v in samples.items()
             if n == name and set(labels.items()) <= set(dict(ls).items())]
    assert found, f"{name} {labels} not exported"
    return sum(found)


def by_label(samples: dict, name: str, label: str) -> list[float]:
    """The samples of ``name`` as a list indexed by the integer label ``label``."""
    values = {int(dict(ls)[label]): v for (n, ls), v in samples.items() if n == name}
    return [values.get(i, 0) for i in range(max(values) + 1)] if values else []


@pytest.fixture(scope="module")
def metered(settings, start_worker):
    """A tiny-fixed worker of its own (a queue prefix no other test's worker reads) serving
    /metrics, and a client on its queues."""
    port = free_port()
    own = settings.model_copy(update={"queue_prefix": f"specq-prom-{uuid.uuid4().hex[:6]}",
                                      "metrics_port": port})
    worker = start_worker(own, "tiny-fixed", "metered")
    return worker, Client(own), port


def test_every_worker_counter_equals_the_database(metered):
    worker, client, port = metered
    before = scrape(port)
    assert one(before, "specq_generation_tokens_total") == 0  # warm-up is not counted
    job = client.submit([f"Rewrite sentence {i}: the quick brown fox jumps" for i in range(60)],
                        pair="tiny-fixed", max_new_tokens=10, chunk_size=20)
    state = job.wait(progress=False, timeout=300)
    assert state.status == JobStatus.completed.value, worker.output()
    got = scrape(port)
    m = job.metrics()
    with client.sessions() as s:
        prompt_tokens = s.scalar(select(func.sum(Item.prompt_tokens))
                                 .where(Item.job_id == job.id))
    assert m.prompt_tokens == prompt_tokens
    labels = {"pair": "tiny-fixed", "drafter": "model"}
    exact = {
        "specq_items_completed_total": m.completed,
        "specq_items_failed_total": m.failed,
        "specq_prompt_tokens_total": prompt_tokens,
        "specq_generation_tokens_total": m.new_tokens,
        "specq_target_passes_total": m.target_passes,
        "specq_spec_decode_num_drafts_total": m.draft_steps,
        "specq_spec_decode_num_draft_tokens_total": m.proposed,
        "specq_spec_decode_num_accepted_tokens_total": m.accepted,
    }
    for name, want in exact.items():
        assert one(got, name, **labels) == want, name
    assert m.proposed > 0 and m.completed == 60
    for name, want in {"specq_draft_seconds_total": m.draft_time,
                       "specq_verify_seconds_total": m.verify_time}.items():
        assert one(got, name, **labels) == pytest.approx(want, rel=1e-9), name
    assert by_label(got, "specq_spec_decode_num_accepted_tokens_per_pos_total",
                    "position") == m.accepted_by_position
    assert by_label(got, "specq_request_steps_total", "draft_length") == \
        m.steps_by_draft_length
    # the engine's own steps: each row of each step is one request step
    steps = one(got, "specq_step_seconds_count")
    assert steps == one(got, "specq_batch_size_count") == sum(
        by_label(got, "specq_batch_steps_total", "draft_length")) > 0
    assert one(got, "specq_batch_size_sum") == sum(m.steps_by_draft_length)
    for name in ("specq_items_retried_total", "specq_oom_halvings_total",
                 "specq_engine_restarts_total", "specq_chunks_resumed_total",
                 "specq_lease_renewals_failed_total"):
        assert one(got, name) == 0, name  # a healthy run
    assert one(got, "specq_chunks_run_total") >= 3  # a redelivered chunk runs again, empty
    # labels: pair, drafter, worker, and the bounded position / draft length; no job id
    names = {k for (_, ls) in got for k, _ in ls}
    assert names <= {"pair", "drafter", "worker", "position", "draft_length", "le"}
    workers = {dict(ls).get("worker") for (_, ls) in got} - {None}
    assert len(workers) == 1 and workers.pop().startswith(worker.name + "@")
