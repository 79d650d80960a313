"""Refusals of bad input: one type for every spec (job files, synthesis specs, schedules),
each problem naming where and which field, before anything is stored."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError


class NotFound(KeyError):
    """A job, tenant or endpoint asked for by id or name that is not stored. Still a
    KeyError, said as its message (a bare KeyError prints its message quoted, as a
    dictionary key)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "not found"


class InputError(ValueError):
    """The job spec is invalid; ``problems`` lists each one as 'where: field: message'.

    One problem reads as one line ('invalid job spec: line 3: seed: ...'); several as a
    list under the title."""

    title = "invalid job spec"

    def __init__(self, problems: list[str], truncated: bool = False) -> None:
        self.problems, self.truncated = problems, truncated
        if len(problems) == 1 and not truncated:
            message = f"{self.title}: {problems[0]}"
        else:
            more = f"\n  ... (stopped after {len(problems)} problems)" if truncated else ""
            message = f"{self.title}:\n  " + "\n  ".join(problems) + more
        super().__init__(message)


# fields holding a union told apart by its "type": pydantic puts the type in the location
# (response_format.json_schema.json_schema.schema), which no document spells
TAGGED = frozenset({"response_format"})


def path(loc: tuple | list) -> str:
    """A pydantic error's location as the docs spell a field: messages[0].content,
    response_format.json_schema.schema."""
    loc = list(loc)
    if len(loc) > 1 and loc[0] in TAGGED and isinstance(loc[1], str):
        del loc[1]
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".")


OBJECT_EXPECTED = frozenset({"model_type", "dict_type", "model_attributes_type"})


def json_type(value: Any) -> str:
    """What a parsed JSON value is, as JSON names it ('an array', 'a number', ...)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    names: dict[type, str] = {str: "a string", list: "an array", tuple: "an array",
                              dict: "an object"}
    return names.get(type(value), type(value).__name__)


def describe(exc: ValidationError) -> list[str]:
    """'field: message' for each error of a pydantic ValidationError (an object expected
    says so in JSON's words, not by the model class's name)."""
    out = []
    for err in exc.errors():
        loc = path(err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] in OBJECT_EXPECTED:
            msg = f"must be a JSON object, got {json_type(err.get('input'))}"
        out.append(f"{loc}: {msg}" if loc else msg)
    return out
