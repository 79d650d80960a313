"""How steps draft: one seam between the engine and its drafter.

A Drafting owns the drafter and its draft-length policy (policy.py). Each step the engine
asks it for g and a proposal (``propose``) and, once the target has judged, hands it what
the step did (``observe``); the engine knows nothing else of drafting. The regimes are the
subclasses, chosen once from the drafter's declared capabilities (drafters.Drafter):

- Drafting: the policy picks g; a drafting step's proposals are judged by the target.
- Shadowed: a free drafter (prompt lookup) keeps proposing while g = 0; its proposals
  are scored against the tokens the target emits (shadow.py), so acceptance stays known.
- Scored: a drafter that scores its tokens (suffix.py) proposes at max_g; the policy keeps
  the width that pays, and learns from the target's verdicts what a confidence is worth.
- With g pinned (policy.Pinned), the plain Drafting; with g = 0 it never drafts (the null
  object of a pair without a drafter, and of the baseline every benchmark compares to).

Whatever the regime, a row shaped by a grammar drafts what its grammar forces first
(grammar.ForcedDrafts, ``draft``), at g = 0 too: those tokens cost nothing to propose. The
policy learns from the drafter's own tokens only (``own``), the counters count the grammar's
apart (Counters.forced_proposed, forced_accepted).
"""

from __future__ import annotations

import torch

from specq.worker.engine import shadow
from specq.worker.engine.batch import Row
from specq.worker.engine.drafters import Drafter, DraftInputs, NoDraft, Proposal
from specq.worker.engine.grammar import ForcedDrafts
from specq.worker.engine.policy import DraftLengthPolicy, Pinned, Shadowed, Widths
from specq.worker.engine.step import Step


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

    def draft(self, inputs: DraftInputs, rows: list[Row]
              ) -> tuple[int, Proposal, list[list[int]]]:
        """This step's g, the proposal the target judges (cut to g; in shaped rows the
        grammar's forced tokens and the drafter's in turn: grammar.ForcedDrafts.chain), and
        the positions of the forced tokens in it per row."""
        g, full = self.propose(inputs, rows)
        if inputs.grammar is not None:  # a draft model advanced the matchers as it drafted:
            inputs.grammar.rewind()  # what is forced is read at the rows' own states
        prop, matchers = full.cut(g), [r.matcher for r in rows]
        if self.grammar is None or all(m is None for m in matchers):
            return g, prop, [[] for _ in rows]
        prop, forced = self.grammar.merge(prop, matchers, inputs.tokens, g, self.policy.max_g)
        return g, prop, forced

    def propose(self, inputs: DraftInputs, rows: list[Row]) -> tuple[int, Proposal]:
        """This step's g and the proposal; the engine keeps each row's first g tokens."""
        g = self.policy.choose(batch=len(rows))
        return g, (self.drafter.propose(inputs, g) if g else nothing(len(rows)))

    def observe(self, step: Step, rows: list[Row], emitted: list[list[int]]) -> None:
        """What the step did (after the rows took its tokens: ``emitted`` per row)."""
        self.policy.observe(step.g, *own(step), step.t_draft, step.t_verify,
                            step.verify_tokens)


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
    pays for them (policy.Widths), and each step's verdicts teach its calibration."""

    def __init__(self, drafter: Drafter, policy: DraftLengthPolicy) -> None:
        super().__init__(drafter, policy)
        self._full: Proposal | None = None  # the latest step's proposal at max_g

    def propose(self, inputs: DraftInputs, rows: list[Row]) -> tuple[int, Proposal]:
        self._full = self.drafter.propose(inputs, self.policy.max_g)
        return self.policy.choose(batch=len(rows), confidence=self._full.confidences), \
            self._full

    def observe(self, step: Step, rows: list[Row], emitted: list[list[int]]) -> None:
        super().observe(step, rows, emitted)
        if self._full is not None:
            step.judged = verdicts(self._full, step)
            self.policy.observe_confidence(step.judged)
            self._full = None


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


def verdicts(full: Proposal, step: Step) -> list[tuple[list[float], int]]:
    """The target's verdicts on a scored proposal made at max_g and cut to g.

    Drafting rows: the kept drafts' confidences (a grammar may cut them shorter) and the
    accepted count. A plain step (g = 0) judges each row's first draft token all the same:
    the target emitted one token, and a point-mass draft is accepted exactly when it equals
    the target's own draw. Rows the grammar drafted are not the scorer's: no verdict.
    """
    first = full.token_ids[:, :1].tolist()
    forced = step.forced or [[] for _ in step.num_draft]
    judged = []
    for conf, k, toks, d, n, at in zip(full.confidences, step.accepted, step.tokens, first,
                                       step.num_draft, forced):
        if at and at[0] == 0:
            continue
        lead = at[0] if at else n  # the scorer's own tokens lead the row's proposal
        if conf and step.g:
            judged.append((conf[:lead], min(k, lead)))
        elif conf:
            judged.append((conf[:1], int(d[0] == toks[0])))
    return judged
