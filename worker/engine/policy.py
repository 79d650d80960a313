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


@dataclass
class DraftLengthPolicy:
    """Estimates acceptance and costs as the engine runs and picks g to maximise speedup.

    ``adaptive=False`` pins g to ``default``. While g = 0 wins, acceptance cannot be
    observed, so the policy probes with g = default every ``probe_every`` steps (the
    interval doubles each time the probe loses, up to ``max_probe_every``, and resets when
    it wins; an expensive probe, e.g. with a large draft model, is spaced further so probes
    cost at most ``probe_budget`` of the decoding time). Timings are clipped at 3x their
    running mean: a stall must not switch speculation off for good.
    """

    default: int = 4
    max_g: int = 8
    adaptive: bool = True
    decay: float = 0.9
    probe_every: int = 16
    max_probe_every: int = 64
    probe_budget: float = 0.02  # probes may cost at most this share of plain decoding time
    steps: int = 0
    history: list[int] = field(default_factory=list)  # g of each step

    def __post_init__(self) -> None:
        self.max_g = max(self.max_g, self.default)
        # acceptance is a property of the pair and the data: it is tracked more slowly than
        # timings, and while g = 0 only probes update it
        slow = self.decay ** 0.2
        self._accepted = _Decayed(slow)  # alpha's MLE: accepted / (accepted + rejections)
        self._trials = _Decayed(slow)
        self._proposing = _Decayed(slow)  # share of rows that proposed
        # a weak prior (alpha 1/2, every row proposing) that the first steps soon outweigh:
        # one unlucky first observation must not switch speculation off
        self._accepted.add(1.0)
        self._trials.add(2.0)
        self._proposing.add(1.0)
        self._drafts_seen = 0  # draft tokens judged: the warm-up lasts until a few
        self._batch = 1
        self._t_draft = _Decayed(self.decay, clip=3.0)  # seconds per draft token step
        self._t_verify: dict[int, _Decayed] = {}  # tokens per row -> seconds per pass
        self._since_probe = 0
        self._probe_interval = self.probe_every

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
        return self._t_draft.mean

    def t_verify(self, n: int) -> float | None:
        """Seconds for a target pass over n tokens per row.

        A width measured at least twice (and a plain step, n = 1) is taken as measured;
        others come from a weighted least-squares line through every width measured so
        far, so a single odd sample (a first call, a stall) cannot make a g look expensive
        or cheap.
        """
        pts = [(k, d.mean, d.weight) for k, d in self._t_verify.items() if d.mean is not None]
        if not pts:
            return None
        plain = self._t_verify[1].mean if 1 in self._t_verify else None
        if n in self._t_verify and (n == 1 or self._t_verify[n].weight >= 2):
            return self._t_verify[n].mean
        w = sum(p[2] for p in pts)
        n_bar = sum(k * wk for k, _, wk in pts) / w
        t_bar = sum(t * wk for _, t, wk in pts) / w
        var = sum(wk * (k - n_bar) ** 2 for k, _, wk in pts)
        slope = max(0.0, sum(wk * (k - n_bar) * (t - t_bar) for k, t, wk in pts) / var) \
            if var > 0 else 0.0
        fit = t_bar + slope * (n - n_bar)
        return max(fit, plain) if plain is not None else fit

    def predicted(self, g: int) -> float | None:
        """Predicted speedup of g over plain decoding, from the current estimates.

        A drafter that proposes for only some rows (prompt lookup) makes a wide verify
        pass only when at least one of the batch's rows proposes: with share f of rows
        proposing, a step costs t_verify(g + 1) with probability 1 - (1 - f)^B, else a
        plain step's t_verify(1).
        """
        if g == 0:
            return 1.0
        a, td, t1, tg = self.alpha, self.t_draft, self.t_verify(1), self.t_verify(g + 1)
        if None in (a, td, t1, tg):
            return None
        f = self.propose_rate
        wide = 1.0 - (1.0 - f) ** self._batch
        t_step = wide * tg + (1.0 - wide) * t1
        return measured_speedup(a, g, td, t1, t_step, f)

    # -- the choice -----------------------------------------------------------------

    def choose(self, pinned: bool = False) -> int:
        """g for the next step; ``pinned`` (e.g. seeded sampling in the batch) forces default."""
        if not self.adaptive or pinned or self.default == 0:
            return self.default
        if 1 not in self._t_verify:
            return 0  # warm-up: measure a plain step
        if self.t_draft is None or (self._drafts_seen < 4 and self.steps < 4):
            return self.default  # warm-up: measure acceptance and the draft and verify costs
        scores = {g: self.predicted(g) or 0.0 for g in range(self.max_g + 1)}
        best = max(scores, key=scores.get)
        if best == 0:
            self._since_probe += 1
            if self._since_probe >= max(self._probe_interval, self._probe_spacing()):
                self._since_probe = 0
                self._probe_interval = min(2 * self._probe_interval, self.max_probe_every)
                # probe at the preset's g: it measures acceptance over several positions and
                # the verify cost where speculation would run (on a CPU, 2 tokens can cost
                # more per pass than 5; a line from narrow probes would mislead)
                return self.default
        else:
            self._probe_interval = self.probe_every
        return best

    def _probe_spacing(self) -> float:
        """Steps between probes that keep their extra cost within ``probe_budget``: a probe
        at g = default costs g draft steps and a wide verify pass instead of a plain step."""
        t1, tg, td = self.t_verify(1), self.t_verify(self.default + 1), self.t_draft
        if not t1 or tg is None or td is None:
            return 0.0
        extra = (self.default * td + tg) / t1 - 1.0  # in plain steps
        return max(0.0, extra) / self.probe_budget

    def observe(self, g: int, num_draft: list[int], num_accepted: list[int],
                t_draft: float, t_verify: float, verify_tokens: int) -> None:
        """Record one step at draft length g: per-row proposals and acceptances, the
        drafting time, and the target pass's time over ``verify_tokens`` tokens per row."""
        self.steps += 1
        self.history.append(g)
        self._t_verify.setdefault(verify_tokens, _Decayed(self.decay, clip=3.0)).add(t_verify)
        self._batch = len(num_draft)
        if g == 0:
            return
        self._t_draft.add(t_draft / g)
        proposing = [(n, k) for n, k in zip(num_draft, num_accepted) if n > 0]
        self._drafts_seen += sum(n for n, _ in proposing)
        self._proposing.add(len(proposing) / max(1, len(num_draft)))
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
            "t_draft": self.t_draft,
            "t_verify": {n: d.mean for n, d in sorted(self._t_verify.items())},
            "steps": self.steps,
            "g_history": list(self.history),
        }
