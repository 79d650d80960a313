"""A scored drafter's ceiling at a batch size, replayed without the target and its noise.

`python -m specq.bench.replay --pair smollm2-135m --workload json --batch-size 16`: the
target's greedy outputs are what every lossless run emits, so a run can be stepped again
without the target. Rows step as the engine steps them (refilled in order as they end, the
job index fed with each row that ended, the running rows admitted and selected as the
engine's), the suffix drafter proposes up to --max-g tokens a row from the row's tokens so
far, a row accepts the longest prefix of the drafts it keeps that its greedy output goes
on with, then one token more, and each pass is priced as the packed pass costs: plain +
per token carried + per column of the widest row, less what the rows that ended took
(``Price``).
The same proposals under each way of keeping drafts:

- oracle: each row keeps exactly the drafts that survive: the drafter's ceiling;
- budget: the engine's own budget (budget.TwoPart over the policy's survivals, its
  calibration learning from each pass's verdicts as drafting.verdicts teaches it), and
  once no prompt waits for a place the engine's draining budget (budget.drain), told each
  row's true end;
- rate: the same budget at tokens per second to the end, as the engine keeps it where
  rows end at their end of sequence (and kept it everywhere before it knew a batch
  drains);
- limit: the drain told each row's limit (--max-new-tokens) as its end, as the engine
  drains where rows end at their limit (where they end sooner, the limit misleads it);
- level: the drain told every row is as long as the longest (a job of rows whose ends
  nobody knows: a step is saved only where every row gains);
- g = k: every row keeps its first k drafts (a fixed draft length).

Only the verify passes are priced, all alike (no prefill, no host work, no drafting), so
``x plain`` is a ratio of decoding time to plain decoding's, not of a run's wall time; a
machine's noise does not reach it. ``x run`` adds to both sides the prefill a plain run of
the same prompts measured (the same work with drafts or without): what the keeping would
make of a run's wall time if host work cost nothing, the oracle's the ceiling of a run's
ratio with this drafter at this price. The price is the one calibration measures on this
machine at the batch size (its ragged passes' fit: plain, per draft token, per column, and
once for a pass that drafts at all; a batch of fewer than 4 rows has none, and then a pass
of 1 to max_g + 1 tokens a row gives its plain pass and its slope; a row's share of a plain
pass from the plain passes at batch 1 and this one), or --price.
"""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from specq.worker.engine import budget
from specq.worker.engine.drafters import Drafter, DraftInputs, NoDraft
from specq.worker.engine.policy import Widths

ORACLE, BUDGET, RATE, LIMIT, LEVEL = "oracle", "budget", "rate", "limit", "level"
DRAINS = (BUDGET, LIMIT, LEVEL)  # the draining budget, each told the rows' ends its way


@dataclass(frozen=True)
class Price:
    """Seconds of a packed verify pass: ``plain`` for one token a row of ``batch`` rows,
    ``per_token`` for each draft token carried, ``per_column`` for each draft column of the
    widest row, ``per_pass`` once for a pass that carries any draft (policy.PassFit), less
    ``per_row`` for each of the batch's rows that ended (0: a pass costs as much whatever
    its rows)."""

    plain: float
    per_token: float
    per_column: float = 0.0
    per_pass: float = 0.0
    per_row: float = 0.0
    batch: int = 1

    def seconds(self, kept: list[int]) -> float:
        return (self.rows(len(kept)) + self.per_token * sum(kept)
                + self.per_column * max(kept, default=0) + (self.per_pass if any(kept) else 0.0))

    def rows(self, rows: int) -> float:
        """A plain pass over this many rows."""
        return self.plain - self.per_row * max(0, self.batch - rows)


@dataclass
class Replayed:
    """What a replay did: passes, their priced seconds, drafts carried and accepted."""

    keep: str | int
    passes: int
    seconds: float
    carried: int
    accepted: int


def greedy_outputs(model, tokenizer, prompts: list[list[int]], max_new: int,
                   batch: int) -> list[list[int]]:
    """The target's greedy output of each prompt (an engine without drafts)."""
    return plain_run(model, tokenizer, prompts, max_new, batch)[0]


def plain_run(model, tokenizer, prompts: list[list[int]], max_new: int, batch: int
              ) -> tuple[list[list[int]], float, float]:
    """The target's greedy outputs (an engine without drafts), the seconds the run spent
    prefilling the prompts and its wall seconds, as measured."""
    from specq.schema.generation import Request
    from specq.worker.engine.speculative import SpeculativeEngine

    eng = SpeculativeEngine(model, tokenizer, NoDraft(), max_batch_size=batch)
    start = time.perf_counter()
    results = eng.generate([Request(id=i, prompt_token_ids=p, max_new_tokens=max_new)
                            for i, p in enumerate(prompts)])
    return ([r.token_ids for r in results], eng.prefill_seconds,
            time.perf_counter() - start)


def replay(prompts: list[list[int]], outputs: list[list[int]], batch: int,
           make_drafter: Callable[[], Drafter], keep: str | int, price: Price,
           max_g: int = 8, limit: int | None = None) -> Replayed:
    """Step the outputs as the engine would at this batch size, keeping drafts by ``keep``
    (ORACLE, BUDGET, RATE, LIMIT, LEVEL or a fixed g; 0: plain decoding), each pass priced
    by ``price``; ``limit``: the requests' max_new_tokens (LIMIT; by default the longest
    output's length)."""
    limit = max(map(len, outputs), default=0) if limit is None else limit
    drafter = make_drafter()
    policy = Widths(max_g=max_g)  # its survivals and its calibration, as the engine's
    calibration = policy.calibration
    waiting = list(range(len(prompts)))
    rows: list[list[int]] = []  # per row: [request index, tokens of its output emitted]
    seqs: list[list[int]] = []  # per row: its tokens, grown in place as the engine's
    out = Replayed(keep, 0, 0.0, 0, 0)
    while waiting or rows:
        while waiting and len(rows) < batch:  # the prefill yields the first token
            i = waiting.pop(0)
            if len(outputs[i]) > 1:
                rows.append([i, 1])
                seqs.append(prompts[i] + outputs[i][:1])
                drafter.admit([prompts[i]], outputs[i][:1])
            else:
                drafter.finish(prompts[i] + outputs[i])
        if not rows:
            continue
        B = len(rows)
        zeros = torch.zeros(B, dtype=torch.long)
        rest = [outputs[i][n:] for i, n in rows]
        asked = max_g if isinstance(keep, str) else int(keep)
        if asked:
            prop = drafter.propose(DraftInputs(seqs, zeros, zeros.float(), zeros,
                                               torch.ones(B), greedy=True), asked)
            drafts = [ids[: min(n, len(r) - 1)] for ids, n, r in zip(
                prop.token_ids.tolist(), prop.num_draft.tolist(), rest)]
            conf = ([c[: len(d)] for c, d in zip(prop.confidences, drafts)]
                    if prop.confidence is not None else [[] for _ in drafts])
        else:
            drafts, conf = [[] for _ in rows], [[] for _ in rows]
        right = [_agree(d, r) for d, r in zip(drafts, rest)]
        if keep == ORACLE:
            kept = right
        elif keep in (RATE, *DRAINS):
            survivals = policy.survivals([len(c) for c in conf], [[] for _ in conf], conf)
            cost = budget.TwoPart(price.rows(B), price.per_token, price.per_column, B,
                                  price.per_pass)
            if not any(survivals):
                kept = [0] * B
            elif keep in DRAINS and not waiting and B > 1:  # as policy.allot drains
                ends = {BUDGET: [len(r) for r in rest], LIMIT: [limit - n for _, n in rows],
                        LEVEL: [max(map(len, rest))] * B}[keep]
                kept = budget.drain(cost, survivals, ends,
                                    *budget.split(price.rows(B), price.rows(1), B))
            else:
                kept = cost.allot(survivals)
            for c, k, a, d, r in zip(conf, kept, right, drafts, rest):
                if k:
                    calibration.add(c[:k], min(a, k))
                elif c:  # a plain pass judges the first draft token all the same
                    calibration.add(c[:1], int(d[0] == r[0]))
        else:
            kept = [len(d) for d in drafts]
        accepted = [min(a, k) for a, k in zip(right, kept)]
        out.passes += 1
        out.seconds += price.seconds(kept)
        out.carried += sum(kept)
        out.accepted += sum(accepted)
        for row, seq, a in zip(rows, seqs, accepted):
            seq += outputs[row[0]][row[1] : row[1] + a + 1]
            row[1] += a + 1
        for i in [i for i, n in rows if n >= len(outputs[i])]:
            drafter.finish(prompts[i] + outputs[i])
        staying = [b for b, (i, n) in enumerate(rows) if n < len(outputs[i])]
        if len(staying) < len(rows):
            drafter.select(torch.tensor(staying, dtype=torch.long))
            rows, seqs = [rows[b] for b in staying], [seqs[b] for b in staying]
    return out


def _agree(draft: list[int], rest: list[int]) -> int:
    """How many of the draft's first tokens the output goes on with."""
    n = 0
    while n < len(draft) and n < len(rest) and draft[n] == rest[n]:
        n += 1
    return n


def measured_price(model, tokenizer, make_drafter: Callable[[], Drafter], batch: int,
                   max_g: int) -> Price:
    """The pass's price as calibration measures it at this batch size: its ragged passes'
    fit (policy.PassFit) where it has one; else the plain pass and the least-squares slope
    of the passes of 2 to max_g + 1 tokens a row, per token."""
    from specq.worker.engine.speculative import SpeculativeEngine

    eng = SpeculativeEngine(model, tokenizer, make_drafter(), max_batch_size=batch,
                            max_draft_length=max_g)
    eng.calibrate([1, batch])
    lone = eng.policy.costs.verify_seconds(1, 1)
    fit = eng.policy.costs.pass_fit(batch)
    if fit is not None:
        plain, per_pass, per_token, per_column = fit
        per_row = budget.split(plain, lone, batch)[1] if lone else 0.0
        return Price(plain, per_token, per_column, per_pass, per_row, batch)
    widths = [(n, eng.policy.costs.verify_seconds(n, batch)) for n in range(1, max_g + 2)]
    points = [(batch * (n - 1), t) for n, t in widths if t is not None]
    if len(points) < 2:
        raise RuntimeError(f"calibration measured no verify pass at batch {batch}")
    mx = sum(x for x, _ in points) / len(points)
    my = sum(y for _, y in points) / len(points)
    slope = (sum((x - mx) * (y - my) for x, y in points)
             / sum((x - mx) ** 2 for x, _ in points))
    return Price(points[0][1], max(slope, 0.0))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m specq.bench.replay", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pair", default="smollm2-135m")
    p.add_argument("--workload", default="json", help="rewrite, json, synthesis or chat")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--prompts", type=int, default=None, help="number of prompts (cycled)")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--max-g", type=int, default=8, help="draft tokens a row is asked for")
    p.add_argument("--draft-lengths", default="1,2,4", help="fixed g replayed beside")
    p.add_argument("--price", default=None,
                   metavar="PLAIN,PER_TOKEN[,PER_COLUMN[,PER_PASS[,PER_ROW]]]",
                   help="seconds of a pass instead of calibration's (e.g. a bench run's fit)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)

    from specq.bench import load_bench_pair
    from specq.bench.workloads import WORKLOADS
    from specq.schema.generation import Request
    from specq.worker.engine.speculative import encode_prompt
    from specq.worker.engine.suffix import SuffixDrafter

    pair = load_bench_pair(argparse.Namespace(pair=args.pair, device=None, dtype=None,
                                              data_dir=None, threads=None))
    engine = pair.engine()
    convs = WORKLOADS[args.workload]()
    convs = [convs[i % len(convs)] for i in range(args.prompts or len(convs))]
    prompts = [encode_prompt(pair.tokenizer, Request(messages=m,
                                                     max_new_tokens=args.max_new_tokens),
                             engine.context) for m in convs]
    # a short run first: the measured one's first passes are then not its shapes' first
    plain_run(pair.target, pair.tokenizer, prompts[: args.batch_size], 2, args.batch_size)
    outputs, prefill, wall = plain_run(pair.target, pair.tokenizer, prompts,
                                       args.max_new_tokens, args.batch_size)
    if args.price:
        v = [float(x) for x in args.price.split(",")]
        v += [0.0] * (5 - len(v))
        price = Price(v[0], v[1], v[2], v[3], v[4], args.batch_size)
    else:
        price = measured_price(pair.target, pair.tokenizer, SuffixDrafter, args.batch_size,
                               args.max_g)
    plain = replay(prompts, outputs, args.batch_size, SuffixDrafter, 0, price)
    keeps: list[str | int] = [ORACLE, BUDGET, RATE, LIMIT, LEVEL,
                              *(int(g) for g in args.draft_lengths.split(","))]
    print(f"replay: {args.pair}, {args.workload}, {len(prompts)} prompts, batch "
          f"{args.batch_size}, {sum(map(len, outputs))} tokens; a pass {1e3 * price.plain:.1f} "
          f"ms + {1e3 * price.per_token:.2f} ms a draft token + {1e3 * price.per_column:.2f} "
          f"ms a column + {1e3 * price.per_pass:.2f} ms a drafting pass, "
          f"{1e3 * price.per_row:.2f} ms of it a row's; plain decoding "
          f"{plain.passes} passes priced {plain.seconds:.2f} s")
    print(f"a plain run measured: {wall:.2f} s, of which prefill {prefill:.2f} s (the same "
          f"work with drafts or without; x run: (prefill + plain decoding) / (prefill + "
          f"decoding), decoding as priced)")
    print(f"{'keep':<8} {'x plain':>7} {'x run':>6} {'passes':>6} {'carried':>7} "
          f"{'accepted':>8}")
    for keep in keeps:
        r = replay(prompts, outputs, args.batch_size, SuffixDrafter, keep, price, args.max_g,
                   args.max_new_tokens)
        name = keep if isinstance(keep, str) else f"g = {keep}"
        run = (prefill + plain.seconds) / (prefill + r.seconds)
        print(f"{name:<8} {plain.seconds / r.seconds:>6.3f}x {run:>5.3f}x {r.passes:>6} "
              f"{r.carried:>7} {r.accepted:>8}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
