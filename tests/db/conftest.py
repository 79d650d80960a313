"""Each db test runs on SQLite (a temporary file, WAL) and on a fresh PostgreSQL database."""

from __future__ import annotations

import pytest

from specq.db.session import migrate, session_factory


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
