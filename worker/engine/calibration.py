"""Measuring what a step costs before the first request, so that the adaptive policy
chooses g from measured costs at once.

At each batch size: a target pass over 1, 2, default + 1 and max_g + 1 tokens per row, and
a draft step, on a synthetic prompt. Acceptance is not learnt here: it depends on the data.
Each cost is the median of ``repeats`` timed runs, so that one stall cannot skew it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from statistics import median
from typing import TYPE_CHECKING

import torch

from specq.worker.engine.batch import KVRows, left_pad
from specq.worker.engine.drafters import DraftInputs

if TYPE_CHECKING:
    from specq.worker.engine.speculative import SpeculativeEngine

log = logging.getLogger(__name__)

# the synthetic prompt: ordinary text, so that prompt lookup finds n-grams to copy
CALIBRATION_TEXT = (
    "The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins "
    "with a single step. "
)


@torch.inference_mode()
def calibrate(engine: SpeculativeEngine, batch_sizes: Iterable[int] | None = None,
              prompt_tokens: int = 128, repeats: int = 3) -> None:
    """Record the engine's step costs in its policy, at each batch size (by default 1, 4,
    16, ... below max_batch_size, and that), then forget the data the runs showed. A no-op
    for an engine that does not adapt g."""
    policy = engine.policy
    if not policy.adaptive:
        return
    t0 = time.perf_counter()
    if batch_sizes is None:
        batch_sizes = {4**i for i in range(8) if 4**i < engine.max_batch_size}
        batch_sizes = sorted(batch_sizes | {engine.max_batch_size})
    widths = sorted({1, 2, policy.default + 1, policy.max_g + 1})
    L = min(prompt_tokens, engine.context - (repeats + 1) * sum(widths) - 1)
    if L < widths[-1]:
        log.warning("context of %d tokens too short to calibrate in", engine.context)
        return
    text = engine.tokenizer(CALIBRATION_TEXT, add_special_tokens=False).input_ids or [1, 2, 3]
    prompt = (text * (L // len(text) + 1))[:L]
    for B in batch_sizes:
        verify = _verify_times(engine, B, prompt, widths, repeats)
        drafts = _draft_step_times(engine, B, prompt, repeats)
        policy.record_costs(B, {n: [median(t)] * repeats for n, t in verify.items()},
                            [median(drafts)] * repeats)
    policy.forget_data()
    log.info("calibrated at batch sizes %s in %.1f s: %s", list(batch_sizes),
             time.perf_counter() - t0, policy.snapshot()["t_verify"])


def _verify_times(engine: SpeculativeEngine, B: int, prompt: list[int], widths: list[int],
                  repeats: int) -> dict[int, list[float]]:
    """Seconds of a target pass over n tokens per row, for B rows of this prompt."""
    dev = engine.target.device
    kv = KVRows(engine.target)
    ids, valid = left_pad([prompt] * B, engine.pad_id, dev)  # [B, L]
    kv.forward(ids, valid, last_only=True)
    times: dict[int, list[float]] = {n: [] for n in widths}
    for rep in range(repeats + 1):  # round 0 warms each shape up, untimed
        for n in widths:
            start, t = kv.length, _clock(dev)
            kv.forward(ids[:, :n], valid[:, :n])
            if rep:
                times[n].append(_clock(dev) - t)
            kv.keep(start, torch.zeros(B, dtype=torch.long, device=dev))
    return times


def _draft_step_times(engine: SpeculativeEngine, B: int, prompt: list[int],
                      repeats: int) -> list[float]:
    """Seconds per draft token of g = default proposals for B rows of this prompt."""
    g, drafter, dev = engine.policy.default, engine.drafter, engine.target.device
    rows = [list(prompt) for _ in range(B)]
    drafter.admit(rows, [prompt[0]] * B)
    zeros = torch.zeros(B, dtype=torch.long)
    inputs = DraftInputs([r + [prompt[0]] for r in rows], zeros, zeros.float(), zeros,
                         torch.ones(B), greedy=True)
    out = []
    for rep in range(repeats + 1):
        t0 = _clock(dev)
        drafter.propose(inputs, g)
        if rep:
            out.append((_clock(dev) - t0) / g)
        drafter.update([0] * B, [[prompt[0]]] * B)  # every draft rejected
    drafter.select(torch.zeros(0, dtype=torch.long))
    return out


def _clock(device: torch.device) -> float:
    """perf_counter once the device has finished its queued work (calibration may wait)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()
