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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

NEGLIGIBLE = 0.01  # padded: a row's tokens past the point where survival falls below this
# are dropped (its masks, accept test and cache columns are work for nothing)


class VerifyCost(Protocol):
    """How a step's verify pass is priced; ``allot`` spends the budget under that price."""

    def allot(self, survivals: list[list[float]]) -> list[int]:
        """Per row, how many of its first draft tokens to verify. ``survivals``: per row,
        the predicted survival of each candidate token, non-increasing along the row."""
        ...


@dataclass
class Padded:
    """A padded verify pass: ``seconds[w]`` is a pass over w drafts per row (and the last
    token) for all ``batch`` rows; a width past the list costs the list's last slope on."""

    seconds: list[float]  # [w]: seconds of a pass over w + 1 tokens per row, w = 0, 1, ...
    batch: int
    step: float = 0.0  # host seconds a drafting step adds (Packed.step)

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
        (B tokens) costs their difference."""
        per_token = max(seconds[1] - seconds[0], 0.0) / batch if len(seconds) > 1 else 0.0
        return cls(seconds[0], per_token, batch, step)

    def allot(self, survivals: list[list[float]]) -> list[int]:
        # all rows' tokens, the most likely to survive first (ties: row order, then
        # position, so that each row keeps a prefix)
        ranked = sorted(((s, b, j) for b, row in enumerate(survivals)
                         for j, s in enumerate(row)), key=lambda t: (-t[0], t[1], t[2]))
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
        ranked = sorted(((s, b, j) for b, row in enumerate(survivals)
                         for j, s in enumerate(row)), key=lambda t: (-t[0], t[1], t[2]))
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
