"""The monitoring files under deploy/: Prometheus's configuration and alert rules checked
by promtool, every alert unit-tested (`promtool test rules`), and the Grafana dashboard
valid and naming only metrics the code exports."""

from __future__ import annotations

import json
import re
import subprocess

import pytest
import yaml

from specq.api.client import Client
from specq.configs.settings import Settings
from specq.worker.tiny import build_tiny_pair
from tests.monitoring import PROMETHEUS, ROOT, exported_names, prometheus_tool

GRAFANA = ROOT / "deploy" / "grafana"
DASHBOARD = GRAFANA / "specq-dashboard.json"
METRIC = re.compile(r"\b(specq_[a-z0-9_]+|up)\b")


@pytest.fixture(scope="module")
def promtool():
    return prometheus_tool("promtool")


@pytest.fixture(scope="module")
def names(tmp_path_factory):
    """What the code exports, read from a worker's registry and from the exporter over a
    database with an unfinished job."""
    data = tmp_path_factory.mktemp("data")
    build_tiny_pair(data / "tiny")
    settings = Settings(database_url=f"sqlite:///{data / 'specq.db'}", data_dir=data,
                        broker_url="redis://127.0.0.1:6379/15", queue_prefix="specq-names")
    Client(settings, auto_migrate=True).submit(["a prompt"], pair="tiny", enqueue=False)
    found = exported_names(settings)
    assert {"specq_unfinished_items", "specq_generation_tokens_total",
            "specq_step_seconds_bucket", "specq_reconciler_actions_total"} <= found
    return found


def run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=PROMETHEUS, capture_output=True, text=True, timeout=120)


def test_promtool_checks_the_config_and_the_rules(promtool):
    out = run(promtool, "check", "config", "prometheus.yml")
    assert out.returncode == 0, out.stdout + out.stderr
    out = run(promtool, "check", "rules", "alerts.yml")
    assert out.returncode == 0 and "6 rules found" in out.stdout, out.stdout + out.stderr


def test_every_alert_is_unit_tested_and_passes(promtool):
    rules = yaml.safe_load((PROMETHEUS / "alerts.yml").read_text())
    alerts = {r["alert"] for g in rules["groups"] for r in g["rules"]}
    tests = yaml.safe_load((PROMETHEUS / "alerts_test.yml").read_text())
    cases = [c for t in tests["tests"] for c in t["alert_rule_test"]]
    for alert in alerts:  # each one seen firing and seen silent
        mine = [c for c in cases if c["alertname"] == alert]
        assert any(c["exp_alerts"] for c in mine), f"{alert}: never shown firing"
        assert any(not c["exp_alerts"] for c in mine), f"{alert}: never shown silent"
    out = run(promtool, "test", "rules", "alerts_test.yml")
    assert out.returncode == 0 and "SUCCESS" in out.stdout, out.stdout + out.stderr


def test_a_broken_alert_test_fails(promtool, tmp_path):
    """promtool test rules can fail: the tests above test something."""
    (tmp_path / "alerts.yml").write_text((PROMETHEUS / "alerts.yml").read_text())
    wrong = (PROMETHEUS / "alerts_test.yml").read_text().replace("pair: big}", "pair: ok}")
    (tmp_path / "alerts_test.yml").write_text(wrong)
    out = subprocess.run([promtool, "test", "rules", "alerts_test.yml"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "SpecqNoProgress" in out.stdout + out.stderr


def test_alert_rules_name_only_exported_metrics(names):
    rules = yaml.safe_load((PROMETHEUS / "alerts.yml").read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            used = set(METRIC.findall(rule["expr"]))
            assert used and used <= names, f"{rule['alert']}: {used - names}"


def test_the_dashboard_is_valid_and_names_only_exported_metrics(names):
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] and dashboard["title"] and dashboard["panels"]
    source = yaml.safe_load((GRAFANA / "datasource.yml").read_text())["datasources"][0]
    titles = set()
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] == source["uid"], panel["title"]
        assert panel["targets"], f"{panel['title']}: no query"
        for target in panel["targets"]:
            used = set(METRIC.findall(target["expr"]))
            assert used and used <= names, f"{panel['title']}: {used - names}"
        titles.add(panel["title"].lower())
    text = " ".join(titles)
    for topic in ("throughput", "acceptance rate", "acceptance length", "draft length",
                  "queue depth", "oldest wait", "failures", "workers up"):
        assert topic in text, f"no panel on {topic}"
    # the grid: no two panels overlap
    cells = set()
    for panel in dashboard["panels"]:
        g = panel["gridPos"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"])
                for y in range(g["y"], g["y"] + g["h"])}
        assert not mine & cells, panel["title"]
        cells |= mine


def test_grafana_provisioning_points_at_the_dashboard():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    grafana = compose["services"]["grafana"]
    targets = {c["source"]: c["target"] for c in grafana["configs"]}
    provider = yaml.safe_load((GRAFANA / "dashboards.yml").read_text())["providers"][0]
    dashboard = targets["grafana_dashboard"]
    assert dashboard.rsplit("/", 1)[0] == provider["options"]["path"]
    assert (ROOT / compose["configs"]["grafana_dashboard"]["file"]).resolve() == DASHBOARD
    prometheus = compose["services"]["prometheus"]
    mounted = {c["target"] for c in prometheus["configs"]}
    assert {"/etc/prometheus/prometheus.yml", "/etc/prometheus/alerts.yml"} == mounted
    config = yaml.safe_load((PROMETHEUS / "prometheus.yml").read_text())
    jobs = {j["job_name"]: j for j in config["scrape_configs"]}
    workers = [n for n, s in compose["services"].items()
               if s.get("command", [None, None])[:2] == ["specq", "worker"]]
    assert set(jobs["specq-workers"]["dns_sd_configs"][0]["names"]) == set(workers)
    env = compose["x-worker-env"] if "x-worker-env" in compose else \
        compose["services"][workers[0]]["environment"]
    assert jobs["specq-workers"]["dns_sd_configs"][0]["port"] == int(env["SPECQ_METRICS_PORT"])
    assert jobs["specq-exporter"]["static_configs"][0]["targets"] == ["exporter:9500"]
    assert compose["services"]["exporter"]["command"][-1] == "9500"
