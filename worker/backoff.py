"""Bounded exponential back-off for database calls that may meet an outage.

A worker holds finished outcomes in memory while the database is away and keeps trying
for ``patience`` seconds: pauses double from ``first`` up to ``cap`` (with 10 % jitter so a
fleet does not retry in step), so a minutes-long outage is ridden out with a call every
``cap`` seconds, not a burst of retries in its first seconds.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from sqlalchemy.exc import DisconnectionError, InterfaceError, OperationalError

from specq.configs.settings import Settings

log = logging.getLogger(__name__)

T = TypeVar("T")
# connection-level failures: the database (or the way to it) is away, not the statement wrong
UNREACHABLE = (OperationalError, InterfaceError, DisconnectionError)


@dataclass(frozen=True)
class Backoff:
    first: float = 1.0
    cap: float = 15.0
    patience: float = 3600.0

    @classmethod
    def from_settings(cls, settings: Settings) -> Backoff:
        return cls(settings.retry_backoff, settings.retry_backoff_max, settings.db_patience)

    def pause(self, attempt: int) -> float:
        """Seconds to wait before retry number ``attempt`` (0-based)."""
        return min(self.cap, self.first * 2.0 ** min(attempt, 30)) * random.uniform(0.9, 1.1)


def retry_db(call: Callable[[], T], *, backoff: Backoff, what: str,
             stop: Callable[[], bool] | None = None) -> T:
    """call() until it does not fail for want of a database, for ``backoff.patience``
    seconds at most (then the last error is raised). ``stop()`` true ends retrying early."""
    deadline = time.monotonic() + backoff.patience
    attempt = 0
    while True:
        try:
            return call()
        except UNREACHABLE as exc:
            pause = backoff.pause(attempt)
            if time.monotonic() + pause > deadline or (stop and stop()):
                raise
            log.warning("%s: database unreachable (%s); retry %d in %.1f s", what,
                        short_error(exc), attempt + 1, pause)
            time.sleep(pause)
            attempt += 1


def short_error(exc: BaseException) -> str:
    """The first line of an exception's message, without SQLAlchemy's statement dump."""
    orig = getattr(exc, "orig", None) or exc
    text = str(orig).strip().splitlines()
    return f"{type(orig).__name__}: {text[0] if text else ''}"[:300]
