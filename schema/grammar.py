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

An object schema that names its ``properties`` and says nothing of others is closed: the
output has the named keys and no others (``closed``), as OpenAI's strict mode requires and
vLLM's default grammar backend does, so a model cannot ramble on in keys nobody asked for
until ``max_new_tokens`` cuts it. ``"strict": false`` keeps JSON Schema's own reading
(other keys allowed).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from functools import lru_cache
from typing import TYPE_CHECKING, Annotated, Any, Literal
from urllib.parse import unquote

from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator
from pydantic_core import PydanticSerializationError

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
    """OpenAI's ``json_schema`` member: a name, the schema, and ``strict``. The output
    validates against the schema whatever strict says; unless strict is false, an object
    schema with ``properties`` and no word on other keys allows no others (``closed``)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True, serialize_by_alias=True)

    name: str = Field("response", min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: StrictBool | None = None  # true or false, as OpenAI takes it ("no" is no bool)


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
    try:
        spec = response_format.model_dump_json(by_alias=True)
    except PydanticSerializationError:  # (its own limit of nesting)
        raise ValueError("json_schema.schema: nested too deeply to be read (the grammar "
                         "library itself refuses about 100 levels of objects)") from None
    return _compile(spec)


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
    if kind == "json_schema":  # specq's own checks: what the library would take, wrongly
        field = "json_schema.schema"
        problem = (_ref_cycle(fmt[kind]["schema"]) or _inexact_number(fmt[kind]["schema"])
                   or _no_finite_instance(fmt[kind]["schema"]))
        if problem:
            raise ValueError(f"{field}: {problem}")
    try:
        if kind == "json_object":
            text = LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_LAYOUT)
        elif kind == "json_schema":
            schema = fmt["json_schema"]["schema"]
            if fmt["json_schema"].get("strict") is not False:
                schema = closed(schema)
            text = LLMatcher.grammar_from_json_schema(schema, defaults=JSON_LAYOUT)
        elif kind == "regex":
            text = LLMatcher.grammar_from_regex(fmt["regex"])
        else:
            # Lark string literals take JSON's escapes: each choice is exactly itself
            text = LLMatcher.grammar_from_lark(
                "start: " + " | ".join(json.dumps(c) for c in fmt["choice"]))
    except ValueError as exc:
        raise _refused(field, exc, fmt) from None
    problem = LLMatcher.validate_grammar(text)
    if problem:
        raise _refused(field, problem, fmt)
    return text


def _refused(field: str, problem: object, fmt: dict) -> ValueError:
    """The library's refusal of a format, on one line, with where in a schema the keyword
    it does not implement sits."""
    where = (_where_unimplemented(str(problem), fmt["json_schema"]["schema"])
             if fmt["type"] == "json_schema" else "")
    return ValueError(f"{field}: the grammar library refused it: {one_line(problem)}{where}")


# Keywords under which a closed object would change what the schema accepts: their
# subschemas judge the same instance as a sibling (allOf, a $ref beside other keywords,
# if/then/else, dependentSchemas) or are negated (not). Nothing under them is closed.
_KEEP = ("allOf", "not", "if", "then", "else", "dependentSchemas", "dependencies",
         "unevaluatedProperties")
_OPEN = ("additionalProperties", "patternProperties", "propertyNames", "$ref", "anyOf",
         "oneOf") + _KEEP  # an object with any of these keeps its own reading
# Where a schema holds schemas: maps of them, lists of them, one of them (the rest of its
# keys, enum and const and default among them, hold data)
_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas",
         "dependencies")
_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_ONE = ("items", "additionalProperties", "additionalItems", "contains", "not", "if", "then",
        "else", "propertyNames", "unevaluatedProperties", "unevaluatedItems")
# Keywords beside a $ref that judge no keys (annotations, definitions, the type): the $ref's
# schema is then the only one to judge the instance's keys (pydantic's root {"$ref", "$defs"})
_BESIDE_REF = frozenset({"$ref", "$defs", "definitions", "title", "description", "$schema",
                         "$id", "$anchor", "$comment", "default", "examples", "type",
                         "deprecated", "readOnly", "writeOnly"})


def closed(schema: Any) -> Any:
    """A copy of the schema where each object schema that lists ``properties`` and says
    nothing of other keys allows no others. Left as they are: an object whose ``required``
    names a key it does not list, one beside a ``$ref`` or combinators of its own, the
    schema of a ``$ref`` beside keywords that judge keys too (required, properties, ...), and
    everything under a keyword whose subschemas share their instance with another schema
    or are negated (``_KEEP``; anyOf/oneOf branches too where the parent says which keys
    it has or needs: properties, required, ...), with the definitions those reach by
    ``$ref``: closing them would refuse what the schema accepts. So the result accepts a
    subset of what the schema does."""
    if any(_resolve(schema, ref) is None for ref in _refs(schema)):
        return schema  # a $ref by anchor or URL: what it reaches is not known here
    kept: set[str] = set()  # "#/$defs/x" pointers whose schemas stay as they are
    _kept_refs(schema, schema, False, kept)
    return _close(schema, "#", False, kept)


def _refs(node: Any) -> Iterator[str]:
    """Every $ref in the schema."""
    if isinstance(node, dict):
        if isinstance(node.get("$ref"), str):
            yield node["$ref"]
        for _, _, _, sub in _subschemas(node):
            yield from _refs(sub)


def _ref_cycle(schema: Any) -> str | None:
    """A chain of schemas that are nothing but a $ref and lead back to themselves (a -> b
    -> a): no output can match it, and the library accepts it, to allow no token at all."""
    for ref in _refs(schema):
        seen = [ref]
        node = _resolve(schema, ref)
        while isinstance(node, dict) and node.keys() <= _BESIDE_REF - {"type"} \
                and isinstance(node.get("$ref"), str):
            if node["$ref"] in seen:
                return f"$ref cycle {' -> '.join(seen + [node['$ref']])}: no schema at its end"
            seen.append(node["$ref"])
            node = _resolve(schema, node["$ref"])
    return None


_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
EXACT = 2**53  # the library holds numeric bounds as 64-bit floats: exact up to here


def _inexact_number(node: Any, at: str = "#") -> str | None:
    """A number the library cannot hold exactly (an integer past 2**53 in magnitude): as a
    bound its grammar would let out-of-range numbers through; in an enum or a const, its
    grammar writes another number (9007199254740993 comes out 9007199254740992)."""
    if not isinstance(node, dict):
        return None
    for key in _BOUNDS:
        value = node.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) \
                and abs(value) > EXACT:
            return (f"{at[1:]}/{key}: {value} is past 2**53, the largest bound the grammar "
                    f"library holds exactly")
    for key in ("enum", "const"):
        big = _big_integer(node[key]) if key in node else None
        if big is not None:
            return (f"{at[1:]}/{key}: {big} is past 2**53, the largest integer the grammar "
                    f"library writes exactly (give it as a string)")
    for _, _, suffix, sub in _subschemas(node):
        problem = _inexact_number(sub, at + suffix)
        if problem:
            return problem
    return None


def _big_integer(value: Any) -> int | None:
    """An integer past 2**53 in magnitude anywhere in a JSON value, or None."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value if abs(value) > EXACT else None
    items = value.values() if isinstance(value, dict) else value if isinstance(value, list) \
        else ()
    return next((b for b in map(_big_integer, items) if b is not None), None)


MAX_FINITE_STEPS = 100_000  # schemas visited by _no_finite_instance before it gives up


def _no_finite_instance(schema: Any) -> str | None:
    """Whether no JSON value of finite size can match: a $ref that each of its instances
    must hold again (a required property, an item of a non-empty array, every anyOf
    branch), such as {"$defs": {"n": {"properties": {"c": {"$ref": "#/$defs/n"}},
    "required": ["c"]}}, "$ref": "#/$defs/n"}. The library compiles it and a row then dies
    at its first token; this names it before anything is stored. A derivation that is
    finite never needs a $ref inside itself on one path, so a $ref met again on the path
    is a dead end; the search gives up (and lets the schema be) past MAX_FINITE_STEPS."""
    steps = 0
    loops: list[str] = []
    finite: set[int] = set()  # id()s of schemas shown to have a finite instance

    def ok(node: Any, path: tuple[str, ...]) -> bool:
        nonlocal steps
        steps += 1
        if steps > MAX_FINITE_STEPS:
            raise _GiveUp
        if not isinstance(node, dict):
            return node is not False
        if id(node) in finite or "enum" in node or "const" in node:
            return True
        ref = node.get("$ref")
        if isinstance(ref, str):
            if ref in path:
                loops.append(" -> ".join(path[path.index(ref):] + (ref,)))
                return False
            target = _resolve(schema, ref)
            if target is not None and not ok(target, path + (ref,)):
                return False
        if isinstance(node.get("allOf"), list) and not all(ok(sub, path) for sub in node["allOf"]):
            return False
        for key in ("anyOf", "oneOf"):
            if isinstance(node.get(key), list) and node[key] \
                    and not any(ok(sub, path) for sub in node[key]):
                return False
        props = _of(node, "properties", dict)
        for name in _of(node, "required", list):
            sub = props.get(name, node.get("additionalProperties", True))
            if not ok(sub, path):
                return False
        least = node.get("minItems", 0)
        if isinstance(least, int) and least > 0:
            prefix = _of(node, "prefixItems", list)
            if not all(ok(sub, path) for sub in prefix[:least]):
                return False
            if least > len(prefix) and not ok(node.get("items", True), path):
                return False
        finite.add(id(node))
        return True

    try:
        if ok(schema, ()):
            return None
    except (_GiveUp, RecursionError):  # too big or too deep to search: the library judges
        return None
    where = f" ({loops[0]})" if loops else ""
    return (f"no JSON value of finite size matches it: each instance must hold another "
            f"through a $ref that leads back to itself{where}")


class _GiveUp(Exception):
    pass


def _of(node: dict, key: str, kind: type) -> Any:
    """node[key] if it is a ``kind`` (dict or list), else an empty one."""
    value = node.get(key)
    return value if isinstance(value, kind) else kind()


def _subschemas(node: dict) -> Iterator[tuple[str, str | int | None, str, Any]]:
    """(keyword, its slot: a name in a map, an index in a list or None, JSON pointer
    suffix, subschema) for each schema the schema holds."""
    for key, value in node.items():
        at = "/" + _escape(key)
        if key in _MAPS and isinstance(value, dict):
            for name, sub in value.items():
                yield key, name, f"{at}/{_escape(name)}", sub
        elif key in _LISTS and isinstance(value, list):
            for i, sub in enumerate(value):
                yield key, i, f"{at}/{i}", sub
        elif key in _ONE:
            yield key, None, at, value


UNIMPLEMENTED = re.compile(r"Unimplemented keys: \[\"([^\"]+)\"")


def _where_unimplemented(message: str, schema: Any) -> str:
    """Where the first keyword the library does not implement sits (" at /properties/b"),
    for a message that names only the keyword; "" if none is found."""
    found = UNIMPLEMENTED.search(message)

    def find(node: Any, at: str) -> str | None:
        if not isinstance(node, dict):
            return None
        if found and found.group(1) in node:
            return at or "/"
        for _, _, suffix, sub in _subschemas(node):
            hit = find(sub, at + suffix)
            if hit is not None:
                return hit
        return None

    hit = find(schema, "") if found else None
    return f" (at {hit})" if hit else ""


def _escape(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")


# keywords of an object schema that say which keys it has or needs: anyOf/oneOf branches
# beside any of them are left open (a branch closed to its own keys would refuse them)
_KEYED = ("properties", "required", "dependentRequired", "dependencies", "minProperties",
          "patternProperties", "additionalProperties", "propertyNames")


def _keeps(node: dict, key: str) -> bool:
    """Nothing under this keyword of this schema is closed."""
    return key in _KEEP or key in ("anyOf", "oneOf") and any(k in node for k in _KEYED)


def _kept_refs(root: Any, node: Any, keep: bool, out: set[str]) -> None:
    """Collect the local $ref pointers reached from where nothing may be closed, and the
    ones their schemas reach in turn."""
    if not isinstance(node, dict):
        return
    ref = node.get("$ref")
    if isinstance(ref, str) and (keep or not node.keys() <= _BESIDE_REF) \
            and _pointer(ref) not in out:
        out.add(_pointer(ref))
        _kept_refs(root, _resolve(root, ref), True, out)
    for key, _, _, sub in _subschemas(node):
        _kept_refs(root, sub, keep or _keeps(node, key), out)


def _pointer(ref: str) -> str:
    """A local $ref as ``_close`` spells paths: each part percent-decoded, ~ escapes kept."""
    return "#" + "/".join(unquote(part) for part in ref[1:].split("/"))


def _resolve(root: Any, ref: str) -> Any:
    """The schema a local JSON pointer ("#/$defs/x", percent-encoded or not) names, or
    None (an anchor, a URL, a pointer to nothing)."""
    if not (ref == "#" or ref.startswith("#/")):
        return None
    node = root
    for part in filter(None, ref[1:].split("/")):
        part = unquote(part).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _close(node: Any, path: str, keep: bool, kept: set[str]) -> Any:
    if not isinstance(node, dict):
        return node  # true, false
    keep = keep or path in kept
    out = dict(node)
    for key, slot, at, sub in _subschemas(node):
        new = _close(sub, path + at, keep or _keeps(node, key), kept)
        if slot is None:
            out[key] = new
            continue
        if out[key] is node[key]:  # the map or list copied before its first change
            out[key] = type(node[key])(node[key])
        out[key][slot] = new
    props, required = node.get("properties"), node.get("required", [])
    if (not keep and isinstance(props, dict) and not any(k in node for k in _OPEN)
            and isinstance(required, list) and set(required) <= set(props)):
        out["additionalProperties"] = False
    return out


def one_line(problem: object) -> str:
    """A library message on one line (regex errors come with a caret drawing)."""
    lines = [s.strip() for s in str(problem).splitlines() if s.strip()]
    errors = [s for s in lines if s.startswith("error:")]
    text = "; ".join(errors or lines[:1])
    return text if len(text) <= 300 else text[:297] + "..."
