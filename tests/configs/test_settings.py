"""Paths anchored once: the data directory does not follow the working directory, relative
settings are made absolute when read, and `specq config` shows them with secrets hidden."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from specq.configs.settings import Settings, mask_url


def config(cwd: Path, home: Path, **env: str) -> dict[str, dict[str, str]]:
    """`specq config --json` run as a new process from ``cwd``, with no SPECQ_ variable but
    ``env`` and the user's directories under ``home``."""
    base = {k: v for k, v in os.environ.items()
            if not k.startswith(("SPECQ_", "XDG_", "HF_")) and k != "HOME"}
    out = subprocess.run(
        [sys.executable, "-m", "specq.api.cli", "config", "--json"], cwd=cwd, check=True,
        env={**base, "HOME": str(home), **env}, capture_output=True, text=True, timeout=60)
    return json.loads(out.stdout)


def test_the_default_data_dir_is_the_users_wherever_specq_runs(tmp_path):
    home = tmp_path / "home"
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "b").mkdir()
    seen = {config(tmp_path / d, home)["SPECQ_DATA_DIR"]["value"] for d in ("a", "a/b")}
    assert seen == {str(home / ".local" / "share" / "specq")}
    xdg = config(tmp_path / "a", home, XDG_DATA_HOME=str(tmp_path / "xdg"))
    assert xdg["SPECQ_DATA_DIR"] == {"value": str(tmp_path / "xdg" / "specq"),
                                     "source": "default"}
    assert xdg["database in use"]["value"] == f"sqlite:///{tmp_path / 'xdg' / 'specq'}/specq.db"
    assert xdg["beat state"]["value"].startswith(str(tmp_path / "xdg" / "specq"))


def test_relative_paths_are_taken_from_the_working_directory_once(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    s = Settings(data_dir=Path("d"), database_url="sqlite:///rel/x.db",
                 schedules_file=Path("s.yaml"))
    monkeypatch.chdir("/")
    assert s.data_dir == tmp_path / "d"
    assert s.sqlalchemy_url == f"sqlite:///{tmp_path / 'rel' / 'x.db'}"
    assert s.schedules_file == tmp_path / "s.yaml"
    got = config(tmp_path, tmp_path / "home", SPECQ_DATA_DIR="rel")
    assert got["SPECQ_DATA_DIR"] == {"value": str(tmp_path / "rel"), "source": "env"}


def test_config_hides_passwords_and_says_where_each_value_came_from(tmp_path):
    (tmp_path / ".env").write_text("SPECQ_CHUNK_SIZE=7\n")
    got = config(tmp_path, tmp_path / "home",
                 SPECQ_DATABASE_URL="postgresql+psycopg://u:hunter2@db/x?sslpassword=p2",
                 SPECQ_BROKER_URL="redis://:s3cret@127.0.0.1:6379/0", HF_TOKEN="hf_abc123")
    text = json.dumps(got)
    assert "hunter2" not in text and "s3cret" not in text and "p2" not in text
    assert "hf_abc123" not in text and got["HF_TOKEN"] == {"value": "***", "source": "env"}
    assert got["SPECQ_DATABASE_URL"]["value"].startswith("postgresql+psycopg://u:***@db/x")
    assert got["SPECQ_BROKER_URL"] == {"value": "redis://:***@127.0.0.1:6379/0",
                                       "source": "env"}
    assert got["SPECQ_CHUNK_SIZE"] == {"value": "7", "source": ".env"}
    assert got["SPECQ_DEVICE"] == {"value": "auto", "source": "default"}


def test_mask_url_leaves_urls_without_secrets_alone():
    assert mask_url("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"
    assert mask_url("redis://user:pw@h/0") == "redis://user:***@h/0"


def test_mask_url_hides_secret_query_values_and_keeps_the_rest_as_written():
    assert (mask_url("postgresql+psycopg://u:pw@h:5432/d?password=q&sslmode=require")
            == "postgresql+psycopg://u:***@h:5432/d?password=***&sslmode=require")
    assert mask_url("sqlite:////abs/x.db?password=q") == "sqlite:////abs/x.db?password=***"


def test_a_lease_shorter_than_three_database_calls_is_refused_naming_both():
    with pytest.raises(ValidationError) as err:
        Settings(lease_seconds=20, db_timeout=10)
    assert "lease_seconds (20) must be at least 3 x db_timeout (10)" in str(err.value)
    assert Settings(lease_seconds=3, db_timeout=1).lease_seconds == 3
    assert Settings().lease_seconds >= 3 * Settings().db_timeout
