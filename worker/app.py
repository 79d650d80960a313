"""The Celery app: JSON only, late acks, prefetch 1, no result backend.

`celery -A worker.app worker` (what `specq worker --pair NAME` runs) uses ``app``; a
producer builds its own with make_app(settings) to send chunk references.
"""

from __future__ import annotations

from celery import Celery

from configs.settings import Settings, get_settings


def make_app(settings: Settings) -> Celery:
    app = Celery("specq", broker=settings.broker_url, include=["worker.tasks"])
    app.conf.update(
        task_serializer="json",
        accept_content=["json"],  # never pickle
        result_serializer="json",
        result_backend=None,
        task_ignore_result=True,
        # A chunk is acknowledged only once its outcomes are written; a worker that dies
        # mid-chunk leaves it to be redelivered (after visibility_timeout) to another.
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        broker_transport_options={
            "visibility_timeout": settings.visibility_timeout,
            # Sweep for chunks abandoned by a dead worker every few seconds (the default
            # sweep runs only every 10th timer tick, i.e. every ~100 s).
            "unacked_restore_interval": max(1, min(10, settings.visibility_timeout // 2)),
            "unacked_restore_throttle": 1,
        },
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=True,
        # Task events for Flower (`celery events`, the dashboard): sent, started, succeeded.
        worker_send_task_events=True,
        task_send_sent_event=True,
        task_create_missing_queues=True,
    )
    return app


app = make_app(get_settings())
