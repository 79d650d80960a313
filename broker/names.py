"""Names shared by producers and workers: one place for each queue and task name."""

from __future__ import annotations

from specq.configs.settings import Settings, get_settings

GENERATE_TASK = "specq.generate_chunk"  # args: job_id, start, end (item indices, end exclusive)
WORKER_PAIR_ENV = "SPECQ_WORKER_PAIR"  # set by `specq worker --pair`; read through Settings
FIRE_TASK = "specq.fire_schedule"  # args: schedule name (api/beat.py)
COLLECT_TASK = "specq.collect_runs"  # writes finished synthesis runs' data sets
RECONCILE_TASK = "specq.reconcile"  # re-sends lost chunks (broker/reconciler.py)
# Message priorities. Redis serves lower numbers first (kombu's steps 0, 3, 6, 9: one list
# per step, popped in that order): a chunk the reconciler sends again after its worker died
# goes before every chunk still waiting its turn, so it resumes within seconds; the rest
# go at their job's priority (submit --priority).
PRIORITY_RESENT = 0
PRIORITIES = {"high": 3, "normal": 6, "low": 9}


def queue_name(pair: str, settings: Settings | None = None) -> str:
    """The Celery queue that workers serving ``pair`` consume."""
    return f"{(settings or get_settings()).queue_prefix}.{pair}"


def broker_keyprefix(settings: Settings | None = None) -> str:
    """What every key Celery and kombu keep on the broker begins with (kombu's
    ``global_keyprefix``: queues, ``unacked``, bindings), as specq's own keys do: two
    deployments with different queue prefixes can share one Redis database."""
    return f"{(settings or get_settings()).queue_prefix}:"


def synth_queue(settings: Settings | None = None) -> str:
    """The queue of the beat process's own tasks (firing schedules, writing data sets)."""
    return f"{(settings or get_settings()).queue_prefix}.synth"
