"""What the engine hands back for a request: its tokens and text, or why it failed."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from specq.schema.counters import Counters

FinishReason = Literal["stop", "length"]


@dataclass
class Result:
    """The outcome of one request: its tokens and text, or the error that stopped it."""

    id: int | str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    counters: Counters = field(default_factory=Counters)
    error: str | None = None
