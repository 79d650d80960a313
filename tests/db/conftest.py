"""Each db test runs on SQLite (a temporary file, WAL) and on a fresh PostgreSQL database."""

from __future__ import annotations

import uuid

import pytest
from sqlalchemy import create_engine, text

from db.session import get_engine, migrate, session_factory

PG_ADMIN = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"


@pytest.fixture(scope="session")
def pg_url():
    """A PostgreSQL database of this test session, dropped at its end."""
    name = f"specq_test_{uuid.uuid4().hex[:12]}"
    admin = create_engine(PG_ADMIN, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    url = f"postgresql+psycopg://postgres@127.0.0.1:5432/{name}"
    yield url
    get_engine(url).dispose()
    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    admin.dispose()


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request, tmp_path_factory):
    """A migrated database URL; the PostgreSQL one is shared by the session's tests."""
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path_factory.mktemp('sqlite') / 'specq.db'}"
    else:
        url = request.getfixturevalue("pg_url")
    migrate(url)
    return url


@pytest.fixture
def sessions(db_url):
    return session_factory(db_url)
