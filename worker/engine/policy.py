"""Choosing the draft length g each step: speculate only where it pays.

Expected tokens per step with g drafts (Leviathan et al. 2023, arXiv 2211.17192, Thm 3.8,
with f the share of rows that propose at all, 1 for a draft model):
    E(g) = 1 + f * (a + a^2 + ... + a^g)
Cost per step, measured: g * t_draft + t_verify(g + 1), where t_verify(n) is a target pass
over n tokens per row (on a CPU, or at large batches, clearly more than t_verify(1)).
Predicted speedup over plain decoding: E(g) * t_verify(1) / (g * t_draft + t_verify(g + 1)).
With c = t_draft / t_verify(1) and t_verify flat this is Thm 3.8's
(1 - a^(g+1)) / ((1 - a)(g c + 1)).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


def expected_tokens(alpha: float, g: int, propose_rate: float = 1.0) -> float:
    """E(g): tokens a step emits when each draft token is accepted with probability alpha."""
    return 1.0 + propose_rate * sum(alpha**i for i in range(1, g + 1))


def theorem_speedup(alpha: float, g: int, c: float) -> float:
    """Leviathan Thm 3.8: (1 - a^(g+1)) / ((1 - a)(g c + 1)), verify cost taken as flat."""
    return expected_tokens(alpha, g) / (g * c + 1.0)


def measured_speedup(alpha: float, g: int, t_draft: float, t_verify_1: float,
                     t_verify_g1: float, propose_rate: float = 1.0) -> float:
    """The same with the measured cost of a verify pass over g + 1 tokens."""
    return expected_tokens(alpha, g, propose_rate) * t_verify_1 / (g * t_draft + t_verify_g1)


class _Decayed:
    """An exponentially decayed mean; with ``clip``, a sample is first capped at clip times
    the mean so far, so one stall (another process, a page fault) cannot swing it."""

    def __init__(self, decay: float, clip: float | None = None) -> None:
        self.decay, self.clip, self.weight, self.total = decay, clip, 0.0, 0.0

    def add(self, value: float, weight: float = 1.0) -> None:
        if self.clip is not None and self.weight >= 2:
            value = min(value, self.clip * self.total / self.weight)
        self.weight = self.weight * self.decay + weight
        self.total = self.total * self.decay + value * weight

    @property
    def mean(self) -> float | None:
        return self.total / self.weight if self.weight > 0 else None


PRIOR_ALPHA = 0.5  # the prior's per-token acceptance, before any draft is judged


@dataclass
class DraftLengthPolicy:
    """Estimates acceptance and costs as the engine runs and picks g to maximise speedup.

    ``adaptive=False`` pins g to ``default``. Costs (a target pass over n tokens per row, a
    draft step) are the hardware's: they are kept per batch size for the engine's life, a
    batch size without its own measurements borrowing those of the nearest one, and
    ``SpeculativeEngine.calibrate`` can measure them before the first request. Acceptance
    is the data's: ``forget_data`` drops it. While g = 0 wins, acceptance cannot be
    observed, so the policy probes with g = default every ``probe_every`` steps (the
    interval doubles each time the probe loses, up to ``max_probe_every``, and resets when
    it wins; an expensive probe, e.g. at a large batch or with a large draft model, is
    spaced further so probes cost at most ``probe_budget`` of the decoding time), unless
    ``idle_acceptance``: a free drafter's proposals are then scored while g = 0. While
    drafting, a plain step comes at least every ``refresh_plain`` steps: a stale plain
    cost (a calibration on a busy machine) would misjudge every g. Timings
    are clipped at 3x their running mean: a stall must not switch speculation off for good.
    """

    default: int = 4
    max_g: int = 8
    adaptive: bool = True
    decay: float = 0.9
    probe_every: int = 16
    max_probe_every: int = 64
    probe_budget: float = 0.02  # probes may cost at most this share of plain decoding time
    idle_acceptance: bool = False  # acceptance is observed while g = 0 too: never probe
    refresh_plain: int = 32  # while drafting, a plain pass at least this often (steps)
    steps: int = 0
    history: list[int] = field(default_factory=list)  # g of each step

    def __post_init__(self) -> None:
        self.max_g = max(self.max_g, self.default)
        self._batch = 1
        self._plain_at: dict[int, int] = {}  # batch size -> step of its latest plain pass
        # batch size -> tokens per row -> seconds per target pass
        self._t_verify: dict[int, dict[int, _Decayed]] = {}
        self._t_draft: dict[int, _Decayed] = {}  # batch size -> seconds per draft token step
        self.forget_data()

    def forget_data(self) -> None:
        """Drop acceptance, steps and history (they describe the data seen); keep costs."""
        # acceptance is a property of the pair and the data: it is tracked more slowly than
        # timings, and while g = 0 only probes update it
        slow = self.decay ** 0.2
        self._accepted = _Decayed(slow)  # alpha's MLE: accepted / (accepted + rejections)
        self._trials = _Decayed(slow)
        self._proposing = _Decayed(slow)  # share of rows that proposed
        # a weak prior (alpha 1/2, every row proposing) that the first steps soon outweigh:
        # one unlucky first observation must not switch speculation off
        self._accepted.add(PRIOR_ALPHA * 2.0)
        self._trials.add(2.0)
        self._proposing.add(1.0)
        self._drafts_seen = 0  # draft tokens judged: the warm-up lasts until a few
        self._since_probe = 0
        self._probe_interval = self.probe_every
        self.steps = 0
        self.history = []
        self._plain_at = {}

    # -- estimates ----------------------------------------------------------------

    @property
    def alpha(self) -> float | None:
        a, t = self._accepted.mean, self._trials.mean
        return None if a is None or not t else min(a / t, 0.999)

    @property
    def propose_rate(self) -> float:
        return self._proposing.mean if self._proposing.mean is not None else 1.0

    @property
    def t_draft(self) -> float | None:
        b = self._costs_batch(self._batch)
        return None if b is None or b not in self._t_draft else self._t_draft[b].mean

    def _costs_batch(self, batch: int) -> int | None:
        """The batch size whose measurements stand for ``batch``: itself once it has a
        plain and a wide target pass (and a draft step), else the nearest such one on a log
        scale, else the nearest with any measurement."""
        def ready(b: int) -> bool:
            widths = self._t_verify.get(b, {})
            return 1 in widths and any(n > 1 for n in widths) and b in self._t_draft

        candidates = [b for b in self._t_verify if ready(b)] or list(self._t_verify)
        if batch in candidates:
            return batch
        return min(candidates, key=lambda b: abs(math.log(b / batch)), default=None)

    def t_verify(self, n: int, batch: int | None = None) -> float | None:
        """Seconds for a target pass over n tokens per row at this batch size (by default
        the last step's), from its own measurements or the nearest batch size's.

        A width measured at least twice (and a plain step, n = 1) is taken as measured,
        and others are interpolated between the nearest such widths (past the widest, the
        slope of the last two goes on): on a CPU the cost is far from a line, 1 -> 2 tokens
        costing more than 2 -> 5. With fewer than two such widths, a weighted least-squares
        line through every width seen stands in, so a single odd sample (a first call, a
        stall) cannot make a g look expensive or cheap.
        """
        b = self._costs_batch(batch or self._batch)
        table = self._t_verify.get(b, {}) if b is not None else {}
        if not table:
            return None
        plain = table[1].mean if 1 in table else None
        solid = sorted((k, d.mean) for k, d in table.items() if k == 1 or d.weight >= 1.5)
        if n in dict(solid):
            return dict(solid)[n]
        if len(solid) >= 2:
            i = next((j for j, (k, _) in enumerate(solid) if k > n), len(solid))
            i = min(max(i, 1), len(solid) - 1)  # the widths either side, else the end two
            (n0, t0), (n1, t1) = solid[i - 1], solid[i]
            fit = t0 + max(0.0, (t1 - t0) / (n1 - n0)) * (n - n0)
        else:
            pts = [(k, d.mean, d.weight) for k, d in table.items()]
            w = sum(p[2] for p in pts)
            n_bar = sum(k * wk for k, _, wk in pts) / w
            t_bar = sum(t * wk for _, t, wk in pts) / w
            var = sum(wk * (k - n_bar) ** 2 for k, _, wk in pts)
            slope = max(0.0, sum(wk * (k - n_bar) * (t - t_bar) for k, t, wk in pts) / var) \
                if var > 0 else 0.0
            fit = t_bar + slope * (n - n_bar)
        return max(fit, plain) if plain is not None else fit

    def predicted(self, g: int, alpha: float | None = None,
                  propose_rate: float | None = None) -> float | None:
        """Predicted speedup of g over plain decoding, from the current estimates (or the
        acceptance given).

        A drafter that proposes for only some rows (prompt lookup) makes a wide verify
        pass only when at least one of the batch's rows proposes: with share f of rows
        proposing, a step costs t_verify(g + 1) with probability 1 - (1 - f)^B, else a
        plain step's t_verify(1).
        """
        if g == 0:
            return 1.0
        a = self.alpha if alpha is None else alpha
        f = self.propose_rate if propose_rate is None else propose_rate
        td, t1, tg = self.t_draft, self.t_verify(1), self.t_verify(g + 1)
        if None in (a, td, t1, tg):
            return None
        wide = 1.0 - (1.0 - f) ** self._batch
        t_step = wide * tg + (1.0 - wide) * t1
        return measured_speedup(a, g, td, t1, t_step, f)

    # -- the choice -----------------------------------------------------------------

    def choose(self, pinned: bool = False, batch: int | None = None) -> int:
        """g for the next step of a batch of this size (by default the last step's);
        ``pinned`` (e.g. seeded sampling in the batch) forces default."""
        if batch:
            self._batch = batch
        if not self.adaptive or pinned or self.default == 0:
            return self.default
        if not self._t_verify:
            return 0  # no cost known at all: measure a plain step
        if self.t_draft is None or all(n == 1 for n in self._t_verify[
                self._costs_batch(self._batch)]):
            return self.default  # measure the draft and a wide verify pass
        scores = {g: self.predicted(g) or 0.0 for g in range(self.max_g + 1)}
        best = max(scores, key=scores.get)
        if best == 0 and self._warming_up():
            return self.default
        if best == 0 and self.idle_acceptance:
            return 0  # acceptance is observed while idle: no probe needed
        if best == 0:
            self._since_probe += 1
            if self._since_probe >= max(self._probe_interval, self._probe_spacing()):
                self._since_probe = 0
                self._probe_interval = min(2 * self._probe_interval, self.max_probe_every)
                # probe at the preset's g: it measures acceptance over several positions
                return self.default
        else:
            self._probe_interval = self.probe_every
        if best and self.steps - self._plain_at.get(self._batch, 0) >= self.refresh_plain:
            return 0  # re-measure the plain pass every speedup is measured against
        return best

    def _warming_up(self) -> bool:
        """The first few draft tokens are judged before acceptance decides, but only when
        the prior (alpha 1/2, every row proposing) says speculation pays at these costs: a
        few unlucky first tokens must not stop a good draft, and a batch where drafting
        cannot pay must not pay for a warm-up."""
        if self._drafts_seen >= 4 or self.steps >= 4:
            return False
        return any((self.predicted(g, PRIOR_ALPHA, 1.0) or 0.0) > 1.0
                   for g in range(1, self.max_g + 1))

    def _probe_spacing(self) -> float:
        """Steps between probes that keep their extra cost within ``probe_budget``: a probe
        at g = default costs g draft steps and a wide verify pass instead of a plain step."""
        t1, tg, td = self.t_verify(1), self.t_verify(self.default + 1), self.t_draft
        if not t1 or tg is None or td is None:
            return 0.0
        extra = (self.default * td + tg) / t1 - 1.0  # in plain steps
        return max(0.0, extra) / self.probe_budget

    def record_costs(self, batch: int, t_verify: dict[int, list[float]],
                     t_draft: list[float] = ()) -> None:
        """Add measured costs at a batch size: target pass seconds by tokens per row, and
        seconds per draft token step."""
        for n, times in t_verify.items():
            for t in times:
                self._t_verify.setdefault(batch, {}).setdefault(
                    n, _Decayed(self.decay, clip=3.0)).add(t)
        for t in t_draft:
            self._t_draft.setdefault(batch, _Decayed(self.decay, clip=3.0)).add(t)

    def observe(self, g: int, num_draft: list[int], num_accepted: list[int],
                t_draft: float, t_verify: float, verify_tokens: int) -> None:
        """Record one step at draft length g: per-row proposals and acceptances, the
        drafting time, and the target pass's time over ``verify_tokens`` tokens per row."""
        self.steps += 1
        self.history.append(g)
        self._batch = len(num_draft)
        if verify_tokens == 1:
            self._plain_at[self._batch] = self.steps
        self.record_costs(self._batch, {verify_tokens: [t_verify]},
                          [t_draft / g] if g else [])
        if g:
            self.observe_acceptance(num_draft, num_accepted)

    def observe_acceptance(self, num_draft: list[int], num_accepted: list[int]) -> None:
        """Record judged proposals, per row: from a drafting step, or a free drafter's
        scored while g = 0 (shadow.py)."""
        if not num_draft:
            return
        proposing = [(n, k) for n, k in zip(num_draft, num_accepted) if n > 0]
        self._drafts_seen += sum(n for n, _ in proposing)
        self._proposing.add(len(proposing) / len(num_draft))
        if proposing:
            accepted = sum(k for _, k in proposing)
            rejections = sum(1 for n, k in proposing if k < n)
            self._accepted.add(accepted)
            self._trials.add(accepted + rejections)

    def snapshot(self) -> dict:
        """The current estimates, for benchmarks and logs."""
        return {
            "alpha": self.alpha,
            "propose_rate": self.propose_rate,
            "t_draft": {b: d.mean for b, d in sorted(self._t_draft.items())},
            "t_verify": {b: {n: d.mean for n, d in sorted(t.items())}
                         for b, t in sorted(self._t_verify.items())},
            "steps": self.steps,
            "g_history": list(self.history),
        }
