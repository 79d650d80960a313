"""A worker whose engine answers at once, for `specq bench-fleet`: the control plane alone.

    python -m specq.bench.standin --pair tiny-lookup [-n NAME] [--loglevel L]

runs `specq worker --pair PAIR` (named NAME) with the engine's generate replaced by a stand-in that
returns, for every request, one token ("ok") and zero counters, without tokenizing or
running a model: what is left is the job path itself (the broker, leases, reading items,
writing outcomes, settling, dispatching the next chunk). The pair is still loaded, so the
worker starts as a real one does; its start-up warm-up and calibration are skipped.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Hashable, Iterable

from specq.schema.generation import Request
from specq.worker.engine.result import Result
from specq.worker.engine.speculative import SpeculativeEngine

STANDIN_TOKEN = 1
STANDIN_TEXT = "ok"


def standin_generate(self: SpeculativeEngine, requests: Iterable[Request],
                     on_result: Callable[[Result], None] | None = None, *,
                     job: Hashable = None,
                     on_admit: Callable[[list[int | str]], None] | None = None,
                     check: Callable[[], None] | None = None) -> list[Result]:
    """Every request finished at once with one token; results in request order. The
    requests join in batches of the engine's size, announced as a real engine does (and
    ``check`` is called once, as before a real engine's step)."""
    requests = list(requests)
    if on_admit:
        for i in range(0, len(requests), self.max_batch_size):
            on_admit([r.id for r in requests[i:i + self.max_batch_size]])
    if check:
        check()
    results = []
    for request in requests:
        res = Result(id=request.id, token_ids=[STANDIN_TOKEN], text=STANDIN_TEXT,
                     finish_reason="length", prompt_tokens=0)
        res.counters.new_tokens = 1
        results.append(res)
        if on_result:
            on_result(res)
    return results


def install() -> None:
    SpeculativeEngine.generate = standin_generate  # type: ignore[method-assign]
    SpeculativeEngine.calibrate = (  # type: ignore[method-assign]
        lambda self, *a, **k: [])  # nothing to calibrate


def main(argv: list[str]) -> None:
    from specq.worker.launch import run_worker

    p = argparse.ArgumentParser(prog="python -m specq.bench.standin")
    p.add_argument("--pair", required=True)
    p.add_argument("-n", "--hostname")
    p.add_argument("--loglevel", default="warning")
    p.add_argument("--engine", choices=("standin", "real"), default="standin",
                   help="real: the pair's own engine (a plain `specq worker`)")
    args = p.parse_args(argv)
    if args.engine == "standin":
        install()
    run_worker(args.pair, args.loglevel, args.hostname)


if __name__ == "__main__":
    main(sys.argv[1:])
