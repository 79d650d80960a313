"""The analysts' read-only role (db/readonly.sql) on the real PostgreSQL: created by the very
command the compose service `readonly` runs, it reads every table and view, those a later
migration creates included, and can write nothing."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import uuid

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError

from specq.db import views
from specq.db.session import migrate
from tests.test_deploy import COMPOSE, ROOT, SECRETS, SERVICES, container_env

pytestmark = pytest.mark.skipif(not shutil.which("psql"), reason="needs psql")
SERVICE = SERVICES["readonly"]


def compose_readonly(url: str, role: str, password: str | None) -> subprocess.CompletedProcess:
    """The service's command and environment, as its container runs them, pointed at this
    database (the test's owner role, over loopback) and naming a role of this test."""
    (mount,) = SERVICE["configs"]
    source = ROOT / COMPOSE["configs"][mount["source"]]["file"]
    command = [str(source) if arg == mount["target"] else arg for arg in SERVICE["command"]]
    env = container_env("readonly", SECRETS)
    u = make_url(url)
    env.update(PGHOST=u.host, PGPORT=str(u.port), PGUSER=u.username, PGDATABASE=u.database)
    if password is None:  # compose refuses to start so; run by hand, the file refuses too
        del env["READONLY_PASSWORD"]
    else:
        env["READONLY_PASSWORD"] = password
    return subprocess.run(command + ["-v", f"role={role}"], capture_output=True, text=True,
                          timeout=60, env={"PATH": os.environ["PATH"], **env})


@pytest.fixture
def role(pg_url):
    """A role name of this test; the role and what it holds are dropped after it."""
    migrate(pg_url)
    name = f"specq_ro_{uuid.uuid4().hex[:8]}"
    yield name
    owner = create_engine(pg_url, isolation_level="AUTOCOMMIT")
    with owner.connect() as conn:
        conn.execute(text("DROP VIEW IF EXISTS later_view"))
        conn.execute(text("DROP TABLE IF EXISTS later_table"))
        if conn.scalar(text("SELECT 1 FROM pg_roles WHERE rolname = :r"), {"r": name}):
            conn.execute(text(f'DROP OWNED BY "{name}"'))
            conn.execute(text(f'DROP ROLE "{name}"'))
    owner.dispose()


def as_role(url: str, role: str):
    return create_engine(make_url(url).set(username=role, password=None),
                         isolation_level="AUTOCOMMIT")


WRITES = [
    "INSERT INTO jobs (id, status, pair, params, total, chunk_size, created_at) "
    "VALUES (-1, 'queued', 'tiny', '{}', 0, 1, now())",  # an id: no sequence involved
    "INSERT INTO chunks (job_id, start, \"end\", done, sends, runs) "
    "VALUES (-1, 0, 1, false, 0, 0)",
    "UPDATE items SET output = 'changed'",
    "DELETE FROM chunks",
    "TRUNCATE items",
    "CREATE TABLE mine (x int)",
    "CREATE VIEW mine AS SELECT 1 AS x",
    "ALTER TABLE jobs ADD COLUMN mine int",
    "DROP VIEW job_metrics",
    "CREATE OR REPLACE VIEW job_metrics AS SELECT 1 AS x",
    "CREATE SCHEMA mine",
]


def test_the_role_reads_everything_and_writes_nothing(pg_url, role):
    done = compose_readonly(pg_url, role, "0a1b2c3d4e5f")
    assert done.returncode == 0, done.stderr
    owner = create_engine(pg_url)
    with owner.connect() as conn:
        attrs = conn.execute(text(
            "SELECT rolcanlogin, rolsuper, rolcreatedb, rolcreaterole, rolinherit, "
            "rolpassword IS NOT NULL FROM pg_authid WHERE rolname = :r"), {"r": role}).one()
        assert tuple(attrs) == (True, False, False, False, False, True)
        tables = list(conn.scalars(text(
            "SELECT tablename FROM pg_tables WHERE schemaname = 'public'")))
    assert {"jobs", "items", "chunks"} <= set(tables)

    reader = as_role(pg_url, role)
    with reader.connect() as conn:
        assert conn.scalar(text("SHOW default_transaction_read_only")) == "on"
        for name in [*views.VIEWS.tables, *tables]:
            if name != "webhook_endpoints":
                conn.execute(text(f'SELECT * FROM "{name}" LIMIT 1')).all()
        # every column of the webhook endpoints but their signing secrets
        conn.execute(text("SELECT id, url, event_types FROM webhook_endpoints")).all()
        with pytest.raises(DBAPIError, match="permission denied"):
            conn.execute(text("SELECT secret FROM webhook_endpoints")).all()
        conn.rollback()
        # not only read-only by default: without the privileges, even in a writable
        # transaction
        conn.execute(text("SET default_transaction_read_only = off"))
        for sql in WRITES:
            with pytest.raises(DBAPIError) as refused:
                conn.execute(text(sql))
            error = str(refused.value.orig)
            assert re.match(r"(permission denied for (table|schema|database)|must be owner) ",
                            error), (sql, error)

    # a later migration's view and table: readable at once, with no new grant
    with owner.begin() as conn:
        conn.execute(text("CREATE TABLE later_table (x int)"))
        conn.execute(text("CREATE VIEW later_view AS SELECT job_id FROM job_metrics"))
    with reader.connect() as conn:
        conn.execute(text("SELECT * FROM later_view")).all()
        conn.execute(text("SELECT * FROM later_table")).all()
        conn.execute(text("SET default_transaction_read_only = off"))
        with pytest.raises(DBAPIError, match="permission denied"):
            conn.execute(text("INSERT INTO later_table VALUES (1)"))
    reader.dispose()
    owner.dispose()


def test_running_it_again_sets_the_new_password(pg_url, role):
    def password_hash() -> str:
        with create_engine(pg_url).connect() as conn:
            return conn.scalar(text("SELECT rolpassword FROM pg_authid WHERE rolname = :r"),
                               {"r": role})

    assert compose_readonly(pg_url, role, "1111aaaa").returncode == 0
    first = password_hash()
    assert compose_readonly(pg_url, role, "2222bbbb").returncode == 0
    assert password_hash() != first


@pytest.mark.parametrize("password", [None, ""])
def test_no_role_without_a_password(pg_url, role, password):
    done = compose_readonly(pg_url, role, password)
    assert done.returncode != 0 and "READONLY_PASSWORD is not set" in done.stderr
    with create_engine(pg_url).connect() as conn:
        assert conn.scalar(text("SELECT 1 FROM pg_roles WHERE rolname = :r"), {"r": role}) is None


def test_a_role_made_before_the_webhook_tables_cannot_read_their_secrets():
    """Migration 0011 creates webhook_endpoints after the role exists (default privileges
    grant it the table): the migration takes the secret column back."""
    from tests.conftest import fresh_pg_database

    with fresh_pg_database() as url:
        migrate(url, "0010")
        role = f"specq_ro_{uuid.uuid4().hex[:8]}"
        assert compose_readonly(url, role, "3333cccc").returncode == 0
        migrate(url)
        reader = as_role(url, role)
        try:
            with reader.connect() as conn:
                conn.execute(text("SELECT id, url, event_types FROM webhook_endpoints")).all()
                conn.execute(text("SELECT * FROM webhook_deliveries")).all()
                with pytest.raises(DBAPIError, match="permission denied"):
                    conn.execute(text("SELECT previous_secret FROM webhook_endpoints")).all()
        finally:
            reader.dispose()
            owner = create_engine(url, isolation_level="AUTOCOMMIT")
            with owner.connect() as conn:
                conn.execute(text(f'DROP OWNED BY "{role}"'))
                conn.execute(text(f'DROP ROLE "{role}"'))
            owner.dispose()
