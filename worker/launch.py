"""Starting a worker process: the `celery` command line of a worker for one pair, and the
environment it runs in (`specq worker`, and the benches' patched workers)."""

from __future__ import annotations

import os

from specq.broker.names import WORKER_PAIR_ENV, queue_name
from specq.configs.settings import Settings, get_settings

# The environment a worker runs in. Model-loading progress bars (transformers' "Loading
# weights", the hub's downloads) are drawn for a terminal: in a worker Celery redirects
# stderr into its log, where every redraw becomes a WARNING record. The variable is read
# when huggingface_hub is imported, so it is set before the worker process starts.
WORKER_ENV = {"HF_HUB_DISABLE_PROGRESS_BARS": "1"}


def quiet_worker_env() -> None:
    """Set WORKER_ENV in this process's environment (what it execs inherits), keeping any
    value the operator set."""
    for name, value in WORKER_ENV.items():
        os.environ.setdefault(name, value)


def worker_argv(pair: str, settings: Settings, loglevel: str = "info",
                hostname: str | None = None) -> list[str]:
    """The `celery` command-line arguments of a worker for ``pair``: solo pool (one
    process holds the model), the pair's queue only, late acks (see make_app)."""
    return ["-A", "specq.broker.app", "worker", "-P", "solo", "-c", "1",
            "-Q", queue_name(pair, settings), "--loglevel", loglevel,
            "-n", hostname or f"{pair}@%h", "--without-gossip", "--without-mingle"]


def run_worker(pair: str, loglevel: str = "info", hostname: str | None = None) -> None:
    """Run a Celery worker for ``pair`` in this process (its engine patched by the caller,
    for the benches' fault-injecting and stand-in workers)."""
    import sys

    from celery.bin.celery import main as celery_main

    os.environ[WORKER_PAIR_ENV] = pair
    quiet_worker_env()
    get_settings.cache_clear()
    sys.argv = ["celery", *worker_argv(pair, get_settings(), loglevel, hostname)]
    celery_main()
