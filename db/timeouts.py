"""libpq's bounds on a PostgreSQL call, apart from SQLAlchemy: the session's engines and
glance.py's bare driver connection take the same ones."""

from __future__ import annotations


def pg_timeouts(timeout: float) -> dict[str, int]:
    """libpq's bounds on one call, from ``timeout`` seconds: connecting takes at most that
    (2 s at least: libpq's floor), data the server leaves unacknowledged fails after it
    (tcp_user_timeout), and a silent idle server is noticed by keepalives within it. A cut
    network is then an error a worker retries, never a hang. (A path that acknowledges
    and then holds the data, a stalled proxy, is bounded by no socket option: the keeper
    gives its lease up on time instead, worker/keeper.py.)"""
    idle = max(1, int(timeout / 3))
    interval = max(1, int(timeout / 6))
    return {"connect_timeout": max(2, round(timeout)), "keepalives": 1,
            "keepalives_idle": idle, "keepalives_interval": interval, "keepalives_count": 3,
            "tcp_user_timeout": int(timeout * 1000)}
