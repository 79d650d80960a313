"""The Kubernetes example (deploy/kubernetes/), parsed and checked against the code: the
commands are specq's, the environment is what the settings read, secrets come from the
Secret, the metrics ports agree, and KEDA scales the workers by the pair's unfinished
chunks: a metric the exporter exports (Prometheus trigger), or a SQL count that equals it on
a real database (PostgreSQL trigger), never the Redis list length."""

from __future__ import annotations

import re

import pytest
import yaml
from sqlalchemy import text

from specq.api import exporter
from specq.api.cli import parser
from specq.api.client import Client
from specq.configs.settings import Settings
from specq.db import chunks
from specq.db.models import RUNNING
from specq.worker.tiny import build_tiny_pair
from tests.conftest import fresh_pg_database
from tests.monitoring import ROOT

K8S = ROOT / "deploy" / "kubernetes"
DOCS = [d for path in sorted(K8S.glob("*.yaml")) for d in yaml.safe_load_all(path.read_text())
        if d]


def kind(name: str) -> list[dict]:
    return [d for d in DOCS if d["kind"] == name]


def deployment(component: str) -> dict:
    (found,) = [d for d in kind("Deployment")
                if d["metadata"]["labels"]["app.kubernetes.io/component"] == component]
    return found


def container(d: dict) -> dict:
    (c,) = d["spec"]["template"]["spec"]["containers"]
    return c


def env(c: dict) -> dict[str, dict]:
    return {e["name"]: e for e in c["env"]}


def test_every_manifest_parses_with_kind_and_name():
    assert DOCS
    for d in DOCS:
        assert d["apiVersion"] and d["kind"] and d["metadata"]["name"], d
    assert {"Deployment", "Service", "ScaledObject", "Secret", "TriggerAuthentication"} <= {
        d["kind"] for d in DOCS}


@pytest.mark.parametrize("component", ["worker", "exporter"])
def test_pods_run_specq_commands_with_settings_it_reads(component):
    d = deployment(component)
    labels = d["spec"]["template"]["metadata"]["labels"]
    assert d["spec"]["selector"]["matchLabels"].items() <= labels.items()
    c = container(d)
    assert c["command"][:2] == ["specq", component]
    args = parser().parse_args(c["command"][1:])  # what `specq` itself would accept
    known = {f"SPECQ_{f.upper()}" for f in Settings.model_fields}
    variables = env(c)
    assert {n for n in variables if n.startswith("SPECQ_")} <= known
    for name in ("SPECQ_BROKER_URL", "SPECQ_DATABASE_URL"):  # never a literal secret
        ref = variables[name]["valueFrom"]["secretKeyRef"]
        (secret,) = kind("Secret")
        assert ref["name"] == secret["metadata"]["name"] and ref["key"] in secret["stringData"]
    Settings(**{n.removeprefix("SPECQ_").lower(): e["value"] for n, e in variables.items()
                if n.startswith("SPECQ_") and "value" in e})
    pod = d["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["runAsUser"] != 0
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    # the port Prometheus is told to scrape is the one the process listens on
    port = int(d["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"])
    assert {p["containerPort"] for p in c["ports"]} == {port}
    if component == "worker":
        assert int(variables["SPECQ_METRICS_PORT"]["value"]) == port
        assert variables["SPECQ_METRICS_HOST"]["value"] == "0.0.0.0"
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert args.pair == d["metadata"]["labels"]["specq/pair"]
    else:
        assert args.port == port and args.host == "0.0.0.0"
        (service,) = kind("Service")
        assert service["spec"]["selector"].items() <= labels.items()
        assert service["spec"]["ports"][0]["port"] == port


def scaled_objects() -> list[dict]:
    return kind("ScaledObject")


def test_keda_scales_the_worker_deployment_by_unfinished_chunks_of_its_pair(tmp_path):
    worker = deployment("worker")
    pair = worker["metadata"]["labels"]["specq/pair"]
    data = tmp_path / "data"
    build_tiny_pair(data / "tiny")
    settings = Settings(database_url=f"sqlite:///{data / 'specq.db'}", data_dir=data,
                        broker_url="redis://127.0.0.1:6379/15", queue_prefix="specq-k8s")
    Client(settings, auto_migrate=True).submit(["p"], pair="tiny", enqueue=False)
    exported = {f.name for f in exporter.registry(settings).collect()}
    assert len(scaled_objects()) == 2
    for so in scaled_objects():
        spec = so["spec"]
        assert spec["scaleTargetRef"]["name"] == worker["metadata"]["name"]
        assert 0 == spec["minReplicaCount"] < spec["maxReplicaCount"]
        assert spec["cooldownPeriod"] >= 60
        assert worker["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] >= 60
        (trigger,) = spec["triggers"]
        assert trigger["type"] in ("prometheus", "postgresql")  # never redis: prefetch empties it
        if trigger["type"] == "prometheus":
            query = trigger["metadata"]["query"]
            (metric,) = re.findall(r"\b(specq_[a-z_]+)\{", query)
            assert metric == "specq_unfinished_chunks" and metric in exported
            assert re.search(rf'pair="{re.escape(pair)}"', query)
            assert float(trigger["metadata"]["threshold"]) > 0
        else:
            auth = trigger["authenticationRef"]["name"]
            (ta,) = [t for t in kind("TriggerAuthentication") if t["metadata"]["name"] == auth]
            ref = ta["spec"]["secretTargetRef"][0]
            assert ref["key"] in kind("Secret")[0]["stringData"]
            assert f"j.pair = '{pair}'" in trigger["metadata"]["query"]
            assert float(trigger["metadata"]["targetQueryValue"]) > 0


def test_the_postgresql_trigger_counts_what_the_exporter_exports(tmp_path):
    """The KEDA query, run on a real database, equals specq_unfinished_chunks of its pair."""
    (so,) = [s for s in scaled_objects() if s["spec"]["triggers"][0]["type"] == "postgresql"]
    query = so["spec"]["triggers"][0]["metadata"]["query"]
    statuses = set(re.search(r"j\.status IN \(([^)]*)\)", query).group(1)
                   .replace("'", "").replace(" ", "").split(","))
    assert statuses == set(RUNNING)
    pair = deployment("worker")["metadata"]["labels"]["specq/pair"]
    data = tmp_path / "data"
    build_tiny_pair(data / "tiny")
    with fresh_pg_database() as url:
        settings = Settings(database_url=url, data_dir=data, chunk_size=3,
                            broker_url="redis://127.0.0.1:6379/15", queue_prefix="specq-k8s")
        client = Client(settings, auto_migrate=True)
        # the pair's jobs: one with 10 items (4 chunks, the first done), one cancelled; and
        # another pair's job, which the count leaves out
        job = client.submit([f"a {i}" for i in range(10)], pair="tiny", enqueue=False)
        client.submit([f"b {i}" for i in range(6)], pair="tiny", enqueue=False).cancel()
        client.submit([f"c {i}" for i in range(5)], pair="tiny-lookup", enqueue=False)
        with client.sessions.begin() as s:
            chunks.mark_done(s, job_id=job.id, start=0)
            s.execute(text("UPDATE jobs SET pair = :pair WHERE pair = 'tiny'"), {"pair": pair})
            count = s.execute(text(query)).scalar()
        samples = {tuple(sorted(x.labels.items())): x.value
                   for f in exporter.registry(settings).collect()
                   if f.name == "specq_unfinished_chunks" for x in f.samples}
    assert count == 3
    assert sum(v for k, v in samples.items() if ("pair", pair) in k) == count
