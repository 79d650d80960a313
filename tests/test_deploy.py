"""The deployment files, checked without Docker (Docker cannot run on this machine): the
compose file parses, each service's command resolves to something the image really has (a
console script of [project.scripts] and its subcommand, alembic with its ini and migrations,
a Celery app), and the environment it sets is what the settings read."""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
import yaml

from api import cli
from configs.settings import Settings

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES = COMPOSE["services"]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
DOCKERFILE = (ROOT / "Dockerfile").read_text()
OURS = [name for name, s in SERVICES.items() if s.get("image") == "specq:latest"]


def interpolate(value: str) -> str:
    """Compose's ${VAR:-default} / ${VAR:?error} with no variable set (defaults; 'x' else)."""
    return re.sub(r"\$\{(\w+)(?::?[-?]([^}]*))?\}",
                  lambda m: m.group(2) if ":-" in m.group(0) else "x", value)


def test_services_and_persistence():
    assert {"redis", "postgres", "migrate", "worker-gpu0", "beat", "flower"} <= set(SERVICES)
    redis_cmd = " ".join(SERVICES["redis"]["command"])
    assert "--appendonly yes" in redis_cmd and "--maxmemory-policy noeviction" in redis_cmd
    volumes = set(COMPOSE["volumes"])
    assert SERVICES["postgres"]["volumes"][0].split(":")[0] in volumes
    assert SERVICES["redis"]["volumes"][0].split(":")[0] in volumes
    assert SERVICES["migrate"]["restart"] == "no"
    beats = [n for n in OURS if SERVICES[n]["command"][:2] == ["specq", "beat"]]
    assert beats == ["beat"] and "replicas" not in SERVICES["beat"].get("deploy", {})
    assert "FLOWER_BASIC_AUTH" in SERVICES["flower"]["environment"]
    assert ":?" in SERVICES["flower"]["environment"]["FLOWER_BASIC_AUTH"]  # required, no default


def test_one_worker_per_gpu():
    workers = [n for n in OURS if SERVICES[n]["command"][:2] == ["specq", "worker"]]
    devices = []
    for name in workers:
        (reservation,) = SERVICES[name]["deploy"]["resources"]["reservations"]["devices"]
        assert reservation["driver"] == "nvidia" and reservation["capabilities"] == ["gpu"]
        devices += reservation["device_ids"]
        assert "${SPECQ_PAIR" in " ".join(SERVICES[name]["command"])  # pair from the env
    assert len(devices) == len(set(devices)) == len(workers) >= 2


@pytest.mark.parametrize("name", OURS)
def test_command_resolves_in_the_image(name):
    cmd = [interpolate(c) for c in SERVICES[name]["command"]]
    if cmd[0] == "specq":
        assert PYPROJECT["project"]["scripts"]["specq"] == "api.cli:main"
        args = cli.parser().parse_args(cmd[1:])  # the subcommand and its flags exist
        assert callable(args.func)
    elif cmd[0] == "alembic":
        assert cmd[1:] == ["upgrade", "head"]
        assert "COPY pyproject.toml README.md alembic.ini ./" in DOCKERFILE
        assert "alembic" in " ".join(PYPROJECT["project"]["dependencies"])
    elif cmd[0] == "celery":
        module = cmd[cmd.index("-A") + 1]
        assert hasattr(importlib.import_module(module), "app")
        if "flower" in cmd:
            assert any(d.startswith("flower") for d in
                       PYPROJECT["project"]["optional-dependencies"]["flower"])
            assert 'pip install ".[flower]"' in DOCKERFILE
    else:
        pytest.fail(f"{name}: unknown command {cmd}")


def test_alembic_upgrade_head_runs_as_the_migrate_service_does(tmp_path):
    """`alembic upgrade head` from the image's working directory (the repo root)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECQ_")}
    env["SPECQ_DATABASE_URL"] = f"sqlite:///{tmp_path / 'specq.db'}"
    alembic = Path(sys.executable).with_name("alembic")
    done = subprocess.run([str(alembic), "upgrade", "head"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "specq.db").exists()


def test_environment_is_what_settings_read():
    known = {f"SPECQ_{f.upper()}" for f in Settings.model_fields}
    for name in OURS:
        env = SERVICES[name]["environment"]
        ours = {k for k in env if k.startswith("SPECQ_")}
        assert ours <= known, f"{name}: {ours - known} are read by nothing"
        assert {"SPECQ_BROKER_URL", "SPECQ_DATABASE_URL"} <= ours
        settings = Settings(**{k.removeprefix("SPECQ_").lower(): interpolate(v)
                               for k, v in env.items() if k in ours})
        assert settings.broker_url == "redis://redis:6379/0"
        assert settings.sqlalchemy_url.startswith("postgresql+psycopg://specq:")


def test_dockerfile_builds_what_the_package_needs():
    assert re.search(r"^ARG TORCH=cpu$", DOCKERFILE, re.M)
    assert "download.pytorch.org/whl/${TORCH}" in DOCKERFILE
    packages = PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]
    for pkg in (p.rstrip("*") for p in packages):
        assert f"COPY {pkg} {pkg}" in DOCKERFILE
    assert (ROOT / "alembic.ini").read_text().count("script_location = %(here)s/db/migrations")
