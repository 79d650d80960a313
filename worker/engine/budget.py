"""One draft budget per step: a draft token is verified only where it is likely to pay.

Each row's candidate draft tokens carry a predicted survival, the probability that the
target accepts the token and every one before it: the chain product of per-token
acceptance (policy.py keeps it: Calibration for a drafter that scores its tokens, alpha for
one that does not, 1 for a token a grammar forces). Verifying a token costs part of a
pass; it pays while its survival beats that cost, counted in the tokens a plain pass
yields. vLLM's DSpark spends one budget per step this way, ranking all requests' draft
tokens by survival.

What one more token costs depends on the verify pass:

- packed (batch.py: KVRows.packed): a pass costs what it carries, and its masks (and
  attention not split per row) what its widest row carries. Once the policy has
  fitted the two parts at this batch size (policy.PassFit: seconds per token carried and
  per column of the widest row, from the passes it ran), TwoPart tries each width and
  keeps, within it, the tokens likeliest to survive while they raise tokens per second.
  Until then one more token costs m = (t(2) - t(1)) / B seconds, the measured slope of a
  pass at this batch size (Packed): tokens are ranked by survival over all rows and kept
  while the step's expected tokens per second grows, a token of survival s staying while s
  / m beats (B + the kept survivals) / (t(1) + m x the kept tokens). Either way the
  ranking keeps each row's tokens a prefix: survival never grows along a row.
- padded: every row pays for the widest row, a pass over w drafts costs t(w + 1). The step
  takes the width w with the most expected tokens per second, (B + survivals within w) /
  t(w + 1); each row keeps its first w tokens, less a tail that cannot survive
  (NEGLIGIBLE): in a padded pass a token the width already paid for costs nothing more.

Drafting done before the budget is spent is sunk: only the verify pass is weighed here
(the policy weighs drafting when it chooses how much to ask of the drafter), and the host
work a step that verifies drafts adds to a plain one (the accept test over wider logits,
a padded cache's holes to compact, the drafter's update: ``step``, measured by the
policy), paid once by all the step's tokens together. A step where no token clears the bar
keeps none: a plain step.

All of this holds while requests wait for a place: a row that gains ends sooner and the
next request takes its place, so a token is a token of the job sooner. Once none waits the
batch drains, and a token is worth only the time it takes off the rest of the job
(``drain``): a row's share of the passes it no longer joins, and a whole pass's fixed
part where it shortens the longest row's remaining work.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

NEGLIGIBLE = 0.01  # padded: a row's tokens past the point where survival falls below this
# are dropped (its masks, accept test and cache columns are work for nothing)


class VerifyCost(Protocol):
    """How a step's verify pass is priced; ``allot`` spends the budget under that price."""

    step: float  # seconds a step that verifies any draft adds, however many

    @property
    def plain(self) -> float:
        """Seconds of a plain step's pass (one token a row)."""
        ...

    @property
    def token(self) -> float:
        """Seconds one more token adds to a pass, a column it may widen aside."""
        ...

    def allot(self, survivals: list[list[float]]) -> list[int]:
        """Per row, how many of its first draft tokens to verify. ``survivals``: per row,
        the predicted survival of each candidate token, non-increasing along the row."""
        ...

    def extra(self, kept: list[int]) -> float:
        """Seconds a pass verifying ``kept`` draft tokens per row costs beyond a plain
        step's (host work included)."""
        ...


@dataclass
class Padded:
    """A padded verify pass: ``seconds[w]`` is a pass over w drafts per row (and the last
    token) for all ``batch`` rows; a width past the list costs the list's last slope on."""

    seconds: list[float]  # [w]: seconds of a pass over w + 1 tokens per row, w = 0, 1, ...
    batch: int
    step: float = 0.0  # host seconds a drafting step adds (Packed.step)

    @property
    def plain(self) -> float:
        return self.seconds[0]

    @property
    def token(self) -> float:  # a column of every row, a row's share of it
        return max(self.pass_seconds(1) - self.pass_seconds(0), 0.0) / max(self.batch, 1)

    def pass_seconds(self, w: int) -> float:
        s = self.seconds
        if w < len(s):
            return s[w]
        slope = s[-1] - s[-2] if len(s) >= 2 else 0.0
        return s[-1] + max(slope, 0.0) * (w - len(s) + 1)

    def allot(self, survivals: list[list[float]]) -> list[int]:
        widest = max((len(row) for row in survivals), default=0)
        best, best_rate = 0, 0.0
        for w in range(widest + 1):
            tokens = self.batch + sum(sum(row[:w]) for row in survivals)
            seconds = self.pass_seconds(w) + (self.step if w else 0.0)
            if seconds > 0 and tokens / seconds > best_rate:
                best, best_rate = w, tokens / seconds
        return [_alive(row[:best]) for row in survivals]

    def extra(self, kept: list[int]) -> float:
        w = max(kept, default=0)
        return self.pass_seconds(w) - self.pass_seconds(0) + self.step if w else 0.0


@dataclass
class Packed:
    """A packed verify pass: ``plain`` seconds for the batch's one token per row, and
    ``per_token`` seconds for each draft token carried besides; ``step`` seconds of host
    work a step that verifies any draft adds to a plain step's (``affordable``)."""

    plain: float
    per_token: float
    batch: int
    step: float = 0.0

    @classmethod
    def from_widths(cls, seconds: list[float], batch: int, step: float = 0.0) -> Packed:
        """From the padded pass's measured seconds at w = 0 and 1: one more token per row
        (B tokens) costs their difference (Padded.token)."""
        return cls(seconds[0], Padded(seconds, batch).token, batch, step)

    def allot(self, survivals: list[list[float]]) -> list[int]:
        ranked = _ranked(survivals)
        kept = [0] * len(survivals)
        tokens, seconds = float(self.batch), self.plain
        for s, b, j in ranked:
            # kept while it raises tokens per second: s / per_token > tokens / seconds
            if s <= 0 or s * seconds <= self.per_token * tokens:
                break
            if j != kept[b]:  # a row whose survival grew along it: its prefix ends here
                continue
            kept[b] += 1
            tokens += s
            seconds += self.per_token
        return affordable(kept, tokens, seconds + self.step, self.batch / self.plain)

    def extra(self, kept: list[int]) -> float:
        return self.per_token * sum(kept) + self.step if any(kept) else 0.0

    @property
    def token(self) -> float:
        return self.per_token


@dataclass
class TwoPart:
    """A packed verify pass priced in its two parts, as measured (policy.PassFit): ``plain``
    seconds for one token a row, ``per_token`` for each draft token carried, and
    ``per_column`` for each column the widest row adds: every row's mask is as wide, and
    attention not split per row (packed.split) is as wide as the widest row, so a lone
    wide row can cost more than the same tokens spread over many rows (docs/benchmarks.md,
    "where the batch-16 gap is": 0.155 ms a row and column beside 1.7 ms a token at batch 16
    on a CPU, before the split). The fit learns what the pass costs as it runs.

    Each width w is tried: the pass pays for its columns, and within it tokens are kept in
    order of survival while they raise tokens per second; the width with the most tokens
    per second wins (w = 0: a plain pass)."""

    plain: float
    per_token: float
    per_column: float
    batch: int
    step: float = 0.0  # seconds a step that verifies any draft adds, however many: its
    # host work (Packed.step) and its pass's own step at the first draft (PassFit.per_pass)

    def allot(self, survivals: list[list[float]]) -> list[int]:
        ranked = _ranked(survivals)
        best, best_rate = [0] * len(survivals), self.batch / self.plain
        widest = max((len(row) for row in survivals), default=0)
        for w in range(1, widest + 1):
            kept = [0] * len(survivals)
            tokens, carried = float(self.batch), 0
            columns = self.plain + self.per_column * w + self.step
            for s, b, j in ranked:
                if j >= w or j != kept[b]:  # past the width, or a row's prefix ended
                    continue
                if s <= 0 or s * (columns + self.per_token * carried) <= self.per_token * tokens:
                    break
                kept[b] += 1
                tokens += s
                carried += 1
            seconds = (self.plain + self.per_token * carried + self.per_column * max(kept)
                       + self.step)
            if tokens / seconds > best_rate:
                best, best_rate = kept, tokens / seconds
        return best

    def extra(self, kept: list[int]) -> float:
        if not any(kept):
            return 0.0
        return self.per_token * sum(kept) + self.per_column * max(kept) + self.step

    @property
    def token(self) -> float:
        return self.per_token


def drain(cost: VerifyCost, survivals: list[list[float]], remaining: list[int],
          fixed: float, per_row: float) -> list[int]:
    """The budget of a step when no request waits for a place: the batch drains.

    While requests wait, a token a row gains is a token of the job sooner: a row that ends
    early takes the next request (``allot``'s tokens per second). Once none waits the job
    ends with its last row, and a token saves only the time it takes off the rest of the
    job: the row's own share of each pass it no longer joins (``per_row`` seconds, never
    more than a token of the pass costs, ``cost.token``: it rarely pays alone), and, if it
    shortens the longest
    row's remaining work, a pass's fixed part (``fixed``: the weights read, the launches)
    for each step the job no longer runs. ``remaining``: per row, the tokens it may still
    emit (a step emits one anyway; its limit, not its end of sequence, which nobody knows).

    The job's remaining steps shrink by d only if every row within d of the longest
    (``remaining``) gains what it lacks; with survivals independent, the chance is the
    product of their survivals at that depth. Each depth d (0: none) keeps those tokens,
    then any other whose ``per_row`` share beats its price; the allotment that saves the
    most seconds over its price wins (at equal savings the one with more tokens for no
    more seconds: free tokens are kept), else a plain step. On rows that end together (a
    batch of rows run to one limit) a step is saved only when all of them gain: the tail
    of such a job runs plain, where tokens per second drafted on and lost (the chat
    workload at batch 16, docs/benchmarks.md).

    A row in a plain pass is one token of it, so its share is what a token costs the
    pass. The two are measured apart (the share from plain passes at 1 row and at this
    batch size, at the job's context; a token from the ragged passes' fit), and where the
    share came out dearer the token's price stands: at batch 64 on a CPU a share of 2.0 ms
    beside a token's 1.5 paid for any draft of survival above 0.75 alone, and a draining
    batch of 64 verified 224 drafts promised 0.94 in one step; the target took 79, and the
    pass cost three plain ones (docs/benchmarks.md, "a row's share is a token")."""
    per_row = min(per_row, cost.token)
    rows = [row[:max(0, r - 1)] for row, r in zip(survivals, remaining)]  # the last
    # token a row may emit ends it: a draft past it is never kept
    longest = max(remaining, default=0)
    lag = [longest - r for r in remaining]
    ranked = _ranked(rows)

    def variable(kept: list[int]) -> float:  # the pass's price less the step's own
        return cost.extra(kept) - (cost.step if any(kept) else 0.0)

    best, best_net, saved = [0] * len(rows), 0.0, 0.0
    for depth in range(max((len(row) for row in rows), default=0) + 1):
        kept = [max(0, depth - lg) for lg in lag]
        if any(k > len(row) for k, row in zip(kept, rows)):
            break  # a row the depth needs has no such token: no deeper either
        if depth:  # the chance the job runs one step fewer for this depth's tokens
            chance = 1.0
            for row, lg in zip(rows, lag):
                if depth > lg:
                    chance *= row[depth - lg - 1]
            if chance < NEGLIGIBLE:
                break  # deeper, the chance only falls
            saved += chance
        # then others' tokens, likeliest first, each while its row's share beats what it
        # adds to the pass (the step's own cost, paid once, is weighed with the whole)
        price, widest = variable(kept), None  # widest: once a token that widened failed
        for s, b, j in ranked:
            if j != kept[b] or (widest is not None and j >= widest):  # kept already, past
                continue  # the end of its row's prefix, or widening what cannot widen
            kept[b] += 1
            more = variable(kept)
            if s * per_row < more - price:  # (a free token is kept: it costs nothing)
                kept[b] -= 1
                if widest is not None or j < max(kept):
                    break  # within the width every later token costs as much, for less
                widest = max(kept)
                continue
            price = more
        net = (fixed * saved + per_row * sum(sum(row[:k]) for row, k in zip(rows, kept))
               - cost.extra(kept))
        if net > best_net or (net == best_net and sum(kept) > sum(best)
                              and cost.extra(kept) <= cost.extra(best)):  # free tokens
            best, best_net = kept, net
    return best


def gain(cost: VerifyCost, survivals: list[list[float]], kept: list[int]) -> float:
    """What a step verifying ``kept`` draft tokens per row is expected to gain over a plain
    step, as a share of its speed: its rows' tokens, each one and the kept tokens'
    survivals, over its seconds, against a plain step's one token a row (0: a plain step;
    below 0: it costs more than it yields)."""
    batch = len(survivals)
    if not batch or cost.plain <= 0:
        return 0.0
    tokens = batch + sum(sum(row[:k]) for row, k in zip(survivals, kept))
    return tokens / batch * cost.plain / (cost.plain + cost.extra(kept)) - 1.0


def split(plain: float, lone: float, batch: int) -> tuple[float, float]:
    """A plain pass over ``batch`` rows (``plain`` seconds; ``lone``: over one row) in two
    parts: what it costs whatever its rows (the weights read, the launches) and what each
    row adds (``drain``'s ``fixed`` and ``per_row``)."""
    per_row = max(0.0, (plain - lone) / (batch - 1)) if batch > 1 else 0.0
    return max(0.0, lone - per_row), per_row


def _ranked(survivals: list[list[float]]) -> list[tuple[float, int, int]]:
    """All rows' tokens as (survival, row, position), the likeliest first (ties: row
    order, then position, so that a row's tokens come in its own order)."""
    return sorted(((s, b, j) for b, row in enumerate(survivals) for j, s in enumerate(row)),
                  key=lambda t: (-t[0], t[1], t[2]))


def affordable(kept: list[int], tokens: float, seconds: float, plain_rate: float) -> list[int]:
    """``kept`` if its step, host work included, yields more tokens per second than a plain
    step (``plain_rate``); else nothing (a plain step). Each token was kept while it paid for
    itself; the host work is paid once a step, by all of them together."""
    return kept if any(kept) and tokens / seconds > plain_rate else [0] * len(kept)


def _alive(row: list[float]) -> int:
    """The tokens of a row up to the first that cannot survive (NEGLIGIBLE)."""
    return next((j for j, s in enumerate(row) if s < NEGLIGIBLE), len(row))


def chain(factors: list[float]) -> list[float]:
    """Survivals from per-token acceptance: prod_{i <= j} factors[i] for each j."""
    out, p = [], 1.0
    for f in factors:
        p *= f
        out.append(p)
    return out


def verify_cost(seconds: list[float], batch: int, packed: bool, step: float = 0.0) -> VerifyCost:
    """The verify pass's price at this batch size from the cost table's seconds of a padded
    pass over w + 1 tokens per row (w = 0, 1, ...); ``step``: the host seconds a drafting
    step adds. A lone row's packed pass over w + 1 tokens is the table's own pass of that
    width: it is priced by the whole curve, as a padded one, not by its first slope (at
    batch 1 on a CPU a pass of 1-2 tokens took 32 ms, 3 tokens 37, 4 tokens 49: the first
    slope priced a token at 0.7 ms, and the budget verified 4 drafts where 2 paid best)."""
    if packed and batch > 1:
        return Packed.from_widths(seconds, batch, step)
    return Padded(seconds, batch, step)
