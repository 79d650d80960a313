"""A worker's torch takes its share of the host's cores, not all of them."""

from __future__ import annotations

import subprocess
import sys

from specq.worker import threads


def test_a_worker_takes_its_share_of_the_cores(monkeypatch):
    monkeypatch.setattr(threads, "usable_cores", lambda: 16)
    monkeypatch.setattr(threads, "local_workers", lambda: 4)
    assert threads.worker_threads(0, "cpu") == 4
    assert threads.worker_threads(0, "cuda") == threads.GPU_THREADS
    assert threads.worker_threads(6, "cpu") == 6  # SPECQ_TORCH_THREADS wins
    monkeypatch.setattr(threads, "local_workers", lambda: 32)
    assert threads.worker_threads(0, "cpu") == 1  # never 0


def test_workers_on_this_host_are_counted_from_their_command_lines():
    before = threads.local_workers()
    # a process whose command line names the worker app, as `specq worker` does
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)",
                             "specq.worker.app"])
    try:
        assert threads.local_workers() == before + 1
    finally:
        proc.kill()
        proc.wait()
    assert threads.local_workers() == before
