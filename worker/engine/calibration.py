"""Measuring what a step costs before the first request, so that the adaptive policy
chooses g from measured costs at once.

Few measurements, cheap ones: a worker's start waits for them, and the policy refines every
cost from the steps it then runs (policy.py: decayed means, a plain step now and then).
At a few batch sizes (1, 16, 256, ... below max_batch_size, and that; the policy
interpolates between them) on a short synthetic prompt: a target pass over 1, 2 and
default + 1 tokens per row (1 -> 2 is the knee on a CPU; wider passes follow the 2 ->
default + 1 slope until the policy measures them), a draft step, and for a packed model a
few ragged passes (``shapes``: the two-part price of a packed pass, policy.PassFit). Each is timed
``repeats`` times and the fastest kept: the first call of a shape and a stall of a busy
machine are slower, never faster. Acceptance is not learnt here: it depends on the data.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import Any, Protocol

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from specq.worker.engine.batch import KVRows, left_pad
from specq.worker.engine.drafters import Drafter, DraftInputs
from specq.worker.engine.policy import FIT_READY, DraftLengthPolicy

log = logging.getLogger(__name__)

# the synthetic prompt: ordinary text, so that prompt lookup finds n-grams to copy
CALIBRATION_TEXT = (
    "The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins "
    "with a single step. "
)
BATCH_RATIO = 16  # batch sizes 1, 16, 256, ... and the maximum; costs between are near a line
PROMPT_TOKENS = 64  # a short prompt's context: a long one's costs are learnt from its steps
PREFILL_TOKENS = 256  # a large batch's prompts are shortened to this many tokens in all
REPEATS = 2  # timed runs of each pass, the fastest kept
SHAPES = 4  # ragged passes timed at a batch size of 4 rows or more (``shapes``)


class Engine(Protocol):
    """What calibration reads of an engine (speculative.SpeculativeEngine, which imports
    this module: declared here, no import back)."""

    target: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    drafter: Drafter
    policy: DraftLengthPolicy
    context: int  # tokens the target attends to at most
    pad_id: int

    @property
    def max_batch_size(self) -> int: ...


def batch_sizes(max_batch_size: int) -> list[int]:
    """1, BATCH_RATIO, BATCH_RATIO**2, ... below max_batch_size, and max_batch_size."""
    sizes, b = {max_batch_size}, 1
    while b < max_batch_size:
        sizes.add(b)
        b *= BATCH_RATIO
    return sorted(sizes)


def forwards(num_batch_sizes: int, num_widths: int, repeats: int = REPEATS,
             ragged_sizes: int = 0) -> int:
    """Target forward passes a calibration makes: at each batch size, one prefill and
    ``repeats`` passes at each width; at each of ``ragged_sizes`` batch sizes of 4 rows or
    more (a packed model's), ``repeats`` passes of each ragged shape too."""
    return num_batch_sizes * (1 + repeats * num_widths) + ragged_sizes * repeats * SHAPES


@torch.inference_mode()
def calibrate(engine: Engine, sizes: Iterable[int] | None = None,
              prompt_tokens: int = PROMPT_TOKENS, repeats: int = REPEATS,
              budget: float | None = None, warm: bool = False) -> list[int]:
    """Record the engine's step costs in its policy at each batch size (by default
    ``batch_sizes(max_batch_size)``), then forget the data the runs showed. Returns the
    batch sizes measured; none for an engine that does not adapt g, unless ``warm``: it
    then runs the same passes and records nothing (a benchmark warms every engine alike:
    a device's allocator and kernels come out of them as they do for an adaptive one).

    ``budget`` (seconds): the smallest batch size is always measured, then the largest (a
    batch runs full but for a job's tail: the largest is where the steps spend their time,
    and a short job may not run long enough to learn it), then the others, each while the
    time it should take (the last one's, scaled by the tokens it carries) fits in what is
    left. A large batch's prompts are shortened to PREFILL_TOKENS in all. The policy learns
    the costs of the others from the steps it runs."""
    policy = engine.policy
    if not policy.adapts and not warm:
        return []
    t0 = time.perf_counter()
    sizes = batch_sizes(engine.max_batch_size) if sizes is None else sorted(set(sizes))
    widths = sorted({1, 2, policy.default + 1})
    L = min(prompt_tokens, engine.context - repeats * sum(widths) - 1)
    if L < widths[-1]:
        log.warning("context of %d tokens too short to calibrate in", engine.context)
        return []
    text = engine.tokenizer(CALIBRATION_TEXT, add_special_tokens=False).input_ids or [1, 2, 3]
    prompt = (text * (L // len(text) + 1))[:L]
    measured: list[int] = []
    spent_last, tokens_last = 0.0, 1
    for B in sizes[:1] + sizes[:0:-1]:  # the ends first, then down from the largest
        spent = time.perf_counter() - t0
        rows = prompt[:max(max(widths[-1], policy.max_g) + 1, min(L, PREFILL_TOKENS // B))]
        tokens = B * (len(rows) + repeats * (sum(widths) + SHAPES))
        if measured and budget is not None:
            if spent + spent_last * tokens / tokens_last > budget:
                log.info("calibration: batch size %d left to the steps (budget %.1f s)", B,
                         budget)
                continue
        start = time.perf_counter()
        verify, ragged = _verify_times(engine, B, rows, widths, repeats)
        drafts = _draft_step_times(engine, B, rows, repeats) if policy.default else []
        if policy.adapts:  # the fastest run, weighted as all: a calibrated width is trusted
            policy.record_costs(B, {n: [min(t)] * repeats for n, t in verify.items()},
                                [min(drafts)] * repeats)
            for carried, t in ragged.items():
                policy.costs.add_shape(B, sum(carried), max(carried) + 1, min(t),
                                       FIT_READY / len(ragged))
        spent_last, tokens_last = time.perf_counter() - start, tokens
        measured.append(B)
    policy.forget_data()
    log.info("calibrated at batch sizes %s in %.1f s: %s", measured,
             time.perf_counter() - t0, policy.snapshot()["t_verify"])
    return sorted(measured)


def _verify_times(engine: Engine, B: int, prompt: list[int], widths: list[int],
                  repeats: int) -> tuple[dict[int, list[float]],
                                         dict[tuple[int, ...], list[float]]]:
    """Seconds of a target pass over n tokens per row, for B rows of this prompt; and of
    each ragged pass (``shapes``: the draft tokens each row carries), none for a model
    without the packed forward (its pass costs the padded block: a token is not priced
    apart from a column) or a prompt too short for the widest row."""
    dev, policy = engine.target.device, engine.policy
    kv = KVRows(engine.target)
    ids, valid = left_pad([prompt] * B, engine.pad_id, dev)  # [B, L]
    kv.forward(ids, valid, last_only=True)
    cuts = [c for c in shapes(B, policy.default, policy.max_g) if max(c) < len(prompt)]
    passes: dict[Any, torch.Tensor] = {n: valid[:, :n] for n in widths}
    if kv.packed:
        passes.update({c: torch.arange(max(c) + 1, device=dev)[None]
                       <= torch.tensor(c, device=dev)[:, None] for c in cuts})
    times: dict[Any, list[float]] = {key: [] for key in passes}
    for _ in range(repeats):
        for key, mask in passes.items():
            start, t = kv.marker(), _clock(dev)
            kv.logits(ids[:, : mask.shape[1]], mask)  # as a step verifies
            times[key].append(_clock(dev) - t)
            kv.keep(start, torch.zeros(B, dtype=torch.long, device=dev))
    return ({n: times[n] for n in widths},
            {k: v for k, v in times.items() if isinstance(k, tuple)})


def shapes(B: int, g: int, max_g: int) -> list[tuple[int, ...]]:
    """Ragged verify passes calibration times at batch size B, as the draft tokens each
    row carries: a lone row of max_g, a quarter of the rows g each (at least one row and
    one token), half the rows one, one row one (SHAPES of them from 4 rows up). With
    the full widths they price a packed pass's token apart from its column (policy.PassFit)
    at the extremes the budget picks from (a batch of fewer rows has no shapes to tell
    apart)."""
    if B < 4 or not max_g:
        return []
    few = max(1, B // 4)
    out = {(max_g,) + (0,) * (B - 1), (max(g, 1),) * few + (0,) * (B - few),
           (1,) * (B // 2) + (0,) * (B - B // 2), (1,) + (0,) * (B - 1)}
    return sorted(out, reverse=True)


def _draft_step_times(engine: Engine, B: int, prompt: list[int],
                      repeats: int) -> list[float]:
    """Seconds per draft token of g = default proposals for B rows of this prompt."""
    g, drafter, dev = engine.policy.default, engine.drafter, engine.target.device
    rows = [list(prompt) for _ in range(B)]
    drafter.admit(rows, [prompt[0]] * B)
    zeros = torch.zeros(B, dtype=torch.long)
    inputs = DraftInputs([r + [prompt[0]] for r in rows], zeros, zeros.float(), zeros,
                         torch.ones(B), greedy=True)
    out = []
    for _ in range(repeats):
        t0 = _clock(dev)
        drafter.propose(inputs, g)
        out.append((_clock(dev) - t0) / g)
        drafter.update([0] * B, [[prompt[0]]] * B)  # every draft rejected
    drafter.select(torch.zeros(0, dtype=torch.long))
    return out


def _clock(device: torch.device) -> float:
    """perf_counter once the device has finished its queued work (calibration may wait)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()
