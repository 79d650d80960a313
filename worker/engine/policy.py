"""Choosing the draft length g each step: speculate only where it pays.

Expected tokens per step with g drafts (Leviathan et al. 2023, arXiv 2211.17192, Thm 3.8,
with f the share of rows that propose at all, 1 for a draft model):
    E(g) = 1 + f * (a + a^2 + ... + a^g)
Cost per step, measured: g * t_draft + t_verify(g + 1), where t_verify(n) is a target pass
over n tokens per row (on a CPU, or at large batches, clearly more than t_verify(1)).
Predicted speedup over plain decoding: E(g) * t_verify(1) / (g * t_draft + t_verify(g + 1)).
With c = t_draft / t_verify(1) and t_verify flat this is Thm 3.8's
(1 - a^(g+1)) / ((1 - a)(g c + 1)).

The policy holds two estimates: a cost table (the hardware's: seconds of a target pass
over n tokens per row and of a draft token, per batch size) and an acceptance estimate
(the data's: alpha and f). Each step it takes the g that maximises the predicted speedup.

A drafter that scores its own drafts (suffix.py: each token's smoothed share of the
earlier continuations) lets the policy do better than one alpha for all: it proposes at
max_g, a Calibration maps each token's confidence to the acceptance the target has shown
at that confidence, q, and the step's budget keeps what pays of these very drafts. A step
of sure drafts goes wide, a step of guesses goes plain: per step, not per job.

What g asks of the drafter is its work; what the step verifies is a budget (``allot``,
budget.py): each row's candidate tokens are ranked by predicted survival (the chain
product of q, of alpha for a drafter without scores, of 1 for a grammar's forced tokens)
and kept while they beat the measured cost of verifying one more token at this batch size.
A step chosen to measure (a probe, a first wide pass, a plain refresh) is verified whole.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

from specq.worker.engine import budget

log = logging.getLogger(__name__)

# Each constant exists for one reason.
COST_DECAY = 0.9  # weight of a cost sample against the next one: costs follow the machine's load
ACCEPTANCE_DECAY = 0.98  # slower: acceptance belongs to the pair and the data, not to the load
TRUSTED = 1.5  # a cost's weight once measured twice: one sample may be a first call or a stall
FAST = 0.5  # a full pass under this share of a trusted mean replaces it: a machine can be
# slowed by others, never sped up, so the mean came from a busier spell (a cached calibration)
STALL_CLIP = 3.0  # a sample's cap in trusted means: one stall must not stop speculation for good
PRIOR_ALPHA, PRIOR_TRIALS = 0.5, 2.0  # weak: one unlucky first step must not stop speculation
BORROWED_AFTER = 4.0  # a batch size's plain passes (decayed weight, about 5 passes) after
# which it measures its own wide pass rather than borrow a far batch size's (far_stand_in)
BORROW_RATIO = 2.0  # a ready batch size within this factor stands in well enough
PROBE_BUDGET = 0.02  # share of decoding time probes may cost while g = 0 wins (acceptance unseen)
PROBE_GAP = 32  # steps between probes at least: a draft useful again is found within this many
PROBE_HOPE = 1.1  # a scored drafter is probed only while it could pay this speedup (Shadowed)
PROBE_SURVIVAL = 0.5  # a scored drafter is probed only while a first draft token is this likely
PLAIN_REFRESH = 32  # a plain step at least this often: every g is judged against its cost
HISTORY = 1024  # g of the latest steps kept, for benchmarks and logs (a worker runs for days)
CONFIDENCE_BINS = 10  # a drafter's confidence in [0, 1] is judged in this many equal bins
CONFIDENCE_DECAY = 0.99  # per verdict in a bin: acceptance at a confidence follows the job
CONFIDENCE_PRIOR = 2.0  # verdicts a bin starts with: the drafter taken at its word at first
HINDSIGHT_DECAY = 0.98  # per row's verdicts: the calibration's own record follows the job
HINDSIGHT_PRIOR = 4.0  # judged tokens the record starts with, as predicted
HINDSIGHT_FLOOR = 0.5  # the most the record scales a calibrated acceptance down
FIT_DECAY = 0.98  # a pass's weight against the next in PassFit: a line wants more points
FIT_READY = 8.0  # ragged passes (decayed by each other) before PassFit prices the budget


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
    """An exponentially decayed mean; with ``clip`` (a cost), once the mean is trusted a
    sample is first capped at clip times the mean so far, and a ``fresh`` one (a pass as
    wide for every row as the mean's) under FAST times it starts the mean afresh."""

    def __init__(self, decay: float, clip: float | None = None) -> None:
        self.decay, self.clip, self.weight, self.total = decay, clip, 0.0, 0.0

    def add(self, value: float, weight: float = 1.0, fresh: bool = False) -> None:
        if self.clip is not None and self.weight >= TRUSTED:
            mean = self.total / self.weight
            value = min(value, self.clip * mean)
            if fresh and value < FAST * mean:
                self.weight = self.total = 0.0
        self.weight = self.weight * self.decay + weight
        self.total = self.total * self.decay + value * weight

    @property
    def mean(self) -> float:
        """Only once a value was added (each one made is added to at once)."""
        return self.total / self.weight


class PassFit:
    """A packed verify pass's seconds at one batch size B as plain + per_pass (any draft
    carried) + per_token x draft tokens carried + per_column x (the widest row's tokens -
    1), by least squares over the passes measured.

    per_pass is the step in a pass's cost at its first draft: on a CPU the GEMMs of 16 rows
    take a 17th at the cost of about six more, flat to 22, then about a token's each
    (docs/benchmarks.md, "the first draft token"); a pass that drafts at all should carry
    enough to pay for it.

    Two kinds of passes teach it. Calibration's (``calibrated``: full widths, a lone wide
    row, a few wide rows, half the rows one draft) show the pass's shape at every extreme,
    each the fastest of its repeats, and stay in the fit undecayed; the steps' passes, each
    decayed (FIT_DECAY) and capped at STALL_CLIP times what the fit predicted for it, move
    it from there. Each kind has a plain pass of its own (calibration's context is short,
    its machine maybe less busy): calibration says what a draft costs beside its plain
    pass, the steps say what a plain pass costs now. Without calibration's shapes a few
    noisy passes of the shapes the budget picks could price one it never picks (a lone row
    of 8 sure drafts) at three times its cost, and it never would.

    Passes in which every row carries as many tokens cannot tell a token from a column, B
    tokens coming with each column: the fit prices nothing (None) until FIT_READY ragged
    passes came (calibration's count with their weight). CostTable keeps a fit only where
    calibration timed its passes, or near there with them (CostTable.pass_fit says why)."""

    # the normal equations' terms: plain (the steps'), plain (calibration's), per_pass,
    # per_token, per_column
    TERMS = 5

    def __init__(self, batch: int, origin: int | None = None) -> None:
        n = self.TERMS
        self.batch = batch
        self.origin = batch if origin is None else origin  # the batch size calibration
        # timed the passes at (a fit moved from there keeps it: CostTable._moved_here)
        self.xtx = [[0.0] * n for _ in range(n)]  # the steps' passes, decayed
        self.xty = [0.0] * n
        self.prior_xtx = [[0.0] * n for _ in range(n)]  # calibration's, kept
        self.prior_xty = [0.0] * n
        self.ragged = 0.0
        self._fit: tuple[float, float, float, float] | None = None  # solved once a pass

    def add(self, carried: int, width: int, seconds: float, weight: float = 1.0,
            calibrated: bool = False) -> None:
        """A pass that carried ``carried`` draft tokens, its widest row ``width`` tokens;
        ``calibrated``: one of calibration's, kept undecayed with ``weight``."""
        x = (0.0 if calibrated else 1.0, 1.0 if calibrated else 0.0, float(carried > 0),
             float(carried), float(width - 1))
        if self._fit is not None and not calibrated:
            seconds = min(seconds, STALL_CLIP * self.predict(carried, width))
        decay = 1.0 if calibrated else FIT_DECAY
        xtx, xty = (self.prior_xtx, self.prior_xty) if calibrated else (self.xtx, self.xty)
        for i in range(self.TERMS):
            xty[i] = xty[i] * decay + weight * x[i] * seconds
            for k in range(self.TERMS):
                xtx[i][k] = xtx[i][k] * decay + weight * x[i] * x[k]
        if carried != self.batch * (width - 1):  # plain and full passes leave it: a fit
            # once ready stays so through a plain spell (else the budget fell back on the
            # cheap one-slope price exactly then, and drafted what the fit had refused)
            self.ragged = self.ragged * decay + weight
        self._fit = self._solve()

    def predict(self, carried: int, width: int) -> float:
        """Seconds of such a pass by the fit (solve() must not be None)."""
        assert self._fit is not None
        plain, per_pass, per_token, per_column = self._fit
        return plain + per_pass * (carried > 0) + per_token * carried + per_column * (width - 1)

    @property
    def calibrated(self) -> bool:
        """Calibration's passes are in it (CostTable keeps no fit of the steps' alone)."""
        return self.prior_xtx[1][1] > 0

    def solve(self) -> tuple[float, float, float, float] | None:
        """(plain, per_pass, per_token, per_column) seconds, or None (too few ragged passes,
        or a fit that says a plain pass costs nothing). Negative terms are noise: taken as
        0. The plain pass is the steps' own once they ran one, else calibration's."""
        return self._fit

    def state(self) -> dict[str, Any]:
        return {"xtx": self.xtx, "xty": self.xty, "prior_xtx": self.prior_xtx,
                "prior_xty": self.prior_xty, "ragged": self.ragged, "origin": self.origin}

    def moved(self, batch: int, shift: float) -> PassFit:
        """This fit's passes as a fit at another batch size, to be refined by its own steps:
        every pass ``shift`` seconds dearer (the plain passes' difference) and each column
        of the widest row priced in proportion to the rows (``CostTable.pass_fit``'s
        borrowed price, which the moved fit gives before a pass of its own is added)."""
        fit = PassFit(batch, self.origin)
        # the column feature divided by the rows' ratio prices a column that many times as
        # dear; each pass's seconds plus the shift: xty gains shift x sum(x), xtx[.][plain]
        scale = [self.batch / batch if i == 4 else 1.0 for i in range(self.TERMS)]
        for xtx, xty, plain, out_xtx, out_xty in (
                (self.xtx, self.xty, 0, fit.xtx, fit.xty),
                (self.prior_xtx, self.prior_xty, 1, fit.prior_xtx, fit.prior_xty)):
            for i in range(self.TERMS):
                out_xty[i] = (xty[i] + shift * xtx[i][plain]) * scale[i]
                for k in range(self.TERMS):
                    out_xtx[i][k] = xtx[i][k] * scale[i] * scale[k]
        fit.ragged = self.ragged
        # and a plain pass of the steps' at this batch size: without one the steps' plain
        # term, free, took the dearer drafting passes' excess whole, and the fit priced
        # the plain pass at 96 ms beside its measured 74-82 (a plain pass looked dear,
        # drafts cheap)
        fit.add(0, 1, self.predict(0, 1) + shift)
        return fit

    @classmethod
    def from_state(cls, batch: int, state: dict[str, Any], max_weight: float) -> PassFit:
        """A fit from state(), the steps' passes weighted down to ``max_weight`` passes'
        worth (a start that this run's passes soon outweigh), calibration's kept."""
        fit = cls(batch, int(state.get("origin", batch)))
        total = float(state["xtx"][0][0])  # the steps' passes' decayed weight
        scale = min(1.0, max_weight / total) if total > 0 else 1.0
        fit.xtx = [[float(v) * scale for v in row] for row in state["xtx"]]
        fit.xty = [float(v) * scale for v in state["xty"]]
        fit.prior_xtx = [[float(v) for v in row] for row in state["prior_xtx"]]
        fit.prior_xty = [float(v) for v in state["prior_xty"]]
        fit.ragged = float(state["ragged"])
        fit._fit = fit._solve()
        return fit

    def _solve(self) -> tuple[float, float, float, float] | None:
        if self.ragged < FIT_READY:
            return None
        a = [[u + v for u, v in zip(r, p)] for r, p in zip(self.xtx, self.prior_xtx)]
        y = [u + v for u, v in zip(self.xty, self.prior_xty)]
        # a kind of pass not seen yet has no plain pass of its own: left out; so is the
        # first draft's step where no plain pass tells it from the plain pass
        used = [i for i in range(self.TERMS) if a[i][i] > 0]
        coef = _solve([[a[i][k] for k in used] for i in used], [y[i] for i in used])
        if coef is None and 2 in used:
            used.remove(2)
            coef = _solve([[a[i][k] for k in used] for i in used], [y[i] for i in used])
        if coef is None:
            return None
        full = dict(zip(used, coef))
        plain = full.get(0, full.get(1, 0.0))
        if plain <= 0 or not {3, 4} <= set(full):
            return None
        return plain, max(full.get(2, 0.0), 0.0), max(full[3], 0.0), max(full[4], 0.0)


def _solve(a: list[list[float]], y: list[float]) -> list[float] | None:
    """x with a x = y (Gaussian elimination, partial pivoting); None if a is singular."""
    n = len(y)
    m = [row[:] + [v] for row, v in zip(a, y)]
    scale = max((abs(v) for row in a for v in row), default=0.0) or 1.0
    for c in range(n):
        p = max(range(c, n), key=lambda r: abs(m[r][c]))
        if abs(m[p][c]) <= 1e-12 * scale:
            return None
        m[c], m[p] = m[p], m[c]
        for r in range(c + 1, n):
            f = m[r][c] / m[c][c]
            for k in range(c, n + 1):
                m[r][k] -= f * m[c][k]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (m[r][n] - sum(m[r][k] * x[k] for k in range(r + 1, n))) / m[r][r]
    return x


class CostTable:
    """Seconds of a target pass over n tokens per row, and of a draft token, per batch size.

    The hardware's: kept for the engine's life. A batch size without its own measurements
    takes them from the line between the nearest measured ones either side, or from the
    nearest one on a log scale.
    """

    def __init__(self) -> None:
        self.verify: dict[int, dict[int, _Decayed]] = {}  # batch -> tokens per row -> s
        self.draft: dict[int, _Decayed] = {}  # batch -> seconds per draft token
        self.passes: dict[int, PassFit] = {}  # batch -> packed passes, in two parts
        # batch -> a step's host seconds past its drafting and its pass (accept test, cache
        # upkeep), of plain steps (False) and of steps that verified drafts (True)
        self.host: dict[int, dict[bool, _Decayed]] = {}

    def add(self, batch: int, t_verify: dict[int, list[float]],
            t_draft: Iterable[float] = (), carried: int | None = None,
            calibrated: bool = False) -> None:
        """Passes over n tokens per row (the widest row's) and draft token steps measured
        at this batch size. ``carried``: the draft tokens a ragged pass carried in all (one
        pass in ``t_verify``); None: every row carried n tokens. ``calibrated``:
        calibration's passes (PassFit keeps them apart)."""
        for n, times in t_verify.items():
            drafts = batch * (n - 1) if carried is None else carried
            for t in times:  # a full pass may show the mean was taken on a busier machine
                self.verify.setdefault(batch, {}).setdefault(
                    n, _Decayed(COST_DECAY, STALL_CLIP)).add(t, fresh=drafts == batch * (n - 1))
                fit = (self.passes.setdefault(batch, PassFit(batch)) if calibrated
                       else self.passes.get(batch) or self._moved_here(batch))
                if fit is not None:
                    fit.add(drafts, n, t, calibrated=calibrated)
        for t in t_draft:
            self.draft.setdefault(batch, _Decayed(COST_DECAY, STALL_CLIP)).add(t)

    def add_shape(self, batch: int, carried: int, width: int, seconds: float,
                  weight: float) -> None:
        """One of calibration's ragged passes, for the pass's two-part price only (the
        table by width holds passes as wide for every row)."""
        self.passes.setdefault(batch, PassFit(batch)).add(carried, width, seconds, weight,
                                                          calibrated=True)

    def add_host(self, batch: int, drafted: bool, seconds: float) -> None:
        """A step's host seconds past its drafting and its target pass."""
        self.host.setdefault(batch, {}).setdefault(
            drafted, _Decayed(COST_DECAY, STALL_CLIP)).add(seconds)

    def drafting_step(self, batch: int) -> float:
        """Host seconds a step that verifies drafts costs beyond a plain step's at this batch
        size (0 until both kinds were measured there)."""
        host = self.host.get(batch, {})
        if len(host) < 2:
            return 0.0
        return max(0.0, host[True].mean - host[False].mean)

    def pass_fit(self, batch: int) -> tuple[float, float, float, float] | None:
        """A packed pass at this batch size (PassFit.solve: plain, per_pass, per_token,
        per_column), or None. A batch size calibration timed ragged passes at has a fit of
        its own (the steps refine it); another borrows the nearest one's within
        BORROW_RATIO (rows end and the batch shrinks mid-job): its plain pass is this batch
        size's own, a drafting pass's step and a token cost as much, and a column of the
        widest row costs in proportion to the rows (every row's mask and attention is as
        wide), till its first step moves that fit here for its steps to refine
        (``_moved_here``). A fit of the steps' passes alone, at a job's tail, was noise
        that fed itself: priced too dear, drafts were refused, and no drafting pass came to
        mend it; kept in the calibration cache, it grew from run to run (the demo's batch 2
        put a pass's first draft at 17 ms, then 18, 93 and 112 beside a 55-70 ms plain
        pass, five runs in a row, and verified 23 drafts there, then 4, 0, 0, 0)."""
        fit = self.passes.get(batch)
        own = None if fit is None else fit.solve()
        if own is not None:
            return own
        near = self._nearest(batch)
        own_plain = self.verify.get(batch, {}).get(1)
        plain = own_plain.mean if own_plain is not None else self.verify_seconds(1, batch)
        if near is None or plain is None:
            return None
        b, _, (_, per_pass, per_token, per_column) = near
        return plain, per_pass, per_token, per_column * batch / b

    def _moved_here(self, batch: int) -> PassFit | None:
        """A fit of this batch size's own, made from the one it borrows (``pass_fit``) for
        its steps to refine, or None where it borrows none. Calibration times ragged passes
        at a few batch sizes only (1, 16, 256 and the largest), and a job's rows end one by
        one: a batch of 24 rows priced a draft token at batch 16's 1.3 ms, not its own 2-3
        ms, kept what did not pay, and ran at 0.88x no speculation (docs/benchmarks.md, "a
        borrowed price learns"). A fit moved from a moved one carries what the steps
        taught it down a job's tail."""
        near = self._nearest(batch)
        plain = None if near is None else self.verify_seconds(1, batch)
        if near is None or plain is None:
            return None
        _, source, (source_plain, *_) = near
        self.passes[batch] = moved = source.moved(batch, plain - source_plain)
        return moved

    def _nearest(self, batch: int
                 ) -> tuple[int, PassFit, tuple[float, float, float, float]] | None:
        """The fit a batch size borrows, (its batch size, it, its price), or None: the
        nearest of those from a batch size calibration timed within BORROW_RATIO of it (a
        fit moved down a job's tail carries a price no farther than its origin's)."""
        near = [(b, p, f) for b, p in self.passes.items() if (f := p.solve()) is not None
                and abs(math.log(p.origin / batch)) <= math.log(BORROW_RATIO)]
        return min(near, key=lambda n: abs(math.log(n[0] / batch)), default=None)

    def state(self) -> dict[str, Any]:
        """The table as JSON (a calibration cache keeps it between processes): per batch
        size, per width, the decayed mean's [weight, total]; the draft token's; and the
        packed pass's fit (PassFit.state)."""
        return {"verify": {str(b): {str(n): [d.weight, d.total] for n, d in t.items()}
                           for b, t in self.verify.items()},
                "draft": {str(b): [d.weight, d.total] for b, d in self.draft.items()},
                "passes": {str(b): p.state() for b, p in self.passes.items()}}

    @classmethod
    def from_state(cls, state: dict[str, Any], max_weight: float) -> CostTable:
        """A table from state(), each mean's weight capped at ``max_weight``: costs kept from
        an earlier run are a start that the steps of this one soon outweigh."""
        def decayed(weight: float, total: float) -> _Decayed:
            d = _Decayed(COST_DECAY, STALL_CLIP)
            w = min(float(weight), max_weight)
            d.weight, d.total = w, float(total) * w / float(weight)
            return d

        table = cls()
        for b, widths in state["verify"].items():
            table.verify[int(b)] = {int(n): decayed(*wt) for n, wt in widths.items()}
        table.draft = {int(b): decayed(*wt) for b, wt in state["draft"].items()}
        fits = (PassFit.from_state(int(b), p, max_weight)
                for b, p in state.get("passes", {}).items())
        table.passes = {f.batch: f for f in fits if f.calibrated}  # (a table kept before
        # fits were calibration's only may hold the steps' own: see pass_fit)
        return table

    def ready(self, batch: int) -> bool:
        """A plain pass, a wide pass and a draft step are measured at this batch size."""
        widths = self.verify.get(batch, {})
        return 1 in widths and max(widths) > 1 and batch in self.draft

    def stand_in(self, batch: int) -> int | None:
        """The batch size whose costs stand for ``batch``: itself once ready, else the
        nearest ready one, else the nearest with any measurement."""
        candidates = [b for b in self.verify if self.ready(b)] or list(self.verify)
        if batch in candidates:
            return batch
        return min(candidates, key=lambda b: abs(math.log(b / batch)), default=None)

    def far_stand_in(self, batch: int) -> int | None:
        """The far batch size whose costs ``batch`` runs on, though the engine keeps running
        at it (BORROWED_AFTER plain passes' weight measured here, no wider pass), or None.
        Far: no ready batch size either side of it (``_across`` draws no line) and none
        within BORROW_RATIO of it. Far costs price a draft against the other batch size's
        plain pass: a cached table whose only ready size was batch 1 put batch 16's plain
        pass at 57 ms, not its own 140; no draft paid, none was verified, batch 16 never
        measured a wide pass, and the demo never drafted again (DraftLengthPolicy.choose
        measures such a batch size's own costs)."""
        own = self.verify.get(batch, {})
        if not (1 in own and max(own) == 1 and own[1].weight >= BORROWED_AFTER):
            return None
        ready = [r for r in self.verify if self.ready(r)]
        between = any(r < batch for r in ready) and any(r > batch for r in ready)
        if between or any(abs(math.log(r / batch)) <= math.log(BORROW_RATIO) for r in ready):
            return None
        return self.stand_in(batch)

    def draft_seconds(self, batch: int) -> float | None:
        return self._across(batch, lambda b: self.draft[b].mean if b in self.draft else None)

    def verify_seconds(self, n: int, batch: int) -> float | None:
        """A target pass over n tokens per row at this batch size (see _across)."""
        return self._across(batch, lambda b: self._verify_at(n, b))

    def _across(self, batch: int, cost: Callable[[int], float | None]) -> float | None:
        """A cost at this batch size: its own once ready; else on the line between the
        nearest ready batch sizes either side (calibration measures only a few, and a
        step's cost is close to a line in the batch size between them); else the stand-in's.
        """
        ready = sorted(b for b in self.verify if self.ready(b))
        below = [b for b in ready if b < batch][-1:]
        above = [b for b in ready if b > batch][:1]
        if batch in ready or not (below and above):
            b = self.stand_in(batch)
            return None if b is None else cost(b)
        (b0,), (b1,) = below, above
        t0, t1 = cost(b0), cost(b1)
        if t0 is None or t1 is None:
            return None
        return t0 + (t1 - t0) * (batch - b0) / (b1 - b0)

    def _verify_at(self, n: int, b: int) -> float | None:
        """A target pass over n tokens per row at batch size b, from b's own measurements.

        Trusted widths (a plain pass, n = 1, at once; others once measured twice) are
        taken as measured, and others interpolated between the nearest two (past either
        end, the end two's slope goes on, never downwards): on a CPU the cost is far from
        one line, 1 -> 2 tokens costing more than 2 -> 5. With fewer than two trusted
        widths, every width measured stands in. Never below a plain pass.
        """
        table = self.verify.get(b, {})
        if not table:
            return None
        points = sorted((k, d.mean) for k, d in table.items() if k == 1 or d.weight >= TRUSTED)
        if len(points) < 2:
            points = sorted((k, d.mean) for k, d in table.items())
        if n in dict(points):
            return dict(points)[n]
        fit = points[0][1]
        if len(points) >= 2:
            i = next((j for j, (k, _) in enumerate(points) if k > n), len(points))
            i = min(max(i, 1), len(points) - 1)  # the widths either side, else the end two
            (n0, t0), (n1, t1) = points[i - 1], points[i]
            fit = t0 + max(0.0, (t1 - t0) / (n1 - n0)) * (n - n0)
        return max(fit, table[1].mean) if 1 in table else fit


class Acceptance:
    """alpha, the per-token acceptance probability, as accepted / (accepted + rejections)
    (a rejection: a row that did not accept all it proposed), and f, the share of rows
    that propose at all (prompt lookup finds nothing to copy in some); both decayed, and
    starting from the prior (alpha ``prior``, PRIOR_TRIALS trials)."""

    def __init__(self, prior: float = PRIOR_ALPHA) -> None:
        self._accepted = _Decayed(ACCEPTANCE_DECAY)
        self._trials = _Decayed(ACCEPTANCE_DECAY)
        self._proposing = _Decayed(ACCEPTANCE_DECAY)
        self._accepted.add(prior * PRIOR_TRIALS)
        self._trials.add(PRIOR_TRIALS)
        self._proposing.add(1.0)

    def add(self, num_draft: list[int], num_accepted: list[int]) -> None:
        """Judged proposals, per row."""
        if not num_draft:
            return
        proposing = [(n, k) for n, k in zip(num_draft, num_accepted) if n > 0]
        self._proposing.add(len(proposing) / len(num_draft))
        if proposing:
            accepted = sum(k for _, k in proposing)
            self._accepted.add(accepted)
            self._trials.add(accepted + sum(1 for n, k in proposing if k < n))

    @property
    def alpha(self) -> float:
        return min(self._accepted.total / self._trials.total, 0.999)

    @property
    def propose_rate(self) -> float:
        return self._proposing.mean


class Calibration:
    """What a drafter's confidence in a draft token is worth: per confidence bin, the share
    of tokens the target accepted, of those it judged (the tokens before them accepted).

    A drafter's confidence ranks its drafts better than it scales them: an n-gram seen
    once after a JSON key is right far more often than one seen once in free text. The
    target's verdicts rescale it, bin by bin, decayed (CONFIDENCE_DECAY).

    The bins are also checked out of sample: each verdict is weighed against what the bins
    predicted before they learnt from it (``hindsight``). A bin of few verdicts predicts
    what its prior and its luck say, and the budget keeps exactly the tokens whose bins
    promise most: on open questions at batch 16 its 2-token drafts were kept at a promised
    0.7 and the target took half of them (docs/benchmarks.md, "in hindsight"). While the
    bins' predictions run above the verdicts, every calibrated acceptance is scaled down by
    their ratio (never below HINDSIGHT_FLOOR of it); never up: a bin that predicts too
    little learns it in its own verdicts.
    """

    def __init__(self) -> None:
        self.accepted = [CONFIDENCE_PRIOR * (i + 0.5) / CONFIDENCE_BINS
                         for i in range(CONFIDENCE_BINS)]
        self.judged = [CONFIDENCE_PRIOR] * CONFIDENCE_BINS
        # judged tokens' acceptance as the bins predicted it, and as the target gave it
        self.predicted = self.realized = HINDSIGHT_PRIOR

    @staticmethod
    def _bin(confidence: float) -> int:
        return min(max(int(confidence * CONFIDENCE_BINS), 0), CONFIDENCE_BINS - 1)

    def _rate(self, confidence: float) -> float:
        i = self._bin(confidence)
        return self.accepted[i] / self.judged[i]

    @property
    def hindsight(self) -> float:
        """The verdicts over the bins' predictions of them, in [HINDSIGHT_FLOOR, 1] (1 once
        both decayed to nothing: bins whose every rate decayed to 0 predict no verdict)."""
        if self.predicted <= 0.0:
            return 1.0
        return min(max(self.realized / self.predicted, HINDSIGHT_FLOOR), 1.0)

    def __call__(self, confidence: float) -> float:
        """Probability that a token of this confidence is accepted, given those before it."""
        return self._rate(confidence) * self.hindsight

    def add(self, confidence: list[float], accepted: int) -> None:
        """A row's verdicts: the confidences of the draft tokens the target judged, in
        order, of which it accepted the first ``accepted`` (the next one, if any, it
        rejected)."""
        judged = confidence[: accepted + 1]
        self.predicted = (self.predicted * HINDSIGHT_DECAY
                          + sum(self._rate(c) for c in judged))
        self.realized = self.realized * HINDSIGHT_DECAY + min(accepted, len(judged))
        for j, c in enumerate(judged):
            i = self._bin(c)
            self.judged[i] = self.judged[i] * CONFIDENCE_DECAY + 1.0
            self.accepted[i] = self.accepted[i] * CONFIDENCE_DECAY + float(j < accepted)

    def snapshot(self) -> list[float]:
        return [a / n for a, n in zip(self.accepted, self.judged)]


class DraftLengthPolicy:
    """Picks g each step from the cost table and the acceptance estimate.

    The estimates and the rules every adaptive choice keeps are here; the regimes are the
    subclasses below, each a small class: Shadowed (a free drafter scored while g = 0, no
    probes), Widths (a drafter that scores its own tokens: the width that pays for these
    very drafts), Pinned (g fixed; with g = 0 the null object of a pair that never drafts).
    This class itself is the plain regime: the g with the best predicted speedup, and while
    g = 0 wins drafting steps no longer show acceptance, so it probes at g = default now and
    then (PROBE_BUDGET, PROBE_GAP). Costs can be measured before the first request
    (calibration.py).
    """

    adapts = True  # g follows the estimates (calibration measures costs only for these)
    prior_alpha = PRIOR_ALPHA  # the acceptance a generation starts from

    def __init__(self, default: int = 4, max_g: int = 8) -> None:
        self.default = default
        self.max_g = max(max_g, default)
        self.costs = CostTable()
        self._batch = 1  # batch size of the latest step
        self._measured_here: set[int] = set()  # batch sizes that measured off a far one's costs
        self.packed = False  # the verify pass costs the tokens it carries (Drafting sets it)
        self.forget_data()

    def forget_data(self) -> None:
        """Drop acceptance, steps and history (they describe the data seen); keep costs."""
        self.acceptance = Acceptance(self.prior_alpha)
        self.lookup = Acceptance(PRIOR_ALPHA)  # a text lookup's tokens (grammar.py: text)
        self.quoted = Acceptance(PRIOR_ALPHA)  # closing quotes guessed (grammar.py: chain)
        self.calibration = Calibration()
        self.steps = 0
        self.history: deque[int] = deque(maxlen=HISTORY)  # g of each step
        self._plain_at: dict[int, int] = {}  # batch size -> step of its latest plain pass
        self._drafted_at = 0  # step of the latest drafting step
        self.measuring = True  # the latest choice measures: its step is verified whole
        # the latest allotment's expected gain over a plain step (budget.gain; 0: nothing
        # to verify, None: kept whole, unpriced: a measuring step, or costs unknown)
        self.gain: float | None = None

    # -- estimates ----------------------------------------------------------------

    @property
    def alpha(self) -> float:
        return self.acceptance.alpha

    @property
    def propose_rate(self) -> float:
        return self.acceptance.propose_rate

    @property
    def t_draft(self) -> float | None:
        return self.costs.draft_seconds(self._batch)

    def t_verify(self, n: int, batch: int | None = None) -> float | None:
        """Seconds of a target pass over n tokens per row at this batch size (by default
        the latest step's)."""
        return self.costs.verify_seconds(n, batch or self._batch)

    def predicted(self, g: int) -> float | None:
        """Predicted speedup of g over plain decoding.

        A drafter that proposes for only some rows (prompt lookup), share f of them: a
        packed pass carries only their drafts, so it costs t_verify(1) + f (t_verify(g + 1)
        - t_verify(1)); a padded one is wide whenever one of the B rows proposes, with
        probability 1 - (1 - f)^B, and costs t_verify(g + 1) then, else t_verify(1).
        """
        if g == 0:
            return 1.0
        a, f = self.alpha, self.propose_rate
        td, t1, tg = self.t_draft, self.t_verify(1), self.t_verify(g + 1)
        if td is None or t1 is None or tg is None:
            return None
        if self.packed:
            return measured_speedup(a, g, td, t1, t1 + f * (tg - t1), f)
        wide = 1.0 - (1.0 - f) ** self._batch
        return measured_speedup(a, g, td, t1, wide * tg + (1.0 - wide) * t1, f)

    # -- the choice -----------------------------------------------------------------

    def choose(self, batch: int | None = None,
               confidence: list[list[float]] | None = None) -> int:
        """g for the next step of a batch of this size (by default the latest step's);
        ``confidence``: per row, the drafter's confidence in each token it proposes at
        max_g (the Widths regime reads it). A step chosen to measure (a cost not known
        yet, a probe, a plain step now and then) is verified whole (``allot``)."""
        if batch:
            self._batch = batch
        self.measuring = True
        b = self.costs.stand_in(self._batch)
        if b is None:
            return 0  # no cost known at all: measure a plain step
        if self.t_draft is None or max(self.costs.verify[b]) == 1:
            return self.default  # measure a draft step and a wide pass
        far = self.costs.far_stand_in(self._batch)
        if far is not None:
            # a step at g = 1: a pass one token a row wider than a plain pass, the slope the
            # budget prices a draft token by until its fit of ragged passes is ready
            # (budget.Packed.from_widths; measured at g = 4 instead, a line from 1 to 5
            # tokens a row priced a first draft token under its cost on a CPU, and the demo
            # drafted twice as much for 5 % less)
            if self._batch not in self._measured_here:
                self._measured_here.add(self._batch)
                log.info("batch size %d ran on batch size %d's step costs: measuring its own",
                         self._batch, far)
            return 1
        if self.steps - self._plain_at.get(self._batch, 0) >= PLAIN_REFRESH:
            return 0
        self.measuring = False
        return self._best(confidence)

    def _best(self, confidence: list[list[float]] | None) -> int:
        """The g with the best predicted speedup; a probe at g = default when g = 0 wins."""
        scores = {g: self.predicted(g) or 0.0 for g in range(self.max_g + 1)}
        best = max(scores, key=scores.__getitem__)
        if best == 0:
            self.measuring = self._probe_due()
            return self.default if self.measuring else 0
        return best

    # -- the budget (budget.py) -------------------------------------------------------

    def allot(self, num_draft: list[int], forced: list[list[int]],
              confidence: list[list[float]], packed: bool,
              looked: list[bool] | None = None,
              remaining: list[int] | None = None,
              quotes: list[int | None] | None = None) -> list[int]:
        """Per row, how many of its ``num_draft`` proposed tokens this step verifies: the
        budget of the verify pass (budget.py), spent on the tokens likeliest to survive
        (``survivals``). A measuring step (``choose``) and a batch size without costs keep
        every token. ``forced``: per row, the positions a grammar forced; ``confidence``:
        per row, the scoring drafter's confidence in each of its own tokens (empty: none);
        ``packed``: the verify pass costs the tokens it carries (batch.py); ``looked``: per
        row, a text lookup's tokens lead it (grammar.ForcedDrafts.text); ``remaining``: per
        row, the tokens it may still emit, given once no request waits for a place (the
        batch drains: budget.drain); ``quotes``: per row, where a guessed closing quote
        stands in it (grammar.ForcedDrafts.chain), or None."""
        widest = max(num_draft, default=0)
        if not widest:
            self.gain = 0.0
            return list(num_draft)
        self.gain = None  # kept whole, unpriced, unless the budget below prices it
        if self.measuring:
            return list(num_draft)
        seconds = [self.t_verify(w + 1) for w in range(widest + 1)]
        if any(t is None for t in seconds):
            return list(num_draft)
        fit = self.costs.pass_fit(len(num_draft)) if packed else None
        step = self.costs.drafting_step(len(num_draft))
        if fit:
            plain, per_pass, per_token, per_column = fit
            cost: budget.VerifyCost = budget.TwoPart(plain, per_token, per_column,
                                                     len(num_draft), step + per_pass)
        else:
            cost = budget.verify_cost([t for t in seconds if t is not None], len(num_draft),
                                      packed, step)
        survivals = self.survivals(num_draft, forced, confidence, looked, quotes)
        split = (self._split(len(num_draft), fit[0] if fit else seconds[0])
                 if remaining is not None and len(num_draft) > 1 else None)
        if remaining is not None and split is not None:
            kept = budget.drain(cost, survivals, remaining, *split)
        else:
            kept = cost.allot(survivals)
        self.gain = budget.gain(cost, survivals, kept)
        return kept

    def _split(self, batch: int, plain: float | None) -> tuple[float, float] | None:
        """A plain step at this batch size in two parts, seconds: what the step costs
        whatever its rows (the weights read, the launches, the step's host work) and what
        each row adds, from the plain passes at batch 1 and here (budget.drain)."""
        lone = self.t_verify(1, 1)
        if plain is None or lone is None:
            return None
        fixed, per_row = budget.split(plain, lone, batch)
        host = self.costs.host.get(batch, {}).get(False)
        return fixed + (host.mean if host else 0.0), per_row

    def survivals(self, num_draft: list[int], forced: list[list[int]],
                  confidence: list[list[float]], looked: list[bool] | None = None,
                  quotes: list[int | None] | None = None) -> list[list[float]]:
        """Per row, each proposed token's predicted survival: the chain product of its
        acceptance and that of the tokens before it. A forced token's is 1 (the grammar
        allows nothing else), a scored token's its calibrated confidence (the scorer's own
        tokens lead a row, before the first forced one), a guessed closing quote's
        (``quotes``) the acceptance such guesses have shown (``quoted``), a text lookup's
        the acceptance its tokens have shown (``looked`` rows: ``lookup``), any other's
        alpha."""
        out = []
        looked = looked or [False] * len(num_draft)
        quotes = quotes or [None] * len(num_draft)
        for n, at, conf, text, quote in zip(num_draft, forced, confidence, looked, quotes):
            own = min(at[0] if at else n, len(conf))
            fixed, other = set(at), self.lookup.alpha if text else self.alpha
            out.append(budget.chain([1.0 if j in fixed else self.quoted.alpha if j == quote
                                     else self.calibration(conf[j]) if j < own else other
                                     for j in range(n)]))
        return out

    def width(self, confidence: list[list[float]]) -> int:
        """The k in 0..max_g with the most expected tokens per second when each row keeps
        its first k drafts, the pass padded (budget.Padded): (B + sum_rows sum_{j <= k}
        prod_{i <= j} q_i) / t_verify(k + 1), q the calibrated confidences."""
        conf = [row[: self.max_g] for row in confidence]
        num = [len(row) for row in conf]
        seconds = [self.t_verify(w + 1) for w in range(max(num, default=0) + 1)]
        if any(t is None for t in seconds):
            return 0
        cost = budget.Padded([t for t in seconds if t is not None], len(conf))
        return max(cost.allot(self.survivals(num, [[] for _ in num], conf)), default=0)

    def _probe_due(self) -> bool:
        """While g = 0 wins: a probe at g = default, spaced by its cost (``_spaced``)."""
        return self._spaced(self.default)

    def _spaced(self, g: int, tokens: float = 1.0) -> bool:
        """A probe at g is due once its cost in plain steps (g draft steps and a pass of
        g + 1 tokens a row), less the ``tokens`` a row it should yield (a plain step's: 1),
        fits in PROBE_BUDGET of the time since the last drafting step, and at least
        PROBE_GAP steps after it."""
        t1, tg, td = self.t_verify(1), self.t_verify(g + 1), self.t_draft
        extra = max(0.0, (g * td + tg) / t1 - tokens) if t1 and tg and td is not None else 0.0
        return self.steps - self._drafted_at >= max(PROBE_GAP, extra / PROBE_BUDGET)

    def record_costs(self, batch: int, t_verify: dict[int, list[float]],
                     t_draft: Iterable[float] = ()) -> None:
        """Add calibration's costs at a batch size: target pass seconds by tokens per row
        (every row as wide), and seconds per draft token step."""
        self.costs.add(batch, t_verify, t_draft, calibrated=True)

    def observe(self, g: int, num_draft: list[int], num_accepted: list[int],
                t_draft: float, t_verify: float, verify_tokens: int,
                carried: int | None = None, t_host: float | None = None,
                timed: bool = True) -> None:
        """Record one step at draft length g: per-row proposals and acceptances, the
        drafting time, and the target pass's time over ``verify_tokens`` tokens per row
        (the widest row's); ``carried``: the draft tokens the pass carried in all, for the
        packed pass's two-part price (PassFit); ``t_host``: the step's seconds past its
        drafting and its pass (CostTable.drafting_step). ``timed`` False: the pass also
        prefilled rows that joined it (Step.joined), its times are no step's cost."""
        self.steps += 1
        self.history.append(g)
        self._batch = len(num_draft)
        if timed:
            if verify_tokens == 1:
                self._plain_at[self._batch] = self.steps
            self.costs.add(self._batch, {verify_tokens: [t_verify]},
                           [t_draft / g] if g else [], carried=carried)
            if t_host is not None:
                self.costs.add_host(self._batch, verify_tokens > 1, t_host)
        if g:
            self._drafted_at = self.steps
            self.acceptance.add(num_draft, num_accepted)

    def observe_confidence(self, judged: list[tuple[list[float], int]]) -> None:
        """Verdicts on scored drafts, per row: the confidences of the tokens the target
        judged and how many of them it accepted (Calibration.add)."""
        for confidence, accepted in judged:
            self.calibration.add(confidence, accepted)

    def observe_lookup(self, num_draft: list[int], num_accepted: list[int]) -> None:
        """Verdicts on a text lookup's tokens, per row that carried them (judged, accepted;
        the grammar's forced ones left out)."""
        self.lookup.add(num_draft, num_accepted)

    def observe_quotes(self, judged: list[bool]) -> None:
        """Verdicts on guessed closing quotes: per quote the target judged, accepted or not."""
        self.quoted.add([1] * len(judged), [int(ok) for ok in judged])

    def observe_acceptance(self, num_draft: list[int], num_accepted: list[int]) -> None:
        """Record proposals judged while g = 0: a free drafter's, scored (shadow.py)."""
        self.acceptance.add(num_draft, num_accepted)

    def snapshot(self) -> dict:
        """The current estimates, for benchmarks and logs."""
        return {
            "alpha": self.alpha,
            "lookup_alpha": self.lookup.alpha,
            "quote_alpha": self.quoted.alpha,
            "propose_rate": self.propose_rate,
            "calibration": self.calibration.snapshot(),
            "hindsight": self.calibration.hindsight,
            "t_draft": {b: d.mean for b, d in sorted(self.costs.draft.items())},
            "t_verify": {b: {n: d.mean for n, d in sorted(t.items())}
                         for b, t in sorted(self.costs.verify.items())},
            "t_drafting_step": {b: self.costs.drafting_step(b) for b in sorted(self.costs.host)},
            "pass_fit": {b: self.costs.pass_fit(b) for b in sorted(self.costs.passes)},
            "steps": self.steps,
            "g_history": list(self.history),
        }


class Shadowed(DraftLengthPolicy):
    """A free drafter's proposals are scored while g = 0 (shadow.py): acceptance is seen
    without drafting, and a generation starts from acceptance 0 and drafts once the scored
    proposals show it pays; probes only re-measure costs (``_probe_due``). (From the plain
    regime's prior of 1/2 it drafted its first steps whatever the data, at a cost:
    docs/benchmarks.md#2026-12-01-shadowed-prior.)"""

    prior_alpha = 0.0

    def _probe_due(self) -> bool:
        """Acceptance needs no probe here, costs do: while g = 0 wins no wide pass is
        measured, so a wide pass's cost taken on a busy machine (a calibration during
        another job) would keep drafting off for good. Probes then come as in the plain
        regime, but only while the scored proposals show drafting could pay were a wide
        pass as cheap as a plain one (PROBE_HOPE)."""
        g, td, t1, tg = self.default, self.t_draft, self.t_verify(1), self.t_verify(
            self.default + 1)
        tokens = expected_tokens(self.alpha, g, self.propose_rate)
        if td is None or not t1 or not tg or tokens * t1 / (g * td + t1) < PROBE_HOPE:
            return False
        # its extra cost net of the tokens the scored acceptance says it yields: a probe
        # of good drafts is cheap even where a stale wide pass looks dear
        return self._spaced(g, tokens)


class Widths(DraftLengthPolicy):
    """A drafter that scores its own tokens proposes at max_g; the step's budget (``allot``)
    keeps, row by row, the drafts that pay, judged against the calibration its verdicts
    teach. A plain step judges each row's first token all the same, so acceptance needs no
    probe; costs do: while the budget keeps nothing no wider pass is measured, and a price
    taken on a busy machine (a cached calibration) would keep the budget plain for good.
    So while nothing was verified for a while and some row's first token is likely
    (PROBE_SURVIVAL), a probe verifies one token a row (``_spaced``); a pass far cheaper
    than the table said replaces what the table held (_Decayed: FAST)."""

    def _best(self, confidence: list[list[float]] | None) -> int:
        if not any(confidence or []):
            return 0
        assert confidence is not None  # any() of it was true
        first = [self.calibration(row[0]) for row in confidence if row]
        # a probe of one token a row, net of the tokens its first tokens should yield
        if max(first) >= PROBE_SURVIVAL and self._spaced(1, 1.0 + sum(first) / len(confidence)):
            self.measuring = True  # verified whole: the pass's cost is measured again
            return 1
        return self.max_g


class Pinned(DraftLengthPolicy):
    """g fixed at ``default`` (a benchmark's fixed g, a preset's ``adaptive: false``); with
    default 0 the null object of a pair that never drafts. Every proposed token is
    verified: no budget."""

    adapts = False

    def choose(self, batch: int | None = None,
               confidence: list[list[float]] | None = None) -> int:
        if batch:
            self._batch = batch
        return self.default

    def allot(self, num_draft: list[int], forced: list[list[int]],
              confidence: list[list[float]], packed: bool,
              looked: list[bool] | None = None,
              remaining: list[int] | None = None,
              quotes: list[int | None] | None = None) -> list[int]:
        return list(num_draft)
