"""Helpers of the monitoring tests: the Prometheus tools (installed when missing), and the
metric names the code exports."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROMETHEUS = ROOT / "deploy" / "prometheus"


def prometheus_tool(name: str) -> str:
    """The path of ``name`` (prometheus or promtool), installed with Debian's `prometheus`
    package when missing and this process may (root, apt-get); else the test is skipped,
    saying why."""
    found = shutil.which(name)
    if found:
        return found
    if shutil.which("apt-get") and hasattr(os, "geteuid") and os.geteuid() == 0:
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        for step in (["apt-get", "install", "-y", "--no-install-recommends", "prometheus"],
                     ["apt-get", "update"],
                     ["apt-get", "install", "-y", "--no-install-recommends", "prometheus"]):
            subprocess.run(step, env=env, capture_output=True, timeout=600)
            if step[1] == "install" and shutil.which(name):
                break
        # the package's service is not ours to run: the tests start their own server
        subprocess.run(["service", "prometheus", "stop"], capture_output=True)
    found = shutil.which(name)
    if not found:
        pytest.skip(f"{name} is not installed and Debian's prometheus package could not be "
                    f"installed (apt-get install prometheus)")
    return found


def exported_names(settings) -> set[str]:
    """Every sample name a worker or the exporter (on ``settings``' database and broker,
    both answering, with an unfinished job stored) exports: counters with _total,
    histograms with _bucket, _sum and _count; and Prometheus's own `up`."""
    from specq.api.exporter import registry
    from specq.worker.metrics import WorkerMetrics

    families = [*WorkerMetrics("p", "model", "w").registry.collect(),
                *registry(settings).collect()]
    names = {"up"}
    for f in families:
        if f.type == "counter":
            names.add(f.name + "_total")
        elif f.type == "histogram":
            names |= {f.name + s for s in ("_bucket", "_sum", "_count")}
        else:
            names.add(f.name)
    return names
