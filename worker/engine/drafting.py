"""How steps draft: one seam between the engine and its drafter.

A Drafting owns the drafter and its draft-length policy (policy.py). Each step the engine
asks it for g and a proposal (``propose``) and, once the target has judged, hands it what
the step did (``observe``); the engine knows nothing else of drafting. The regimes are the
subclasses, chosen once from the drafter's declared capabilities (drafters.Drafter):

- Drafting: the policy picks g; a drafting step's proposals are judged by the target.
- Shadowed: a free drafter (prompt lookup) keeps proposing while g = 0; its proposals
  are scored against the tokens the target emits (shadow.py), so acceptance stays known.
- Scored: a drafter that scores its tokens (suffix.py) proposes at max_g; the step's
  budget keeps what pays, and the target's verdicts teach what a confidence is worth.
- With g pinned (policy.Pinned), the plain Drafting; with g = 0 it never drafts (the null
  object of a pair without a drafter, and of the baseline every benchmark compares to).

Whatever the regime, a row shaped by a grammar drafts what its grammar forces first
(grammar.ForcedDrafts, ``draft``), at g = 0 too: those tokens cost nothing to propose. The
policy learns from the drafter's own tokens only (``own``), the counters count the grammar's
apart (Counters.forced_proposed, forced_accepted).

Whatever the regime, the proposal is then cut row by row to the step's budget (``spend``:
policy.allot, budget.py): a token is verified while its predicted survival beats what one
more verified token costs. A drafter that proposes beyond it (a draft model asked for g)
has its work judged only where verified; its cache follows what the rows emit
(drafters.DraftModel.update), so a cut row needs nothing more.
"""

from __future__ import annotations

import torch

from specq.worker.engine import shadow
from specq.worker.engine.batch import Row
from specq.worker.engine.drafters import Drafter, DraftInputs, NoDraft, Proposal
from specq.worker.engine.grammar import ForcedDrafts
from specq.worker.engine.policy import DraftLengthPolicy, Pinned, Shadowed, Widths
from specq.worker.engine.step import Step

IDLE_AFTER = 4  # a scored drafter's proposals in a row the budget kept none of before it rests
IDLE_REST = 8  # the most steps it rests at a time (Scored)
WORTH_DECAY = 0.9  # per proposing step: what proposing is worth follows the latest steps


def drafting_for(drafter: Drafter, *, default: int, max_g: int, adaptive: bool) -> Drafting:
    """The regime for this drafter: g starts at ``default`` (0: never draft) and adapts up
    to ``max_g`` unless ``adaptive`` is off."""
    if default == 0 or drafter.name == NoDraft.name:
        return Drafting(drafter, Pinned(default=0, max_g=max_g))
    if not adaptive:
        return Drafting(drafter, Pinned(default=default, max_g=max_g))
    if drafter.scored:
        return Scored(drafter, Widths(default=default, max_g=max_g))
    if drafter.free:
        return ShadowedDrafting(drafter, Shadowed(default=default, max_g=max_g))
    return Drafting(drafter, DraftLengthPolicy(default=default, max_g=max_g))


def nothing(batch: int) -> Proposal:
    """The proposal of a step that does not draft: no token for any of ``batch`` rows."""
    empty = torch.zeros(batch, 0, dtype=torch.long)
    return Proposal(empty, torch.zeros(batch, dtype=torch.long), None)


class Drafting:
    """The policy picks g; the drafter proposes g tokens per row (none at g = 0)."""

    def __init__(self, drafter: Drafter, policy: DraftLengthPolicy) -> None:
        self.drafter, self.policy = drafter, policy
        self.grammar: ForcedDrafts | None = None  # the grammar drafter, when it is on
        self.looked: list[bool] = []  # per row of the latest step: led by a text lookup
        # per row of the latest step: the drafter's tokens a grammar's chain kept, where
        # fewer than proposed (ForcedDrafts.kept); empty: every row kept its own
        self.kept: list[int | None] = []
        # per row of the latest step: where a guessed closing quote stands (ForcedDrafts)
        self.quotes: list[int | None] = []

    def draft(self, inputs: DraftInputs, rows: list[Row], packed: bool = False,
              draining: bool = False) -> tuple[int, Proposal, list[list[int]]]:
        """This step's g, the proposal the target judges (cut to g; in shaped rows the
        grammar's forced tokens and the drafter's in turn: grammar.ForcedDrafts.chain; then
        each row cut to what the step's budget verifies: ``spend``), and the positions of
        the forced tokens in it per row. ``packed``: the verify pass costs the tokens it
        carries (batch.py: KVRows.packed), else every row pays for the widest;
        ``draining``: no request waits for a place, a token pays only by the time it
        takes off the rest of the job (budget.drain)."""
        self.policy.packed = packed  # g is priced as the pass will cost (policy.predicted)
        g, full = self.propose(inputs, rows)
        if inputs.grammar is not None:  # a draft model advanced the matchers as it drafted:
            inputs.grammar.rewind()  # what is forced is read at the rows' own states
        prop, matchers = full.cut(g), [r.matcher for r in rows]
        forced: list[list[int]] = [[] for _ in rows]
        self.looked, self.kept, self.quotes = [False] * len(rows), [], []
        if self.grammar is not None and any(m is not None for m in matchers):
            # a text lookup's tokens are priced one by one where the policy adapts (its
            # budget: policy.allot), else they keep to the fixed g like the drafter's own
            text = self.policy.max_g if self.policy.adapts else g
            prop, forced, self.looked = self.grammar.merge(prop, matchers, inputs.tokens, g,
                                                           self.policy.max_g, text)
            self.kept, self.quotes = self.grammar.kept, self.grammar.quotes
        if any(r.unseen for r in rows):
            # a row joining the pass carries its prompt and, where its grammar forces its
            # first tokens (``{"name": "``), the chain they lead: judged in the same pass as
            # any row's; the drafter's own tokens wait for the row's next step
            drafts = [not r.unseen or bool(at and at[0] == 0) for r, at in zip(rows, forced)]
            prop.num_draft = torch.tensor([n if d else 0 for d, n in
                                           zip(drafts, prop.num_draft.tolist())])
            forced = [at if d else [] for d, at in zip(drafts, forced)]
        remaining = ([r.limit - (len(r.tokens) - r.prompt_len) for r in rows] if draining
                     else None)
        return self.spend(g, prop, forced, packed, remaining)

    def snapshot(self) -> dict:
        """The policy's estimates (policy.snapshot), and the regime's own where it keeps any."""
        return self.policy.snapshot()

    def reset(self) -> None:
        """A generation starts (or a failed one ended): what the regime held of the rows
        goes (the policy's estimates stay: policy.forget_data drops those)."""

    def spend(self, g: int, prop: Proposal, forced: list[list[int]], packed: bool,
              remaining: list[int] | None = None) -> tuple[int, Proposal, list[list[int]]]:
        """Each row cut to the tokens the step's budget verifies (policy.allot). g stays
        what the drafter was asked for (the policy prices a draft token by it), or 0 where
        the budget kept none of the drafter's tokens: nothing of its was judged."""
        num = prop.num_draft.tolist()
        kept = self.policy.allot(num, forced, self.confidence(prop, len(num)), packed,
                                 self.looked, remaining, self.quotes or None)
        if kept == num:
            return g, prop, forced
        prop.num_draft = torch.tensor(kept, dtype=torch.long)
        forced = [[p for p in at if p < k] for at, k in zip(forced, kept)]
        own = any(k > len(at) for k, at in zip(kept, forced))
        return (g if own else 0), prop, forced

    def confidence(self, prop: Proposal, batch: int) -> list[list[float]]:
        """Per row, the drafter's confidence in each of its own tokens that lead the row's
        proposal (none: it does not score them)."""
        return [[] for _ in range(batch)]

    def propose(self, inputs: DraftInputs, rows: list[Row]) -> tuple[int, Proposal]:
        """This step's g and the proposal; the engine keeps each row's first g tokens."""
        g = self.policy.choose(batch=len(rows))
        return g, (self.drafter.propose(inputs, g) if g else nothing(len(rows)))

    def observe(self, step: Step, rows: list[Row], emitted: list[list[int]]) -> None:
        """What the step did (after the rows took its tokens: ``emitted`` per row). A text
        lookup's tokens teach its own acceptance, not the drafter's."""
        num, acc = own(step)
        quotes = [(k > q) for q, n, k in zip(self.quotes, step.num_draft, step.accepted)
                  if q is not None and q < n and k >= q]  # guessed quotes the target judged
        if quotes:
            self.policy.observe_quotes(quotes)
        looked = self.looked or [False] * len(num)  # set by this step's draft
        if any(looked):
            self.policy.observe_lookup([n for n, t in zip(num, looked) if t],
                                       [k for k, t in zip(acc, looked) if t])
            num = [0 if t else n for n, t in zip(num, looked)]
            acc = [0 if t else k for k, t in zip(acc, looked)]
        self.policy.observe(step.g, num, acc, step.t_draft, step.t_verify,
                            step.verify_tokens, carried=sum(step.num_draft),
                            t_host=max(0.0, step.t_step - step.t_draft - step.t_verify),
                            timed=not any(step.joined))


class ShadowedDrafting(Drafting):
    """While g = 0 each row holds a proposal of the free drafter, scored against the tokens
    the target emits (shadow.py); a drafting step drops them and judges real ones."""

    def propose(self, inputs: DraftInputs, rows: list[Row]) -> tuple[int, Proposal]:
        g, proposal = super().propose(inputs, rows)
        if g:
            shadow.drop(rows)
        else:
            shadow.hold(self.drafter, rows, self.policy.default)
        return g, proposal

    def observe(self, step: Step, rows: list[Row], emitted: list[list[int]]) -> None:
        super().observe(step, rows, emitted)
        if not step.g:
            self.policy.observe_acceptance(*shadow.score(rows, emitted))


class Scored(Drafting):
    """Proposals at max_g with each token's confidence; the policy keeps the width that
    pays for them (policy.Widths), and each step's verdicts teach its calibration.

    Proposing costs the drafter's lookups and the budget's ranking every step, kept or
    not: on open chat at batch 16 on a CPU 1-2 % of a run for drafts the budget kept in
    one step of ten (docs/benchmarks.md, "a drafter at rest"), a larger share where a pass
    is shorter. So the drafter rests while its proposals are worth less than they cost:
    the budget's expected gain of each proposing step (budget.gain: 0 where it kept
    nothing), decayed (WORTH_DECAY), below the share of those steps' seconds spent
    drafting. After IDLE_AFTER proposals in a row the budget kept none of, it skips one
    step's proposal, then 2, 4, up to IDLE_REST; a step that verifies its tokens ends the
    run. At batch 1, where a kept draft saves a good part of a pass, the worth stays far
    above the cost and it never rests in a generation that drafts at all. The drafter
    reads the rows as they are when it next proposes (suffix.py catches up); a row that
    would have drafted in a rest waits at most IDLE_REST steps."""

    def __init__(self, drafter: Drafter, policy: DraftLengthPolicy) -> None:
        super().__init__(drafter, policy)
        self._full: Proposal | None = None  # the latest step's proposal at max_g
        self.idle = 0  # proposals in a row the budget kept none of
        self.rest = 0  # steps left before the drafter proposes again
        # decayed over proposing steps: the budget's expected gain (budget.gain), and the
        # share of the step's seconds spent drafting; None until a step priced them
        self.worth: float | None = None
        self.cost = 0.0
        self.rested = 0  # steps it rested, counted for the benches (``snapshot``)

    def propose(self, inputs: DraftInputs, rows: list[Row]) -> tuple[int, Proposal]:
        if self.rest:
            self.rest -= 1
            self.rested += 1
            self._full = None
            return 0, nothing(len(rows))
        self._full = full = self.drafter.propose(inputs, self.policy.max_g)
        g = self.policy.choose(batch=len(rows), confidence=full.confidences)
        return min(g, max(full.num_draft.tolist(), default=0)), full

    def snapshot(self) -> dict:
        return {**super().snapshot(), "rested": self.rested, "worth": self.worth,
                "draft_share": self.cost}

    def reset(self) -> None:
        """A new generation's rows, perhaps another job's, propose from its first step: the
        run of idle proposals and its rest start again (the worth, decayed, stays)."""
        self._full, self.idle, self.rest = None, 0, 0

    def confidence(self, prop: Proposal, batch: int) -> list[list[float]]:
        """The scorer's confidences, read from its proposal at max_g (a grammar's merge
        drops them: its own tokens lead a shaped row, policy.survivals). A row the step's g
        cut to none of them and a text lookup's tokens lead has none: theirs are not its."""
        if self._full is None:
            return super().confidence(prop, batch)
        looked = self.looked or [False] * batch
        confs = [[] if lead else c for c, lead in zip(self._full.confidences, looked)]
        # a grammar's chain may cut the scorer's tokens (a value's end, then its quote)
        kept = self.kept or [None] * batch
        return [c if k is None else c[:k] for c, k in zip(confs, kept)]

    def observe(self, step: Step, rows: list[Row], emitted: list[list[int]]) -> None:
        super().observe(step, rows, emitted)
        if self._full is not None:
            step.judged = verdicts(self._full, step, self.confidence(self._full, len(rows)))
            self.policy.observe_confidence(step.judged)
            self._full = None
            self._weigh(step)

    def _weigh(self, step: Step) -> None:
        """After a proposing step: what proposing is worth against what it costs, and
        whether the drafter rests (the class's docstring)."""
        gain = self.policy.gain
        if gain is None or step.t_step <= 0:  # a measuring step, or costs still unknown
            self.idle = 0
            return
        share = step.t_draft / step.t_step
        if self.worth is None:
            self.worth, self.cost = gain, share
        else:
            self.worth = WORTH_DECAY * self.worth + (1 - WORTH_DECAY) * gain
            self.cost = WORTH_DECAY * self.cost + (1 - WORTH_DECAY) * share
        self.idle = 0 if step.g else self.idle + 1
        if self.idle >= IDLE_AFTER and self.worth < self.cost:
            self.rest = min(2 ** (self.idle - IDLE_AFTER), IDLE_REST)


def own(step: Step) -> tuple[list[int], list[int]]:
    """Per row, the drafter's own tokens judged and accepted in a step, the grammar's forced
    ones left out: of the positions the target judged (up to its first rejection), those
    not forced, and of them the accepted. A rejection counts against the drafter only where
    it rejected one of its tokens."""
    forced = step.forced or [[] for _ in step.num_draft]
    num, acc = [], []
    for n, k, at in zip(step.num_draft, step.accepted, forced):
        judged = min(k + 1, n)
        num.append(judged - sum(1 for p in at if p < judged))
        acc.append(k - sum(1 for p in at if p < k))
    return num, acc


def verdicts(full: Proposal, step: Step, confidences: list[list[float]] | None = None
             ) -> list[tuple[list[float], int]]:
    """The target's verdicts on a scored proposal made at max_g and cut by the budget.

    A row that verified some of the scorer's tokens: their confidences (the budget or a
    grammar may cut them shorter) and the accepted count. A row that verified none of them
    (a plain step, or the budget kept nothing of the row) judges its first draft token all
    the same: the target emitted a token there, and a point-mass draft is accepted exactly
    when it equals the target's own draw. Rows the grammar drafted are not the scorer's:
    no verdict. ``confidences``: per row, those of the scorer's tokens the step proposed
    (default: all of the proposal's; none where other tokens took their place).
    """
    first = full.token_ids[:, :1].tolist()
    forced = step.forced or [[] for _ in step.num_draft]
    judged = []
    confs = full.confidences if confidences is None else confidences
    for conf, k, toks, d, n, at in zip(confs, step.accepted, step.tokens, first,
                                       step.num_draft, forced):
        if at and at[0] == 0:
            continue
        lead = min(at[0] if at else n, len(conf))  # the scorer's own tokens lead the row
        if lead:
            judged.append((conf[:lead], min(k, lead)))
        elif conf:
            judged.append((conf[:1], int(d[0] == toks[0])))
    return judged
