"""Engines, sessions and migrations for one database URL."""

from __future__ import annotations

import logging
from functools import lru_cache
from pathlib import Path
from typing import Any, cast

from sqlalchemy import CursorResult, Engine, Result, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker

log = logging.getLogger(__name__)

ALEMBIC_INI = Path(__file__).with_name("alembic.ini")


def redact(url: str) -> str:
    """The URL with its password hidden, fit for logs and error messages."""
    return make_url(url).render_as_string(hide_password=True)


def changed(result: Result[Any]) -> int:
    """How many rows an executed UPDATE or DELETE changed (its result counts them)."""
    return cast(CursorResult[Any], result).rowcount


def _sqlite_pragmas(dbapi_conn, _record) -> None:
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")  # readers do not block the writer
    cur.execute("PRAGMA synchronous=NORMAL")
    cur.execute("PRAGMA foreign_keys=ON")
    cur.execute("PRAGMA busy_timeout=30000")
    cur.close()


@lru_cache(maxsize=8)
def get_engine(url: str) -> Engine:
    """One engine per URL and process; SQLite files get WAL mode and a busy timeout."""
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        if parsed.database and parsed.database != ":memory:":
            Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(url, connect_args={"timeout": 30})
        event.listen(engine, "connect", _sqlite_pragmas)
        return engine
    if parsed.get_backend_name() == "postgresql":
        return create_engine(url, pool_pre_ping=True, connect_args=_PG_TIMEOUTS)
    return create_engine(url, pool_pre_ping=True)


# Every database call is bounded: connecting takes at most 10 s, and a server that stops
# answering is noticed by TCP keepalives (about 25 s idle) and the user timeout (30 s of
# unacknowledged data), so a cut network is an error a worker retries, never a hang.
_PG_TIMEOUTS = {"connect_timeout": 10, "keepalives": 1, "keepalives_idle": 10,
                "keepalives_interval": 5, "keepalives_count": 3, "tcp_user_timeout": 30000}


def session_factory(url: str) -> sessionmaker[Session]:
    return sessionmaker(get_engine(url), expire_on_commit=False)


def migrate(url: str, revision: str = "head") -> None:
    """Bring the database's schema to ``revision`` with Alembic (creates every table)."""
    from alembic import command  # here: commands that never migrate start faster
    from alembic.config import Config

    cfg = Config(str(ALEMBIC_INI))
    cfg.set_main_option("script_location", str(ALEMBIC_INI.parent / "migrations"))
    cfg.attributes["url"] = url
    log.info("migrating %s to %s", redact(url), revision)
    with get_engine(url).begin() as conn:
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, revision)
