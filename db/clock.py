"""The database's clock, as seconds since the epoch: leases and dispatch times are read
off the server, so the workers' and producers' own clocks need not agree."""

from __future__ import annotations

from sqlalchemy import Float
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.functions import FunctionElement


class db_now(FunctionElement):  # noqa: N801 (reads as a SQL function)
    """``now()`` of the database server, in seconds since the epoch (float)."""

    type = Float()
    inherit_cache = True


@compiles(db_now)
def _default(element, compiler, **kw) -> str:
    return "EXTRACT(EPOCH FROM CURRENT_TIMESTAMP)"


@compiles(db_now, "postgresql")
def _postgresql(element, compiler, **kw) -> str:
    return "EXTRACT(EPOCH FROM clock_timestamp())::float8"  # not frozen at transaction start


@compiles(db_now, "sqlite")
def _sqlite(element, compiler, **kw) -> str:
    return "((julianday('now') - 2440587.5) * 86400.0)"


class statement_now(FunctionElement):  # noqa: N801 (reads as a SQL function)
    """The database server's time when the statement started, in seconds since the epoch:
    one value however often a statement reads it (charging a chunk's run reads it for the
    seconds and for their price: db/chunks.py)."""

    type = Float()
    inherit_cache = True


@compiles(statement_now)
def _statement_default(element, compiler, **kw) -> str:
    return "EXTRACT(EPOCH FROM CURRENT_TIMESTAMP)"


@compiles(statement_now, "postgresql")
def _statement_postgresql(element, compiler, **kw) -> str:
    return "EXTRACT(EPOCH FROM statement_timestamp())::float8"


@compiles(statement_now, "sqlite")
def _statement_sqlite(element, compiler, **kw) -> str:
    return "((julianday('now') - 2440587.5) * 86400.0)"  # 'now' is one value per step
