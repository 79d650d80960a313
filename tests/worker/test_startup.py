"""`specq bench-startup`: a worker's start, phase by phase, in fresh processes."""

import os
import re
import subprocess
import sys


def test_bench_startup_times_each_phase_of_fresh_worker_starts(tmp_path):
    env = {**os.environ, "SPECQ_DATA_DIR": str(tmp_path), "SPECQ_DEVICE": "cpu"}
    out = subprocess.run([sys.executable, "-m", "specq.api.cli", "bench-startup", "--pair",
                          "tiny", "--repeat", "2"], env=env, text=True, capture_output=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr
    phase = r"([\d.]+) s = import ([\d.]+) \+ load ([\d.]+) \+ warm_up ([\d.]+) \+ " \
            r"calibrate ([\d.]+)"
    lines = out.stdout.strip().splitlines()
    assert [re.match(r"start \d+: ", x) is not None for x in lines] == [True, True, False]
    assert lines[-1].startswith("median of 2: ")
    for line in lines:
        total, *parts = map(float, re.search(phase, line).groups())
        # the total and each of its four parts rounded to 0.1 s, each off by 0.05 at most
        # (a median of 2 is their mean: its parts still add up to it)
        assert abs(total - sum(parts)) <= 0.05 * (len(parts) + 1) + 1e-9, line
