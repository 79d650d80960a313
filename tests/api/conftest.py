"""Clients on SQLite (a temporary file) and on a fresh PostgreSQL database of this session."""

from __future__ import annotations

import json

import pytest
import yaml

from specq.api.client import Client
from specq.configs.settings import Settings
from specq.worker.tiny import build_tiny_pair


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory):
    """The settings' data directory, with the tiny pair built in it once."""
    root = tmp_path_factory.mktemp("data")
    build_tiny_pair(root / "tiny")
    return root


@pytest.fixture(params=["sqlite", "postgresql"])
def db_client(request, data_dir, tmp_path):
    """A client on a database of its own (SQLite, then the session's PostgreSQL) that no
    worker or broker serves: its jobs are stored and run in-process (run_inline)."""
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'specq.db'}"
    else:
        url = request.getfixturevalue("pg_url")
    settings = Settings(database_url=url, data_dir=data_dir, chunk_size=4,
                        broker_url="redis://127.0.0.1:6379/15", queue_prefix="specq-unused")
    return Client(settings, auto_migrate=True)


def spec_file(tmp_path, **over) -> str:
    """A synthesis spec over two seed rows (``over`` replaces its fields); its path."""
    seeds = tmp_path / "seeds.jsonl"
    seeds.write_text("".join(json.dumps({"topic": t}) + "\n" for t in ("tides", "bread")))
    body = {"name": "t", "pair": "tiny", "seed_data": "seeds.jsonl",
            "template": "About {{ topic }}", "n": 2, "sampling": {"max_new_tokens": 4},
            "output": {"path": str(tmp_path / "out.parquet")}, **over}
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(body))
    return str(path)
