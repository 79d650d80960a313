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
    assert threads.worker_threads(0, "cpu") == 4
    assert threads.worker_threads(0, "cuda") == threads.GPU_THREADS
    assert threads.worker_threads(6, "cpu") == 6  # SPECQ_TORCH_THREADS wins
    monkeypatch.setattr(threads, "local_workers", lambda: 32)
    assert threads.worker_threads(0, "cpu") == 1  # never 0


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
