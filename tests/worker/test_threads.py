"""A worker's torch takes its share of the host's cores, not all of them."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from specq.worker import threads


def test_a_worker_takes_its_share_of_the_cores(monkeypatch):
    monkeypatch.setattr(threads, "usable_cores", lambda: 16)
    monkeypatch.setattr(threads, "local_workers", lambda: 4)
    monkeypatch.setattr(threads, "busy_cores", lambda: 0)
    assert threads.worker_threads(0, "cpu") == 4
    assert threads.worker_threads(0, "cuda") == threads.GPU_THREADS
    assert threads.worker_threads(6, "cpu") == 6  # SPECQ_TORCH_THREADS wins
    monkeypatch.setattr(threads, "local_workers", lambda: 32)
    assert threads.worker_threads(0, "cpu") == 1  # never 0


def test_cores_other_work_keeps_busy_are_left_to_it(monkeypatch):
    """Two threads on two cores that two other processes keep busy spin against them: a
    worker takes the cores the load leaves (one thread at least)."""
    monkeypatch.setattr(threads, "usable_cores", lambda: 2)
    monkeypatch.setattr(threads, "local_workers", lambda: 1)
    monkeypatch.setattr(threads, "runnable_now", lambda: 1)  # this process alone
    for load, want in ((0.2, 2), (1.6, 2), (2.9, 1), (7.5, 1)):
        monkeypatch.setattr(threads.os, "getloadavg", lambda load=load: (load, load, load))
        assert threads.worker_threads(0, "cpu") == want, load
    monkeypatch.setattr(threads, "usable_cores", lambda: 16)
    monkeypatch.setattr(threads.os, "getloadavg", lambda: (5.0, 5.0, 5.0))
    assert threads.worker_threads(0, "cpu") == 12  # 16 less the 4 others keep busy
    monkeypatch.setattr(threads.os, "getloadavg", lambda: (0.1, 0.1, 0.1))
    monkeypatch.setattr(threads, "runnable_now", lambda: 3)  # two others started just now
    assert threads.worker_threads(0, "cpu") == 14


def test_the_processes_runnable_now_include_this_one():
    assert threads.runnable_now() >= 1


def test_workers_on_this_host_are_counted_from_their_command_lines():
    # a process whose command line names the worker app, as `specq worker` does; other
    # tests may start and stop workers meanwhile, so the check is on this process's id
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)",
                             "specq.broker.app"])
    cmdline = Path(f"/proc/{proc.pid}/cmdline")
    deadline = time.monotonic() + 30
    while b"specq.broker.app" not in cmdline.read_bytes():  # until the child has exec'd
        assert time.monotonic() < deadline
        time.sleep(0.01)
    try:
        assert proc.pid in threads.local_worker_pids()
        assert threads.local_workers() >= 1
    finally:
        proc.kill()
        proc.wait()
    assert proc.pid not in threads.local_worker_pids()
