"""Acceptance of a free drafter, observed while the engine does not draft.

While g = 0, verify passes tell the policy nothing of acceptance, so it would have to
probe (a wide pass that may not pay) to learn whether drafting pays again. A drafter
that costs nothing next to a target pass (prompt lookup) can go on proposing instead:
each row holds a proposal, scored against the tokens the target then emits, one per
step. For a point-mass draft this is exact in law: the rejection sampler accepts token d
with probability p(d), which is the probability that the target's own sample is d (for
a greedy row, that its argmax is d). A held proposal ends at its first mismatch (a
rejection) or once all of it was emitted, and counts like one drafting step.
"""

from __future__ import annotations

import torch

from specq.worker.engine.batch import Row
from specq.worker.engine.drafters import Drafter, DraftInputs


def hold(drafter: Drafter, rows: list[Row], g: int) -> None:
    """Give every row without a held proposal a fresh one of up to g tokens."""
    need = [r for r in rows if r.shadow is None]
    if not need:
        return
    B = len(need)
    zeros = torch.zeros(B, dtype=torch.long)
    inputs = DraftInputs([r.tokens for r in need], zeros, zeros.float(), zeros,
                         torch.ones(B), greedy=True)
    prop = drafter.propose(inputs, g)
    for r, ids, n in zip(need, prop.token_ids.tolist(), prop.num_draft.tolist()):
        r.shadow = (ids[:n], 0)


def score(rows: list[Row], emitted: list[list[int]]) -> tuple[list[int], list[int]]:
    """Match the tokens each row just emitted against its held proposal.

    Returns (proposed, accepted) of every proposal that ended this step; an empty one
    counts as a row that proposed nothing. A proposal cut short by its row finishing is
    dropped unjudged.
    """
    proposed, accepted = [], []
    for r, toks in zip(rows, emitted):
        if r.shadow is None:
            continue
        draft, k = r.shadow
        ended = not draft
        for t in toks:
            if ended:
                break
            if t == draft[k]:
                k += 1
                ended = k == len(draft)
            else:
                ended = True
        if ended:
            proposed.append(len(draft))
            accepted.append(k)
        r.shadow = None if ended or r.ended else (draft, k)
    return proposed, accepted


def drop(rows: list[Row]) -> None:
    """Forget held proposals (a drafting step judges real ones instead)."""
    for r in rows:
        r.shadow = None
