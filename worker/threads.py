"""How many CPU threads a worker's torch uses.

torch takes every core by default. Several workers on one host (one per GPU, or CPU workers
side by side) then spin their threads against each other, many times slower than one thread
each (docs/benchmarks.md#2026-11-30-torch-threads). So a worker takes its share:
SPECQ_TORCH_THREADS when set, else the host's usable cores divided among the specq workers
running on it (counted from /proc at start), and only GPU_THREADS when a GPU does the maths
(the CPU then only feeds it). Cores that other work keeps busy at start (the one-minute load
average, less this process's own share of it) are left to it: two threads on two cores
that two other processes keep busy ran the bundled demo three times slower than one
(docs/benchmarks.md#2026-12-03-the-demo-drafts-at-batch-16).
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

log = logging.getLogger(__name__)

GPU_THREADS = 2  # the host side of a GPU worker: tokenizing, bookkeeping, launching kernels
WORKER_MARK = b"specq.broker.app"  # in the command line of every `specq worker` process


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))  # honours taskset and cgroup cpusets
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def local_workers() -> int:
    """specq worker processes on this host, this one included (Linux /proc; 0 where there
    is no /proc)."""
    return len(local_worker_pids())


def local_worker_pids() -> set[int]:
    """The process ids of the specq workers on this host (read from /proc)."""
    pids = set()
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if WORKER_MARK in cmdline.read_bytes():
                pids.add(int(cmdline.parent.name))
        except OSError:  # the process ended meanwhile
            continue
    return pids


def worker_threads(configured: int, device_type: str) -> int:
    """The thread count a worker should use: ``configured`` (SPECQ_TORCH_THREADS) when
    positive, else GPU_THREADS on a GPU, else its share of the host's cores."""
    if configured > 0:
        return configured
    if device_type == "cuda":
        return GPU_THREADS
    cores = usable_cores()
    return max(1, min(cores // max(1, local_workers()), cores - busy_cores()))


def busy_cores() -> int:
    """Cores other work keeps busy: the one-minute load average less one for this process
    (it has been loading its pair), or, where other work started within the minute, the
    processes runnable now besides this one (the least of a few looks, /proc/loadavg on
    Linux); 0 where the load is unknown."""
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        return 0
    return max(0, int(load - 1.0), runnable_now() - 1)


def runnable_now(looks: int = 5, gap: float = 0.02) -> int:
    """Threads runnable now on this host, this one included: the least of ``looks`` reads
    of /proc/loadavg's fourth field ``gap`` seconds apart (0 where there is none)."""
    seen = []
    for i in range(looks):
        try:
            seen.append(int(Path("/proc/loadavg").read_text().split()[3].split("/")[0]))
        except (OSError, IndexError, ValueError):
            return 0
        if i + 1 < looks:
            time.sleep(gap)
    return min(seen)


def apply(configured: int, device_type: str) -> int:
    import torch

    n = worker_threads(configured, device_type)
    torch.set_num_threads(n)
    log.info("torch uses %d CPU threads (%s)", n,
             "SPECQ_TORCH_THREADS" if configured > 0 else "auto")
    return n
