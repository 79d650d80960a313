"""Where an engine's time goes: every second of ``generate`` in one phase.

The engine's loop is cut into laps that follow each other with no gap: each ``lap`` ends
the interval that the previous one (or ``start``) began and books it to a phase. So the
phases add up to the loop's wall time by construction, and what matters is that each
interval lands in the phase that did the work:

- admit: a refill: encode the prompts, prefill them (shared prefixes once: prefix.py), the
  first token, the drafter's and the cache's new rows;
- propose: the drafting's g and proposal (policy, drafter, shadow scoring), on the device;
- verify: the target's pass over the last token and the drafts;
- mask: a grammar's work for shaped rows (grammar.py): cutting the drafts it refuses,
  masking the verified positions, advancing the matchers (the draft model's own masks are
  part of propose);
- accept: acceptance (rejection.py), the cache keeping what was accepted, and the step's
  one sync (the host reads the tokens and accepted counts);
- upkeep: the drafter's update, both caches' compaction, retiring finished rows (the
  caches' rows selected);
- host: the rest of the engine's own work between passes: per-row parameters before the
  step, handing the step's tokens to the rows (stop strings, counters, the policy);
- results: the caller's ``on_result`` (a worker writes the result down).

On a CPU the host waits for every kernel, so these are the device's phases too. On CUDA
the laps are the host's view: kernels run ahead of it, and their time lands in the phase
that waits for them (accept, at the step's sync); the Step's t_draft and t_verify are the
device's own (speculative.StepClock).
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
        self._last: float | None = None

    def reset(self) -> None:
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self._last = None

    def start(self) -> None:
        """The loop starts: the first lap's interval begins now."""
        self._last = time.perf_counter()

    def lap(self, phase: str) -> None:
        """Book the time since the previous lap (or ``start``) to ``phase``; nothing
        outside a started loop (a calibration's steps)."""
        if self._last is None:
            return
        now = time.perf_counter()
        self.seconds[phase] += now - self._last
        self._last = now

    @contextmanager
    def aside(self, phase: str) -> Iterator[None]:
        """Book the block to ``phase`` and leave it out of the lap around it (a callback
        in the middle of the engine's own work)."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if self._last is not None:
                spent = time.perf_counter() - t0
                self.seconds[phase] += spent
                self._last += spent

    def stop(self) -> None:
        """The loop ended: nothing is booked until the next ``start``."""
        self._last = None

    def total(self) -> float:
        return sum(self.seconds.values())

    def shares(self) -> dict[str, float]:
        """Each phase's share of the total (0 everywhere before any lap)."""
        total = self.total()
        return {p: (s / total if total else 0.0) for p, s in self.seconds.items()}
