"""Per-request counters; every rate is derived from them, never stored alone.

The one definition of the counters: the engine counts them per request (Counters), the
items table stores them (db/models.py makes a column of each field), job metrics sum them
(api/client.py: JobMetrics extends Counters), exports and synthesis data sets write them
(api/formats.py, api/synthesis.py), and the SQL sums run over SCALARS and ARRAYS.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Literal


def acceptance_rate(accepted: int, proposed: int) -> float | None:
    """Accepted draft tokens / proposed draft tokens."""
    return accepted / proposed if proposed else None


def mean_acceptance_length(accepted: int, draft_steps: int) -> float | None:
    """Tokens per draft step, the bonus token included (vLLM's convention)."""
    return 1 + accepted / draft_steps if draft_steps else None


def verified_per_token(target_passes: int, proposed: int, new_tokens: int) -> float | None:
    """Tokens the target verified per token emitted: one per row per pass (a prefill's
    last position included) plus every draft token verified. Plain decoding: 1; what
    drafting adds beyond it is the verify work rejected drafts cost."""
    return (target_passes + proposed) / new_tokens if new_tokens else None


@dataclass
class Counters:
    """What one request cost and how often its drafts were accepted.

    new_tokens = accepted + tokens chosen by the target (one per target pass, the last
    pass's possibly cut by a stop or the token limit).
    """

    draft_steps: int = 0  # steps in which this request had at least one draft token
    proposed: int = 0  # draft tokens proposed
    accepted: int = 0  # draft tokens accepted and kept
    accepted_by_position: list[int] = field(default_factory=list)  # [i]: accepted at draft slot i
    target_passes: int = 0  # target forward passes this request took part in (prefill included)
    new_tokens: int = 0
    steps_by_draft_length: list[int] = field(default_factory=list)  # [g]: steps run with g
    # [n]: steps in which this request verified n draft tokens (the drafter's and those a
    # grammar forced): each row carries its own number in a step, whatever the step's g
    steps_by_drafts_verified: list[int] = field(default_factory=list)
    draft_time: float = 0.0  # seconds: this request's share of batch drafting time
    # seconds: its share of its steps outside drafting: the target pass (Step.t_verify),
    # accepting and cache upkeep; its prefill included
    verify_time: float = 0.0
    # a row shaped by a grammar (schema/grammar.py): of proposed and accepted, the tokens
    # its grammar forced (drafted for free: worker/engine/grammar.py), and its share of the
    # seconds spent computing grammar masks (inside verify_time and draft_time)
    forced_proposed: int = 0
    forced_accepted: int = 0
    mask_time: float = 0.0

    def observe_step(self, num_draft: int, num_accepted: int, g: int = 0) -> None:
        """Record one step at draft length g: ``num_draft`` proposed and verified (the
        drafter's and a grammar's), ``num_accepted`` kept."""
        if len(self.steps_by_draft_length) <= g:
            self.steps_by_draft_length += [0] * (g + 1 - len(self.steps_by_draft_length))
        self.steps_by_draft_length[g] += 1
        if len(self.steps_by_drafts_verified) <= num_draft:
            self.steps_by_drafts_verified += [0] * (num_draft + 1
                                                    - len(self.steps_by_drafts_verified))
        self.steps_by_drafts_verified[num_draft] += 1
        if num_draft:
            self.draft_steps += 1
            self.proposed += num_draft
        self.accepted += num_accepted
        if len(self.accepted_by_position) < num_accepted:
            self.accepted_by_position += [0] * (num_accepted - len(self.accepted_by_position))
        for i in range(num_accepted):
            self.accepted_by_position[i] += 1

    @property
    def acceptance_rate(self) -> float | None:
        return acceptance_rate(self.accepted, self.proposed)

    @property
    def mean_acceptance_length(self) -> float | None:
        return mean_acceptance_length(self.accepted, self.draft_steps)

    @property
    def verified_per_token(self) -> float | None:
        return verified_per_token(self.target_passes, self.proposed, self.new_tokens)

    @property
    def mean_drafts_verified(self) -> float | None:
        """Draft tokens a row verified per step, over all its steps (plain ones included)."""
        steps = sum(self.steps_by_drafts_verified)
        return sum(n * k for n, k in enumerate(self.steps_by_drafts_verified)) / steps \
            if steps else None

    @property
    def forced_acceptance_rate(self) -> float | None:
        """Of the tokens a grammar forced and drafted, the share accepted."""
        return acceptance_rate(self.forced_accepted, self.forced_proposed)

    def as_dict(self) -> dict:
        return asdict(self)


Kind = Literal["int", "float", "array"]


def kinds() -> dict[str, Kind]:
    """Each counter's name and kind, in definition order: int and float counters are summed
    over a job's items; array counters (per draft position or draft length) element-wise."""
    out: dict[str, Kind] = {}
    for f in fields(Counters):
        t = f.type if isinstance(f.type, str) else f.type.__name__
        out[f.name] = "array" if t.startswith("list") else "float" if t == "float" else "int"
    return out


SCALARS: tuple[str, ...] = tuple(n for n, k in kinds().items() if k != "array")
ARRAYS: tuple[str, ...] = tuple(n for n, k in kinds().items() if k == "array")
