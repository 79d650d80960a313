"""The plain Redis connection to the broker, for what reads or writes its keys directly
(presence, the reconciler's reading of queues, locks): no Celery or kombu imported, so
`specq status` starts without them."""

from __future__ import annotations

import redis

from specq.configs.settings import Settings


def broker_client(settings: Settings) -> redis.Redis:
    """A plain Redis client on the broker, every call bounded by broker_timeout."""
    return redis.Redis.from_url(settings.broker_url, socket_timeout=settings.broker_timeout,
                                socket_connect_timeout=settings.broker_timeout)
