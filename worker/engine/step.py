"""What one step did: the record the engine hands to the rows, the counters, the drafting
(its policy learns from it) and ``on_step``.

Its own module so that the drafting and the benches read the record without importing
the engine that makes it (speculative.py imports the drafting: no circle).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Step:
    """What one step did, per row of the batch (in batch order)."""

    g: int  # draft length asked of the drafter; 0: none of its tokens verified (budget.py)
    num_draft: list[int]  # per row: draft tokens proposed (<= g)
    accepted: list[int]  # per row: of them accepted
    t_draft: float  # seconds drafting (all g tokens)
    t_verify: float  # seconds of the target pass
    verify_tokens: int  # tokens per row in that pass: the widest proposal + 1
    # per row: the accepted drafts, then the recovered or bonus token
    tokens: list[list[int]] = field(default_factory=list)
    t_step: float = 0.0  # seconds of the whole step, drafting through the cache fix-up
    # per row with a scored proposal: the confidences of the draft tokens the target
    # judged and how many it accepted (drafting.Scored; policy.Calibration.add)
    judged: list[tuple[list[float], int]] = field(default_factory=list)
    # per row: the positions of the grammar's forced tokens in its proposal (grammar.py)
    forced: list[list[int]] = field(default_factory=list)
    t_mask: float = 0.0  # seconds computing grammar masks (cuts and advances included)
    # per row: the prompt tokens it carried joining the pass (speculative.py: _join), 0 for
    # the others. The pass was such a row's prefill (its first token, no drafts), and its
    # seconds are not a verify pass's: the policy learns no cost from it
    joined: list[int] = field(default_factory=list)
