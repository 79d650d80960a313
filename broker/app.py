"""The Celery app: JSON only, late acks, prefetch 1, no result backend.

`celery -A specq.broker.app worker` (what `specq worker --pair NAME` runs) uses ``app``; a
producer builds its own with make_app(settings) to send chunk references.
"""

from __future__ import annotations

from celery import Celery

from specq.broker.names import broker_keyprefix
from specq.configs.settings import Settings, get_settings


def make_app(settings: Settings, tasks: bool = True) -> Celery:
    """The Celery app on the settings' broker; ``tasks``: a worker of it runs the chunk
    task (the beat's app runs its own tasks and loads no model stack)."""
    app = Celery("specq", broker=settings.broker_url,
                 include=["specq.worker.tasks"] if tasks else [])
    app.conf.update(
        task_serializer="json",
        accept_content=["json"],  # never pickle
        result_serializer="json",
        result_backend=None,
        task_ignore_result=True,
        # A chunk is acknowledged only once its outcomes are written. A worker that dies
        # mid-chunk stops renewing the chunk's lease; the reconciler re-sends the chunk
        # when the lease runs out (broker/reconciler.py), whatever visibility_timeout is.
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        broker_transport_options={
            "visibility_timeout": settings.visibility_timeout,
            # Sweep for chunks abandoned by a dead worker every few seconds (the default
            # sweep runs only every 10th timer tick, i.e. every ~100 s).
            "unacked_restore_interval": max(1, min(10, settings.visibility_timeout // 2)),
            "unacked_restore_throttle": 1,
            # every broker call is bounded: an unresponsive broker is an error, not a hang
            "socket_timeout": settings.broker_timeout,
            "socket_connect_timeout": settings.broker_timeout,
            "health_check_interval": 10,
            "global_keyprefix": broker_keyprefix(settings),
        },
        broker_connection_timeout=settings.broker_timeout,
        broker_connection_retry_on_startup=True,
        broker_connection_max_retries=None,  # a worker reconnects for as long as it takes
        worker_hijack_root_logger=True,
        # Task events for Flower (`celery events`, the dashboard): sent, started, succeeded.
        worker_send_task_events=True,
        task_send_sent_event=True,
        task_create_missing_queues=True,
    )
    if tasks:  # the pair loads, or the worker exits, before it consumes (worker/tasks.py)
        app.steps["worker"].add("specq.worker.tasks:PairStartUp")
    return app


def __getattr__(name: str) -> Celery:
    """``app``, made on first use (by `celery -A specq.broker.app` and worker/tasks.py): importing
    this module reads no settings, so a bad SPECQ_ variable is reported by whoever reads
    them first, clearly (api/cli.py), not as a traceback at import."""
    if name == "app":
        globals()["app"] = make_app(get_settings())
        return globals()["app"]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
