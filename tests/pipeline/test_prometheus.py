"""A worker's /metrics against the database: for the same job every counter a worker
exports equals the sum the database holds (worker/metrics.py)."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
import uuid

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import func, select

from specq.api.client import Client
from specq.db.models import Item, JobStatus
from specq.db.models import Job as JobRow
from tests.monitoring import PROMETHEUS, prometheus_tool
from tests.pipeline.conftest import ROOT


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
    deadline = time.monotonic() + 30  # a chunk is counted as run after its release, which
    while one(got, "specq_chunks_run_total") < 3:  # may settle the job a moment before
        assert time.monotonic() < deadline, worker.output()
        time.sleep(0.1)
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
        "specq_spec_decode_num_forced_draft_tokens_total": m.forced_proposed,
        "specq_spec_decode_num_forced_accepted_tokens_total": m.forced_accepted,
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
    # per row: its steps by the draft tokens it verified; as many row-steps as above
    assert by_label(got, "specq_request_steps_by_drafts_verified_total", "drafts_verified") \
        == m.steps_by_drafts_verified
    assert sum(m.steps_by_drafts_verified) == sum(m.steps_by_draft_length)
    # the engine's own steps: each row of each step is one request step
    steps = one(got, "specq_step_seconds_count")
    assert steps == one(got, "specq_batch_size_count") == sum(
        by_label(got, "specq_batch_steps_total", "draft_length")) > 0
    assert one(got, "specq_batch_size_sum") == sum(m.steps_by_draft_length)
    for name in ("specq_items_retried_total", "specq_oom_halvings_total",
                 "specq_engine_restarts_total", "specq_chunks_resumed_total",
                 "specq_lease_renewals_failed_total", "specq_leases_given_up_total",
                 "specq_writes_refused_total"):
        assert one(got, name) == 0, name  # a healthy run
    assert one(got, "specq_chunks_run_total") >= 3  # a redelivered chunk runs again, empty
    # labels: pair, drafter, worker, and the bounded position / draft length; no job id
    names = {k for (_, ls) in got for k, _ in ls}
    assert names <= {"pair", "drafter", "worker", "position", "draft_length",
                     "drafts_verified", "le"}
    workers = {dict(ls).get("worker") for (_, ls) in got} - {None}
    assert len(workers) == 1 and workers.pop().startswith(worker.name + "@")


@pytest.fixture
def exporter_port(metered, env_for, tmp_path):
    """`specq exporter` in a subprocess on the worker's database and broker, stopped after."""
    _, client, _ = metered
    port = free_port()
    log = (tmp_path / "exporter.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "specq.api.cli", "exporter", "--port",
                             str(port)], cwd=ROOT, env=env_for(client.settings), stdout=log,
                            stderr=subprocess.STDOUT)
    try:
        wait_until(lambda: _answers(port), 60, "the exporter did not start",
                   lambda: (tmp_path / "exporter.log").read_text())
        yield port
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.fixture
def prometheus(metered, exporter_port, tmp_path):
    """A real Prometheus (Debian's, installed when missing) scraping the worker and the
    exporter every second, with specq's alert rules loaded; stopped after."""
    binary = prometheus_tool("prometheus")
    _, _, worker_port = metered
    port = free_port()
    shutil.copy(PROMETHEUS / "alerts.yml", tmp_path / "alerts.yml")
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump({
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": ["alerts.yml"],
        "scrape_configs": [
            {"job_name": "specq-workers",
             "static_configs": [{"targets": [f"127.0.0.1:{worker_port}"]}]},
            {"job_name": "specq-exporter",
             "static_configs": [{"targets": [f"127.0.0.1:{exporter_port}"]}]}]}))
    log = (tmp_path / "prometheus.log").open("w")
    proc = subprocess.Popen([binary, f"--config.file={tmp_path / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp_path / 'data'}",
                             f"--web.listen-address=127.0.0.1:{port}"],
                            cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT)
    try:
        yield f"http://127.0.0.1:{port}", lambda: (tmp_path / "prometheus.log").read_text()
    finally:
        proc.terminate()
        proc.wait(30)


def _answers(port: int) -> bool:
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
        return True
    except OSError:
        return False


def wait_until(found, timeout: float, what: str, log=lambda: ""):
    """found()'s first true value, asked every half second for ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = found()
        if value:
            return value
        assert time.monotonic() < deadline, f"{what}\n{log()}"
        time.sleep(0.5)


def query(base: str, promql: str) -> list[dict]:
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
    try:
        body = json.loads(urllib.request.urlopen(url, timeout=10).read())
    except OSError:
        return []  # not up yet
    assert body["status"] == "success", body
    return body["data"]["result"]


def test_a_real_prometheus_scrapes_the_worker_and_the_exporter(metered, prometheus):
    """Prometheus scrapes both, answers queries over what they export (the worker's tokens
    as the worker counts them; the exporter's jobs as the database holds them), and loads
    the alert rules."""
    _, client, worker_port = metered
    base, log = prometheus
    job = client.submit(["Rewrite: the quick brown fox"] * 4, pair="tiny-fixed",
                        max_new_tokens=6, chunk_size=4)
    assert job.wait(progress=False, timeout=120).status == JobStatus.completed.value
    tokens = one(scrape(worker_port), "specq_generation_tokens_total")
    ups = wait_until(lambda: len(r := query(base, "up == 1")) == 2 and r, 60,
                     "the two targets are not both up", log)
    assert {u["metric"]["job"] for u in ups} == {"specq-workers", "specq-exporter"}
    got = wait_until(lambda: [r for r in query(base, "sum(specq_generation_tokens_total)")
                              if float(r["value"][1]) == tokens], 60,
                     f"Prometheus never saw the worker's {tokens} tokens", log)
    assert got
    with client.sessions() as s:
        completed = s.scalar(select(func.count()).select_from(JobRow)
                             .where(JobRow.status == JobStatus.completed.value))
    wait_until(lambda: [r for r in query(base, 'specq_jobs{status="completed"}')
                        if float(r["value"][1]) >= completed], 60,
               "the exporter's jobs never reached Prometheus", log)
    rate = wait_until(lambda: query(
        base, "sum by (pair) (rate(specq_spec_decode_num_accepted_tokens_total[1m])) >= 0"),
        60, "no acceptance rate", log)
    assert rate[0]["metric"] == {"pair": "tiny-fixed"}
    rules = json.loads(urllib.request.urlopen(f"{base}/api/v1/rules", timeout=10).read())
    loaded = {r["name"] for g in rules["data"]["groups"] for r in g["rules"]}
    assert {"SpecqNoProgress", "SpecqWorkerDown", "SpecqAcceptanceCollapsed"} <= loaded
