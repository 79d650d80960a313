"""Where an engine's time goes: every second of ``generate`` in one phase.

The engine's loop runs inside ``loop``, each piece of its work inside a ``phase`` block.
Phases nest: a second lands in the innermost phase open at the time, and the loop's
seconds outside every other phase are the host's. So the phases add up to the loop's wall
time by construction. What matters is that each block sits in the phase that did the work:

- admit: a refill: encode the prompts, prefill them (shared prefixes once: prefix.py), the
  first token, the drafter's and the cache's new rows; a refill that joins the next step's
  pass (speculative.py: _join) only encodes and takes its stored prefix here;
- propose: the drafting's g and proposal (policy, drafter, shadow scoring), on the device;
- verify: the target's pass over the last token and the drafts (and the prompts of rows
  joining it);
- mask: a grammar's work for shaped rows (grammar.Shaped): cutting the drafts it refuses,
  masking the verified positions (and a refill's first token), advancing the matchers (the
  draft model's own masks are part of propose);
- accept: acceptance (rejection.py), the cache keeping what was accepted, and the step's
  one sync (the host reads the tokens and accepted counts);
- upkeep: the drafter's update, both caches' compaction, retiring finished rows (the
  caches' rows selected);
- host: the rest of the engine's own work between passes: per-row parameters before the
  step, handing the step's tokens to the rows (stop strings, counters, the policy);
- results: the caller's ``on_result`` (a worker writes the result down).

On a CPU the host waits for every kernel, so these are the device's phases too. On CUDA
the phases are the host's view: kernels run ahead of it, and their time lands in the phase
that waits for them (accept, at the step's sync); the Step's t_draft and t_verify are the
device's own (speculative.StepClock).

A ``Stopwatch`` is the other clock here: the seconds of one kind of work wherever it
runs, across phases (a grammar's masks: grammar.Grammars.masking).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

PHASES = ("admit", "propose", "verify", "mask", "accept", "upkeep", "host", "results")


class Profile:
    """Seconds per phase over the engine's life (``reset`` starts again)."""

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(PHASES, 0.0)
        # per open phase, the innermost last: the seconds of the phases nested in it;
        # None while no loop runs (a calibration's passes, a step driven by hand)
        self._nested: list[float] | None = None

    def reset(self) -> None:
        self.seconds = dict.fromkeys(PHASES, 0.0)

    @contextmanager
    def loop(self) -> Iterator[None]:
        """The engine's loop runs: its seconds outside every other phase are the host's."""
        self._nested = []
        try:
            with self.phase("host"):
                yield
        finally:
            self._nested = None

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Book the block's seconds to ``name``, less those of the phases nested in it
        (they book their own); nothing outside a running loop."""
        if self._nested is None:
            yield
            return
        self._nested.append(0.0)
        t0 = time.perf_counter()
        try:
            yield
        finally:
            spent = time.perf_counter() - t0
            self.seconds[name] += spent - self._nested.pop()
            if self._nested:
                self._nested[-1] += spent

    def total(self) -> float:
        return sum(self.seconds.values())

    def shares(self) -> dict[str, float]:
        """Each phase's share of the total (0 everywhere before any loop)."""
        total = self.total()
        return {p: (s / total if total else 0.0) for p, s in self.seconds.items()}


class Stopwatch:
    """Seconds spent inside its ``with`` blocks over its life. A block inside another
    counts once; a ``paused`` block inside one counts nothing (work done on another's
    behalf)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._depth = 0  # blocks open
        self._since = 0.0  # when the outermost open block began, less the pauses in it

    def __enter__(self) -> None:
        if not self._depth:
            self._since = time.perf_counter()
        self._depth += 1

    def __exit__(self, *exc: object) -> None:
        self._depth -= 1
        if not self._depth:
            self.seconds += time.perf_counter() - self._since

    @contextmanager
    def paused(self) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._since += time.perf_counter() - t0  # no effect outside a block

    def reset(self) -> None:
        self.seconds = 0.0
