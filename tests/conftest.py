"""Shared fixtures: the tiny llama pair (fixed seeds, loaded from disk) and a PostgreSQL
database of this test session on the real server."""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

import pytest
import torch
from sqlalchemy import create_engine, text
from transformers import AutoModelForCausalLM, AutoTokenizer

from specq.db.session import get_engine
from specq.worker.tiny import build_tiny_pair

if os.environ.get("PYTEST_XDIST_WORKER"):  # pytest -n N: one thread a process, the cores shared
    torch.set_num_threads(1)

# Property tests draw the same cases every run in the suite (a red CI run is a real bug that
# reproduces); SPECQ_FUZZ_RANDOM=1 draws fresh ones, to look for new bugs.
DERANDOMIZE = not os.environ.get("SPECQ_FUZZ_RANDOM")

PG_ADMIN = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"

# The slowest files first, slowest leading (their times on a 2-core host, 2026-12-06). `make
# test` hands whole files to three xdist processes in collection order (--dist loadfile: a
# module's fleet or model is set up once; --no-loadscope-reorder, or xdist orders the files by
# their count of tests instead), so a slow file collected last would run alone at the end
# while the other process idles (80 s of 436 in a run where xdist reordered them).
SLOW_FIRST = ("pipeline/test_faults.py", "worker/test_smollm2.py", "worker/engine/test_fuzz.py",
              "worker/engine/test_greedy_equivalence.py", "pipeline/test_stall.py",
              "pipeline/test_http.py", "pipeline/test_bench_pipeline.py",
              "pipeline/test_worker_start.py", "pipeline/test_http_abuse.py",
              "pipeline/test_poison.py", "pipeline/test_costs.py",
              "worker/engine/test_grammar.py", "worker/test_startup.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        path = item.path.as_posix()
        return next((i for i, f in enumerate(SLOW_FIRST) if path.endswith(f"tests/{f}")),
                    len(SLOW_FIRST))

    items.sort(key=rank)  # stable: each file keeps its own order

T = TypeVar("T")


def wait_until(check: Callable[[], T], timeout: float, what: str, poll: float = 0.1) -> T:
    """check() until it returns something true; that value. TimeoutError naming ``what``
    after ``timeout`` seconds: the condition a test waits for, never a fixed sleep."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not after {timeout} s")
        time.sleep(poll)


@contextmanager
def fresh_pg_database() -> Iterator[str]:
    """The URL of a new, empty PostgreSQL database on the real server, dropped after."""
    name = f"specq_test_{uuid.uuid4().hex[:12]}"
    admin = create_engine(PG_ADMIN, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    url = f"postgresql+psycopg://postgres@127.0.0.1:5432/{name}"
    try:
        yield url
    finally:
        get_engine(url).dispose()
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def live_leases(session, *, job_id: int) -> list[tuple[int, int, str]]:
    """(job id, start, owner) of the job's leases that have not run out (database clock)."""
    from sqlalchemy import select

    from specq.db.clock import db_now
    from specq.db.models import Chunk

    c = Chunk.__table__.c
    return [tuple(r) for r in session.execute(
        select(c.job_id, c.start, c.lease_owner)
        .where(c.job_id == job_id, c.lease_owner.is_not(None), c.lease_until >= db_now()))]


@pytest.fixture(scope="session")
def pg_url():
    """A fresh PostgreSQL database for this test session, dropped at its end."""
    with fresh_pg_database() as url:
        yield url


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    """Directories of the tiny target and its drafts (near, shallow, noisy, unrelated)."""
    return build_tiny_pair(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_dirs):
    return AutoTokenizer.from_pretrained(tiny_dirs["target"])


@pytest.fixture(scope="session")
def tiny_models(tiny_dirs):
    """name -> model loaded through from_pretrained in float32."""
    return {
        name: AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
        for name, d in tiny_dirs.items()
    }
