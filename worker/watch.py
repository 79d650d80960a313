"""The consumer watch: a worker whose Celery consumer stopped taking messages restarts.

A broker that stalls for a few seconds while a worker acknowledges a chunk can leave the
consumer wedged (Celery logs "Couldn't ack ..., reason: network: TimeoutError" and its
connection's poll is never registered again): the process lives, announces itself, renews
nothing and takes nothing, and every chunk of its pair waits on the broker for ever. Nothing
inside kombu notices; from outside it is plain to see. So, from a daemon thread:

- the worker is idle (no task running in it: Celery's task_prerun / task_postrun), and
- messages wait on its pair's queue (the Redis lists of every priority step),

both without a break for ``consumer_stall`` seconds (a healthy idle consumer takes a
waiting message within a second or two) make the worker log why and replace itself with a
fresh copy of its own command line (``os.execv``: new connections, the model loaded again),
holding nothing: it was idle, its chunks are in the database, and a message it had taken
comes back to the queue after the visibility timeout. A broker that cannot be read tells
nothing, and resets the count (kombu reconnects by itself across an outage).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import redis
from celery import signals

from specq.broker import dispatch
from specq.broker.names import queue_name
from specq.configs.settings import Settings

log = logging.getLogger(__name__)


class Activity:
    """Whether a task runs in this process, and since when it is idle."""

    def __init__(self) -> None:
        self.running = 0
        self.idle_since = time.monotonic()
        self._lock = threading.Lock()
        signals.task_prerun.connect(self._began, weak=False)
        signals.task_postrun.connect(self._ended, weak=False)

    def _began(self, **_: Any) -> None:
        with self._lock:
            self.running += 1

    def _ended(self, **_: Any) -> None:
        with self._lock:
            self.running = max(0, self.running - 1)
            if not self.running:
                self.idle_since = time.monotonic()

    def idle_for(self) -> float:
        """Seconds this process has run no task (0 while one runs)."""
        with self._lock:
            return 0.0 if self.running else time.monotonic() - self.idle_since


def restart_self() -> None:
    """Replace this process with a fresh run of the command that started it."""
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, sys.orig_argv)


class ConsumerWatch:
    """The watch of one worker (started once its pair is ready, like the heartbeat)."""

    def __init__(self, settings: Settings, pair: str,
                 restart: Callable[[], None] = restart_self) -> None:
        from specq.broker.connection import broker_client

        self.settings, self.restart = settings, restart
        self.keys = dispatch.queue_keys(queue_name(pair, settings), settings)
        self.client = broker_client(settings)
        self.activity = Activity()
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name="consumer-watch", daemon=True)

    def start(self) -> ConsumerWatch:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join(timeout=self.settings.broker_timeout + 1)
        self.client.close()

    def waiting(self) -> int | None:
        """Messages waiting on the pair's queue; None when the broker cannot say."""
        try:
            pipe = self.client.pipeline(transaction=False)
            for key in self.keys:
                pipe.llen(key)
            return sum(int(n) for n in pipe.execute())
        except redis.RedisError:
            return None

    def _run(self) -> None:
        limit = self.settings.consumer_stall
        since: float | None = None  # when idle-with-messages-waiting began, unbroken
        while not self.stopped.wait(min(5.0, limit / 4)):
            waiting = self.waiting()
            idle = self.activity.idle_for()
            if not waiting or not idle:
                since = None
                continue
            now = time.monotonic()
            if since is None:
                since = now
            if now - since >= limit and idle >= limit:
                log.error("consumer: %d messages wait on this worker's queue and it has "
                          "taken none for %.0f s, idle (its broker connection is left "
                          "wedged): the worker restarts itself", waiting, now - since)
                self.restart()
                return
