"""Running one configuration: HF plain, HF assisted, or a specq engine, timed alike.

Every runner takes prompt token ids and returns a Run: wall seconds, the generated ids
of each prompt (up to and including EOS), and for specq the results and every step the
engine made (g, proposals, acceptances, draft and verify time), seen through its on_step.
"""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import cast

import torch
from transformers import GenerationMixin, PreTrainedModel, PreTrainedTokenizerBase

from specq.configs.presets import get_preset
from specq.configs.settings import Settings
from specq.schema.generation import Request
from specq.worker.engine.batch import left_pad
from specq.worker.engine.drafters import Drafter, NoDraft
from specq.worker.engine.result import Result
from specq.worker.engine.speculative import SpeculativeEngine
from specq.worker.engine.step import Step
from specq.worker.pairs import Pair, load_pair

log = logging.getLogger(__name__)

HF, ASSISTED, NONE, FIXED, ADAPTIVE = "hf", "hf-assisted", "specq-none", "specq-fixed", \
    "specq-adaptive"
WARM_UP, TIMED = "bench warm-up", "bench"  # the engine's job names for the two
METHODS = {"hf": HF, "assisted": ASSISTED, "none": NONE, "fixed": FIXED, "adaptive": ADAPTIVE}


@dataclass
class Run:
    method: str
    batch_size: int
    seconds: float
    outputs: list[list[int]]  # per prompt: generated ids up to and including EOS
    draft: str | None = None
    g: int | None = None  # fixed draft length; None for adaptive and HF
    results: list[Result] | None = None
    steps: list[Step] = field(default_factory=list)
    snapshot: dict | None = None  # the engine policy's own (decayed) estimates, and the
    # drafting regime's (drafting.Scored: the steps its drafter rested)
    prefill_seconds: float | None = None  # of ``seconds``, spent prefilling prompts (specq)
    profile: dict[str, float] | None = None  # of ``seconds``, per phase (engine/profile.py)

    @property
    def new_tokens(self) -> int:
        return sum(len(o) for o in self.outputs)


@dataclass
class Target:
    """What every runner needs to know of the target."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    eos_ids: set[int]
    pad_id: int


def load_bench_pair(args: argparse.Namespace) -> Pair:
    """The pair a bench runs, on the device, dtype and data directory its flags name (the
    settings' where they name none), with torch's threads set as --threads says."""
    overrides = {k: v for k in ("device", "dtype", "data_dir")
                 if (v := getattr(args, k, None)) is not None}
    if getattr(args, "threads", None):
        torch.set_num_threads(args.threads)
    settings = Settings(**overrides)
    return load_pair(get_preset(args.pair, settings.presets_file), settings)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def cut_at_eos(ids: list[int], eos_ids: set[int]) -> list[int]:
    for i, t in enumerate(ids):
        if t in eos_ids:
            return ids[: i + 1]
    return ids


def _hf_generate(t: Target, prompts: list[list[int]], max_new: int, **extra) -> list[list[int]]:
    ids, valid = left_pad(prompts, t.pad_id, t.model.device)  # [B, T]
    out = cast(GenerationMixin, t.model).generate(  # a causal LM's (AutoModelForCausalLM)
        input_ids=ids, attention_mask=valid.long(), max_new_tokens=max_new, do_sample=False,
        pad_token_id=t.pad_id, eos_token_id=sorted(t.eos_ids), **extra,
    )  # [B, T + new]
    return [cut_at_eos(row, t.eos_ids) for row in out[:, ids.shape[1]:].tolist()]


def run_hf(t: Target, prompts: list[list[int]], batch_size: int, max_new: int) -> Run:
    """(a) plain batched greedy `generate` with the target alone, left padded."""
    _hf_generate(t, prompts[:batch_size], 2)  # warm-up
    outputs: list[list[int]] = []
    _sync(t.model.device)
    t0 = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        outputs += _hf_generate(t, prompts[i : i + batch_size], max_new)
    _sync(t.model.device)
    return Run(HF, batch_size, time.perf_counter() - t0, outputs)


def run_assisted(t: Target, prompts: list[list[int]], max_new: int, draft: str,
                 assistant: dict) -> Run:
    """(b) HF assisted generation one prompt at a time (``assistant`` holds either
    assistant_model= or prompt_lookup_num_tokens=), as a user would run it."""
    _hf_generate(t, prompts[:1], 4, **assistant)  # warm-up
    _sync(t.model.device)
    t0 = time.perf_counter()
    outputs = [_hf_generate(t, [p], max_new, **assistant)[0] for p in prompts]
    _sync(t.model.device)
    return Run(ASSISTED, 1, time.perf_counter() - t0, outputs, draft=draft)


def run_specq(t: Target, prompts: list[list[int]], batch_size: int, max_new: int, *,
              make_drafter: Callable[[], Drafter] = NoDraft, draft: str | None = None,
              g: int | None = 0, max_g: int = 8) -> Run:
    """(c) no speculation (the default NoDraft), (d) fixed g, or (e) adaptive (g=None).

    Every engine warms up on the first batch of prompts for a few tokens, then runs the
    calibration's passes: an adaptive one records its step costs there (as a worker does
    when it starts) and forgets what the warm-up showed of acceptance; the others record
    nothing, but come to the timed run as warm (on a GPU where only adaptive calibrated,
    none's steps ran 2-5x slower than adaptive's at one token a pass each,
    docs/gpu-check-2026-12-04.md; whether the warm-up was the cause is the next GPU run's
    to show).
    """
    adaptive = g is None
    length = min(4, max_g) if g is None else g
    eng = SpeculativeEngine(t.model, t.tokenizer, make_drafter(), max_batch_size=batch_size,
                            draft_length=length, adaptive=adaptive,
                            max_draft_length=max(max_g, length))
    requests = [Request(id=i, prompt_token_ids=p, max_new_tokens=max_new)
                for i, p in enumerate(prompts)]
    # the warm-up is a job of its own: a suffix drafter starts the timed run knowing nothing
    eng.generate([r.model_copy(update={"max_new_tokens": 4}) for r in requests[:batch_size]],
                 job=WARM_UP)
    eng.calibrate(warm=True)
    eng.prefill_seconds = 0.0
    eng.profile.reset()
    # every step of the timed run: the policy's own estimates are decayed means, weighted
    # to the latest steps, and the bench wants the whole run
    steps: list[Step] = []
    eng.on_step = steps.append
    _sync(t.model.device)
    t0 = time.perf_counter()
    results = eng.generate(requests, job=TIMED)
    _sync(t.model.device)
    seconds = time.perf_counter() - t0
    for r in results:
        if r.error:
            raise RuntimeError(f"request {r.id}: {r.error}")
    method = NONE if g == 0 else ADAPTIVE if adaptive else FIXED
    return Run(method, batch_size, seconds, [r.token_ids for r in results], draft=draft, g=g,
               results=results, steps=steps, snapshot=eng.drafting.snapshot(),
               prefill_seconds=eng.prefill_seconds, profile=dict(eng.profile.seconds))
