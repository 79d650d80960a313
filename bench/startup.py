"""`specq bench-startup`: how long a worker takes from its start to its first chunk.

Each run is a fresh process (imports and the model load are what a new worker pays) that
imports the worker's task module and runs its start-up (worker/tasks.py ``start_up``):
loading the pair, one short warm-up generation, calibrating the step costs. The first run
on a machine also converts a GGUF checkpoint (worker/pairs.py), once: later runs show what
every later worker start costs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from statistics import median

from specq.broker.names import WORKER_PAIR_ENV

PHASES = ("import", "load", "warm_up", "calibrate")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pair", default="smollm2-135m", help="model-pair preset")
    p.add_argument("--repeat", type=int, default=3, help="fresh worker starts to time")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)


def child() -> dict[str, float]:
    """One worker start in this process: seconds of each phase."""
    t0 = time.perf_counter()
    from specq.configs.settings import get_settings
    from specq.worker.tasks import start_up

    phases = {"import": time.perf_counter() - t0}
    phases.update(start_up(get_settings()))
    return phases


def run(args: argparse.Namespace) -> int:
    if args.child:
        print(json.dumps(child()))
        return 0
    env = {**os.environ, WORKER_PAIR_ENV: args.pair}
    runs = []
    for i in range(args.repeat):
        out = subprocess.run([sys.executable, "-m", __name__, "--child"], env=env, text=True,
                             stdout=subprocess.PIPE, check=True).stdout
        runs.append(json.loads(out.strip().splitlines()[-1]))
        print(f"start {i + 1}: {_line(runs[-1])}", flush=True)
    print(f"median of {len(runs)}: " + _line({k: median(r[k] for r in runs) for k in PHASES}))
    return 0


def _line(phases: dict[str, float]) -> str:
    total = sum(phases[k] for k in PHASES)
    return f"{total:.1f} s = " + " + ".join(f"{k} {phases[k]:.1f}" for k in PHASES)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m specq.bench.startup", description=__doc__)
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
