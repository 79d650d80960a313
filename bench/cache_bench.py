"""A decode step's cost with three KV caches, side by side: specq's in-place buffers
(KVRows), transformers' StaticCache and transformers' DynamicCache (which concatenates
every layer's keys and values at every forward).

Each cache holds B rows of `columns` real columns (one random prompt, prefilled once
and copied into every row of every cache); a round times `--steps` decode steps
(one token per row) with each cache in turn, then takes the steps back out, so every
step sees the same length. Rounds interleave the caches; the figure is each cache's
median step over the rounds, and its ratio to the static cache's.

    python -m specq.bench.cache_bench --pair smollm2-135m --columns 64,512

On a CPU shared with other work, `--threads 1` keeps torch's thread pool from stalling.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time

import torch
from transformers import DynamicCache, PreTrainedModel, StaticCache

from specq.bench import _ints, add_model_arguments, load_model, positive_int
from specq.worker.engine.batch import KVRows

log = logging.getLogger(__name__)
CACHES = ("in-place", "static", "dynamic")
VOCAB_LOW = 100  # random prompt ids start here, past any special token


class _HFCache:
    """A transformers cache over B rows of `columns` real columns, stepped one token."""

    def __init__(self, model: PreTrainedModel, kind: str,
                 layers: list[tuple[torch.Tensor, torch.Tensor]], batch: int, steps: int):
        L = layers[0][0].shape[2]
        self.model, self.B, self.length = model, batch, L  # columns used, kept on the host
        self.cache = (StaticCache(config=model.config, max_cache_len=L + steps)
                      if kind == "static" else DynamicCache(config=model.config))
        for i, (keys, values) in enumerate(layers):
            self.cache.update(keys.expand(batch, -1, -1, -1).contiguous(),
                              values.expand(batch, -1, -1, -1).contiguous(), i)

    def step(self, ids: torch.Tensor) -> None:
        L, T = self.length, ids.shape[1]
        pos = torch.arange(L, L + T, device=ids.device)[None].expand(self.B, T)
        mask = torch.ones(self.B, L + T, dtype=torch.long, device=ids.device)
        self.model(input_ids=ids, attention_mask=mask, position_ids=pos, cache=self.cache,
                   use_cache=True, logits_to_keep=1)
        self.length = L + T

    def rewind(self, steps: int) -> None:
        self.cache.crop(-steps)
        self.length -= steps


class _KVRowsCache:
    def __init__(self, model: PreTrainedModel, layers: list[tuple[torch.Tensor, torch.Tensor]],
                 batch: int):
        self.kv = KVRows.from_prefix(model, layers, [layers[0][0].shape[2]] * batch)
        self.start = self.kv.length

    def step(self, ids: torch.Tensor) -> None:
        self.kv.forward(ids, torch.ones_like(ids, dtype=torch.bool), last_only=True)

    def rewind(self, steps: int) -> None:
        """Drop the steps' columns: mask them, then compact them away (a gather in place)."""
        self.kv.keep(self.start, torch.zeros(self.kv.rows, dtype=torch.long,
                                             device=self.kv.device))
        self.kv.compact(force=True)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def measure(model: PreTrainedModel, batch: int, columns: int, steps: int,
            rounds: int) -> dict[str, float]:
    """Median seconds of one decode step for each cache, at B rows of L columns."""
    dev = model.device
    gen = torch.Generator().manual_seed(columns)
    vocab = model.config.get_text_config().vocab_size
    ids = torch.randint(VOCAB_LOW, vocab, (1, columns), generator=gen).to(dev)
    step_ids = torch.randint(VOCAB_LOW, vocab, (batch, steps), generator=gen).to(dev)
    one = KVRows(model)  # one row's prompt, prefilled once and copied into every cache
    one.forward(ids, torch.ones_like(ids, dtype=torch.bool), last_only=True)
    layers = one.columns(0, 0, columns)
    caches: dict[str, _KVRowsCache | _HFCache] = {
        "in-place": _KVRowsCache(model, layers, batch),
        "static": _HFCache(model, "static", layers, batch, steps),
        "dynamic": _HFCache(model, "dynamic", layers, batch, steps)}
    times: dict[str, list[float]] = {k: [] for k in CACHES}
    for r in range(rounds + 1):  # round 0 warms up, untimed
        for name in CACHES:
            cache = caches[name]
            _sync(dev)
            t0 = time.perf_counter()
            for s in range(steps):
                cache.step(step_ids[:, s : s + 1])
            _sync(dev)
            if r:
                times[name].append((time.perf_counter() - t0) / steps)
            cache.rewind(steps)
    return {k: statistics.median(v) for k, v in times.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m specq.bench.cache_bench",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(p)
    p.add_argument("--batch", type=positive_int, default=16)
    p.add_argument("--columns", type=_ints, default=[64, 512])
    p.add_argument("--steps", type=positive_int, default=8, help="decode steps per round")
    p.add_argument("--rounds", type=positive_int, default=10)
    args = p.parse_args(argv)
    pair = load_model(args)
    print(f"decode step, batch {args.batch}, {args.pair} on {pair.target.device} "
          f"{str(pair.target.dtype).removeprefix('torch.')}, median of {args.rounds} "
          f"rounds x {args.steps} steps, torch threads {torch.get_num_threads()}")
    print(f"{'columns':>8} " + " ".join(f"{k + ' ms':>12}" for k in CACHES)
          + f" {'in-place/static':>16} {'dynamic/static':>15}")
    for L in args.columns:
        t = measure(pair.target, args.batch, L, args.steps, args.rounds)
        print(f"{L:>8} " + " ".join(f"{t[k] * 1e3:>12.2f}" for k in CACHES)
              + f" {t['in-place'] / t['static']:>16.3f} {t['dynamic'] / t['static']:>15.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
