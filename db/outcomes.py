"""Outcomes: what one run of an item came to, as it is written to the item's row, once."""

from __future__ import annotations

import re
from dataclasses import dataclass, fields
from datetime import datetime
from typing import Any, overload

from specq.db.models import ItemStatus
from specq.schema.counters import ARRAYS, SCALARS, Counters

NOT_COLUMNS = ("index", "counters", "isolated")  # Outcome fields that are no item column


@dataclass
class Outcome:
    """An item's result (completed) or its error (failed), with its counters."""

    index: int
    status: ItemStatus
    output: str | None = None
    token_ids: list[int] | None = None
    finish_reason: str | None = None
    error: str | None = None
    prompt_tokens: int | None = None
    counters: Counters | None = None  # None: the item never reached the engine
    worker: str | None = None  # hostname that wrote it
    started_at: datetime | None = None
    finished_at: datetime | None = None
    isolated: bool = False  # it ran alone because a fault had struck it (counted on its chunk)

    @classmethod
    def failure(cls, index: int, error: str, **kw: Any) -> Outcome:
        return cls(index, ItemStatus.failed, error=error[:10000], **kw)

    def row(self) -> dict[str, Any]:
        """The item columns it writes (COLUMNS), counters spread into theirs."""
        row = {f.name: getattr(self, f.name) for f in fields(self)
               if f.name not in NOT_COLUMNS}
        row["status"] = ItemStatus(self.status).value
        c = self.counters
        for name in SCALARS + ARRAYS:
            value = None if c is None else getattr(c, name)
            row[name] = list(value) if isinstance(value, list) else value
        return row


COLUMNS: tuple[str, ...] = (
    *(f.name for f in fields(Outcome) if f.name not in NOT_COLUMNS),
    *SCALARS, *ARRAYS,
)


@overload
def storable(text: str) -> str: ...
@overload
def storable(text: None) -> None: ...
def storable(text: str | None) -> str | None:
    """Text as every database stores it: PostgreSQL text cannot hold NUL, so NUL becomes
    U+FFFD (the token ids keep the exact output); a lone surrogate becomes U+FFFD too.
    Outputs, outcome errors and fault texts all pass through it."""
    if not text:
        return text
    return _UNSTORABLE.sub("\ufffd", text)


_UNSTORABLE = re.compile("[\x00\ud800-\udfff]")
