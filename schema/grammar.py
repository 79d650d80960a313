"""Shaped outputs: what a request's ``response_format`` may ask for, and its grammar.

Four shapes, as OpenAI's batch lines and vLLM's guided decoding name them:

- ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}``: JSON that
  validates against the schema;
- ``{"type": "json_object"}``: any JSON object;
- ``{"type": "regex", "regex": "..."}``: text that matches the regular expression
  (vLLM's ``guided_regex``);
- ``{"type": "choice", "choice": ["...", ...]}``: exactly one of the strings
  (vLLM's ``guided_choice``).

``{"type": "text"}`` (OpenAI's default) constrains nothing. Each shape becomes one grammar
text of the llguidance library (``grammar``); validating a request compiles it, so a
schema the library cannot compile, a keyword it does not implement or a regex that does not
compile is refused where the request is read, naming the field. The worker compiles the
same text against its tokenizer (worker/engine/grammar.py). JSON is written in one layout:
``", "`` between items, ``": "`` after keys, no other whitespace (Python's json.dumps): the
grammar then fixes every key, quote and brace, which the engine drafts for free.
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

# The one JSON layout a constrained row writes (see the module docstring).
if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

JSON_LAYOUT: JsonCompileOptions = {"whitespace_flexible": False, "item_separator": ", ",
                                   "key_separator": ": "}
MAX_GRAMMAR_CHARS = 200_000  # a schema, regex or choice list, as JSON text
MAX_CHOICES = 1000


class _Format(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextFormat(_Format):
    """Free text: no constraint (OpenAI's default)."""

    type: Literal["text"]


class JsonObjectFormat(_Format):
    """Any JSON object (OpenAI's JSON mode)."""

    type: Literal["json_object"]


class JsonSchemaSpec(_Format):
    """OpenAI's ``json_schema`` member: a name, the schema, and ``strict`` (always kept:
    the output validates whatever strict says)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True, serialize_by_alias=True)

    name: str = Field("response", min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class JsonSchemaFormat(_Format):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


class RegexFormat(_Format):
    """Text matching a regular expression (Rust regex syntax, anchored at both ends)."""

    type: Literal["regex"]
    regex: str = Field(min_length=1)


class ChoiceFormat(_Format):
    """Exactly one of the strings."""

    type: Literal["choice"]
    choice: list[str] = Field(min_length=1, max_length=MAX_CHOICES)

    @field_validator("choice")
    @classmethod
    def _non_empty(cls, choice: list[str]) -> list[str]:
        if any(c == "" for c in choice):
            raise ValueError("a choice must not be empty")
        return choice


ResponseFormat = Annotated[
    TextFormat | JsonObjectFormat | JsonSchemaFormat | RegexFormat | ChoiceFormat,
    Field(discriminator="type"),
]


class Shaped(BaseModel):
    """A mixin for request parameters: ``response_format``, compiled when validated."""

    response_format: ResponseFormat | None = None

    @field_validator("response_format")
    @classmethod
    def _compiles(cls, value: ResponseFormat | None) -> ResponseFormat | None:
        if value is not None:
            check(value)
        return value


def grammar(response_format: ResponseFormat | None) -> str | None:
    """The llguidance grammar text of a response format; None for no constraint.
    Raises ValueError naming the field within response_format ("regex: ...") when the
    library cannot compile it."""
    if response_format is None or isinstance(response_format, TextFormat):
        return None
    return _compile(response_format.model_dump_json(by_alias=True))


def check(response_format: ResponseFormat) -> None:
    """ValueError, naming the field, unless the response format compiles."""
    grammar(response_format)


@lru_cache(maxsize=256)
def _compile(spec: str) -> str:
    """Grammar text from a response format's JSON (cached: a job's lines share one)."""
    from llguidance import LLMatcher  # the library stays out of imports that do not shape

    if len(spec) > MAX_GRAMMAR_CHARS:
        raise ValueError(f"longer than {MAX_GRAMMAR_CHARS} characters of JSON")
    fmt = json.loads(spec)
    kind = field = fmt["type"]
    try:
        if kind == "json_object":
            text = LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_LAYOUT)
        elif kind == "json_schema":
            field = "json_schema.schema"
            text = LLMatcher.grammar_from_json_schema(fmt["json_schema"]["schema"],
                                                      defaults=JSON_LAYOUT)
        elif kind == "regex":
            text = LLMatcher.grammar_from_regex(fmt["regex"])
        else:
            # Lark string literals take JSON's escapes: each choice is exactly itself
            text = LLMatcher.grammar_from_lark(
                "start: " + " | ".join(json.dumps(c) for c in fmt["choice"]))
    except ValueError as exc:
        raise ValueError(f"{field}: the grammar library refused it: {_one_line(exc)}") from None
    problem = LLMatcher.validate_grammar(text)
    if problem:
        raise ValueError(f"{field}: the grammar library refused it: {_one_line(problem)}")
    return text


def _one_line(problem: object) -> str:
    """A library message on one line (regex errors come with a caret drawing)."""
    lines = [s.strip() for s in str(problem).splitlines() if s.strip()]
    errors = [s for s in lines if s.startswith("error:")]
    text = "; ".join(errors or lines[:1])
    return text if len(text) <= 300 else text[:297] + "..."
