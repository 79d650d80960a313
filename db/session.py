"""Engines, sessions and migrations for one database URL."""

from __future__ import annotations

import logging
from functools import lru_cache
from pathlib import Path
from typing import Any, cast

from sqlalchemy import Connection, CursorResult, Engine, Result, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session, sessionmaker

from specq.configs.settings import mask_url
from specq.db.timeouts import pg_timeouts

log = logging.getLogger(__name__)

ALEMBIC_INI = Path(__file__).with_name("alembic.ini")


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


def get_engine(url: str, timeout: float = 10.0, hold: float | None = None) -> Engine:
    """One engine per URL (and bounds) and process; SQLite files get WAL mode and a busy
    timeout. ``timeout``: how long a PostgreSQL call may go unanswered before it fails
    (settings.db_timeout); ``hold``: how long the server keeps a transaction whose client
    fell silent in it (a worker's: its locks must not outlive a stalled connection and
    block a takeover), None: as the server is configured."""
    # one cache key however the bounds are passed (get_engine(url) is get_engine(url, 10.0))
    return _engine(url, float(timeout), None if hold is None else float(hold))


@lru_cache(maxsize=8)
def _engine(url: str, timeout: float, hold: float | None) -> Engine:
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        if parsed.database and parsed.database != ":memory:":
            Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(url, connect_args={"timeout": 30})
        event.listen(engine, "connect", _sqlite_pragmas)
        return engine
    if parsed.get_backend_name() == "postgresql":
        args: dict[str, Any] = dict(pg_timeouts(timeout))
        if hold is not None:
            args["options"] = f"-c idle_in_transaction_session_timeout={int(hold * 1000)}"
        engine = create_engine(url, pool_pre_ping=True, connect_args=args)
        event.listen(engine, "handle_error", _session_ended)
        return engine
    return create_engine(url, pool_pre_ping=True)


# The server ended the session (SQLSTATE class 57P: shutdown, crash; 25P03: a transaction
# left idle too long, as a stalled connection leaves it): the database was away from this
# connection, not the statement wrong. psycopg raises some of them as InternalError.
_ENDED = ("25P03", "57P01", "57P02", "57P03")


def _session_ended(ctx: Any) -> None:
    """Raise the server ending the session as what it is, an OperationalError (the
    connection unusable), which callers retry as any outage."""
    orig = ctx.original_exception
    if getattr(orig, "sqlstate", None) in _ENDED and not isinstance(
            ctx.sqlalchemy_exception, OperationalError):
        ctx.is_disconnect = True
        raise OperationalError(ctx.statement, ctx.parameters, orig,
                               connection_invalidated=True) from orig


def session_factory(url: str, timeout: float = 10.0,
                    hold: float | None = None) -> sessionmaker[Session]:
    """Sessions on ``url`` (get_engine: ``timeout``, ``hold``)."""
    return sessionmaker(get_engine(url, timeout, hold), expire_on_commit=False)


def autocommit(sessions: sessionmaker[Session]) -> Connection:
    """A connection of the sessions' engine on which each statement commits by itself: a
    write that is one statement costs one round trip (no BEGIN, no COMMIT). The caller
    closes it."""
    engine: Engine = sessions.kw["bind"]
    return engine.connect().execution_options(isolation_level="AUTOCOMMIT")


def dialect_name(sessions: sessionmaker[Session]) -> str:
    """The name of the sessions' database dialect: postgresql, sqlite, ..."""
    return cast(Engine, sessions.kw["bind"]).dialect.name


def migrate(url: str, revision: str = "head") -> None:
    """Bring the database's schema to ``revision`` with Alembic (creates every table)."""
    from alembic import command  # here: commands that never migrate start faster
    from alembic.config import Config

    cfg = Config(str(ALEMBIC_INI))
    cfg.set_main_option("script_location", str(ALEMBIC_INI.parent / "migrations"))
    cfg.attributes["url"] = url
    log.info("migrating %s to %s", mask_url(url), revision)
    with get_engine(url).begin() as conn:
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, revision)
