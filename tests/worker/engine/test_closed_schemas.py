"""An object schema that lists its properties and says nothing of other keys is closed
(schema/grammar.py ``closed``): the grammar refuses keys nobody asked for, unless strict is
false; and closing never refuses an instance it must not: one whose keys another schema
judges too (allOf, a $ref with siblings, if/then, not, required keys not listed)."""

import json

import jsonschema
import llguidance
import llguidance.hf
import pytest

from specq.schema.generation import Request
from specq.schema.grammar import JSON_LAYOUT, closed, grammar

POINT = {"type": "object", "required": ["x"],
         "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}}}

# (schema, instances that must stay accepted, instances closing refuses)
CASES = [
    (POINT, [{"x": 1}, {"x": 1, "y": 2}], [{"x": 1, "z": 3}]),
    ({"type": "object", "properties": {"p": POINT, "tags": {"type": "array", "items": POINT}}},
     [{"p": {"x": 1}, "tags": [{"x": 2, "y": 3}]}, {}],
     [{"p": {"x": 1, "w": 0}}, {"tags": [{"x": 2, "q": 1}]}, {"other": 1}]),
    ({"$defs": {"pt": POINT}, "type": "object", "properties": {"a": {"$ref": "#/$defs/pt"}}},
     [{"a": {"x": 1}}], [{"a": {"x": 1, "k": 2}}]),
    ({"anyOf": [POINT, {"type": "object", "properties": {"name": {"type": "string"}},
                        "required": ["name"]}]},
     [{"x": 1}, {"name": "a"}], [{"name": "a", "x": "s"}]),
    # pydantic's shape for a recursive model: the root a $ref beside its $defs
    ({"$defs": {"Node": {"type": "object", "title": "Node", "required": ["v", "next"],
                         "properties": {"v": {"type": "integer"}, "next": {
                             "anyOf": [{"$ref": "#/$defs/Node"}, {"type": "null"}]}}}},
      "$ref": "#/$defs/Node", "title": "Root"},
     [{"v": 1, "next": {"v": 2, "next": None}}],
     [{"v": 1, "next": None, "w": 0}, {"v": 1, "next": {"v": 2, "next": None, "w": 0}}]),
    # keys named like keywords are properties, not keywords
    ({"type": "object", "properties": {"if": {"type": "object", "properties": {"a": {}}},
                                       "properties": {"type": "string"}}},
     [{"if": {"a": 1}, "properties": "s"}], [{"if": {"a": 1, "b": 2}}, {"properties": "s",
                                                                       "zz": 1}]),
    # the same instance judged by two schemas: nothing under them is closed
    ({"allOf": [{"properties": {"a": {"type": "integer"}}},
                {"properties": {"b": {"type": "integer"}}}]}, [{"a": 1, "b": 2}], []),
    ({"$defs": {"base": {"properties": {"a": {"type": "integer"}}}},
      "allOf": [{"$ref": "#/$defs/base"}, {"properties": {"b": {"type": "integer"}}}]},
     [{"a": 1, "b": 2}], []),
    ({"$defs": {"base": {"type": "object", "properties": {"a": {"type": "integer"}}}},
      "$ref": "#/$defs/base", "properties": {"b": {"type": "integer"}}}, [{"a": 1, "b": 2}], []),
    ({"$defs": {"base": {"type": "object", "properties": {"a": {"type": "integer"}}}},
      "$ref": "#/$defs/base", "required": ["a", "b"]}, [{"a": 1, "b": 2}], []),
    ({"type": "object", "properties": {"kind": {"enum": ["a", "b"]}},
      "anyOf": [{"properties": {"x": {"type": "integer"}}}, {"properties": {"y": {}}}]},
     [{"kind": "a", "x": 1}], []),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a", "b"]},
     [{"a": 1, "b": True}], []),
    ({"type": "object", "properties": {"a": {"type": "integer"}},
      "patternProperties": {"^x-": {"type": "string"}}}, [{"a": 1, "x-note": "n"}], []),
    ({"type": "object", "properties": {"a": {"type": "integer"}},
      "additionalProperties": {"type": "string"}}, [{"a": 1, "more": "text"}], []),
    # branches beside a parent that requires keys none of them lists stay open: closed,
    # none could hold "name" (refused as unsatisfiable, or under items: only [] written)
    ({"type": "object", "required": ["name"],
      "anyOf": [{"properties": {"a": {"type": "integer"}}, "required": ["a"]},
                {"properties": {"b": {"type": "integer"}}, "required": ["b"]}]},
     [{"a": 1, "name": 1}, {"b": 2, "name": "n"}], []),  # (the library writes listed keys
    # first)
    ({"type": "object", "required": ["contacts"], "properties": {"contacts": {
        "type": "array", "maxItems": 3, "items": {
            "type": "object", "required": ["name"],
            "anyOf": [{"properties": {"email": {"type": "string"}}, "required": ["email"]},
                      {"properties": {"phone": {"type": "string"}}, "required": ["phone"]}]}}}},
     [{"contacts": [{"email": "a@b", "name": "Ann"}, {"phone": "1", "name": "Bo"}]}],
     [{"contacts": [], "x": 1}]),
]


@pytest.fixture(scope="module")
def lltok(tiny_tokenizer):
    return llguidance.hf.from_tokenizer(tiny_tokenizer)


def accepts(lltok, tokenizer, response_format: dict, value: object) -> bool:
    """The request's grammar takes the value, written in the engine's one JSON layout,
    whole."""
    text = json.dumps(value, separators=(JSON_LAYOUT["item_separator"],
                                         JSON_LAYOUT["key_separator"]))
    fmt = Request(prompt_token_ids=[3], response_format=response_format).response_format
    matcher = llguidance.LLMatcher(lltok, grammar(fmt), log_level=0)
    tokens = tokenizer.encode(text, add_special_tokens=False)
    return matcher.consume_tokens(tokens) and matcher.is_accepting()


def schema_format(schema: dict, strict: bool | None = True) -> dict:
    spec = {"name": "s", "schema": schema} | ({} if strict is None else {"strict": strict})
    return {"type": "json_schema", "json_schema": spec}


@pytest.mark.parametrize("case", range(len(CASES)))
def test_closing_refuses_other_keys_and_nothing_the_schema_needs(case, lltok,
                                                                 tiny_tokenizer):
    schema, keep, refuse = CASES[case]
    before = json.dumps(schema)
    for value in keep + refuse:  # the cases themselves are right: all valid as written
        jsonschema.validate(value, schema)
    for strict in (True, None):
        for value in keep:
            assert accepts(lltok, tiny_tokenizer, schema_format(schema, strict), value), value
        for value in refuse:
            assert not accepts(lltok, tiny_tokenizer, schema_format(schema, strict), value), \
                value
    for value in keep + refuse:  # strict false: the schema's own reading, other keys too
        assert accepts(lltok, tiny_tokenizer, schema_format(schema, False), value), value
    assert json.dumps(schema) == before  # the request's own schema is left as it was


# "not" is a keyword the grammar library refuses; closing leaves what is under it alone
NEGATED = ({"type": "object", "properties": {"a": {"type": "integer"}},
            "not": {"properties": {"z": {"type": "integer"}}, "required": ["z"]}},
           [{"a": 1}], [{"a": 1, "q": 2}])


@pytest.mark.parametrize("case", range(len(CASES) + 1))
def test_a_closed_schema_accepts_only_what_the_schema_does(case):
    """What closing accepts validates against the schema as the user wrote it."""
    schema, keep, refuse = (CASES + [NEGATED])[case]
    tight = jsonschema.Draft202012Validator(closed(schema))
    loose = jsonschema.Draft202012Validator(schema)
    probes = keep + refuse + [{}, {"x": 1, "zz": 0}, {"a": "s"}, {"a": 1, "b": 2, "c": 3},
                              {"a": 1, "z": 2}, {"a": 1, "z": 2, "q": 3}]
    for value in probes:
        if tight.is_valid(value):
            assert loose.is_valid(value), value
    for value in keep:
        assert tight.is_valid(value), value


NODE = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize("schema", [
    # a definition reached by anchor, by a percent-encoded pointer, by an absolute URL
    {"$defs": {"node": {**NODE, "$anchor": "nd"}},
     "allOf": [{"$ref": "#nd"}, {"type": "object", "properties": {"b": {"type": "integer"}},
                                 "required": ["b"]}]},
    {"$defs": {"node": NODE}, "allOf": [
        {"$ref": "#/%24defs/node"},
        {"type": "object", "properties": {"b": {"type": "integer"}}, "required": ["b"]}]},
    {"$id": "https://example.com/root", "$defs": {"node": NODE}, "allOf": [
        {"$ref": "https://example.com/root#/$defs/node"},
        {"type": "object", "properties": {"b": {"type": "integer"}}, "required": ["b"]}]},
])
def test_a_ref_closing_cannot_follow_leaves_the_schema_as_written(schema):
    """Closing follows only pointers it can read; where a $ref names its schema another
    way, the strict schema is kept as written (no definition under allOf is closed), and
    an instance both branches judge passes."""
    before = json.dumps(schema)
    assert json.dumps(closed(schema)) == before
    fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": schema,
                                                   "strict": True}}
    Request(prompt="x", response_format=fmt)  # compiles: not refused as unsatisfiable
    assert jsonschema.Draft202012Validator(schema).is_valid({"a": 1, "b": 2})


@pytest.mark.parametrize("schema, says", [
    ({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
     "$ref cycle #/$defs/a -> #/$defs/b -> #/$defs/a"),
    ({"type": "object", "properties": {"n": {"$ref": "#/properties/n"}}},
     "$ref cycle #/properties/n -> #/properties/n"),
    ({"type": "object", "properties": {"big": {
        "type": "integer", "minimum": 10**19, "maximum": 10**19 + 9}}},
     "/properties/big/minimum: 10000000000000000000 is past 2**53"),
    ({"type": "integer", "maximum": -(2**53 + 2)}, "/maximum: -9007199254740994 is past 2**53"),
    # the library writes such integers rounded: 9007199254740993 came out ...992, "stop"
    ({"type": "object", "properties": {"id": {"const": 2**53 + 1}}, "required": ["id"]},
     "/properties/id/const: 9007199254740993 is past 2**53"),
    ({"enum": [1, "x", [2, {"a": -(10**19)}]]}, "/enum: -10000000000000000000 is past 2**53"),
    # no instance of finite size: every row would die at its first token on the worker
    ({"$defs": {"n": {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}},
                      "required": ["c"]}}, "$ref": "#/$defs/n"},
     "no JSON value of finite size matches it"),
    ({"$defs": {"n": {"type": "array", "minItems": 1, "items": {"anyOf": [
        {"$ref": "#/$defs/n"}, {"$ref": "#/$defs/m"}]}},
       "m": {"allOf": [{"$ref": "#/$defs/n"}]}}, "$ref": "#/$defs/n"},
     "no JSON value of finite size matches it"),
])
def test_schemas_no_output_could_honour_are_refused_naming_where(schema, says):
    """A $ref cycle leaves the grammar nothing to allow (the library takes it, and every
    row would fail on the worker); a numeric bound past 2**53 the library holds inexactly
    (it let 9223372036854775807 through a minimum of 10**19). Both refused where the
    request is read."""
    fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}
    with pytest.raises(ValueError, match="json_schema.schema: ") as err:
        Request(prompt="x", response_format=fmt)
    assert says in str(err.value)
    assert "grammar library refused" not in str(err.value)  # specq's own check, said once
    assert str(err.value).count("json_schema.schema") == 1
    # bounds the library holds exactly still compile
    Request(prompt="x", response_format={"type": "json_schema", "json_schema": {
        "name": "n", "schema": {"type": "integer", "minimum": -(2**53), "maximum": 2**53}}})


def test_a_stop_string_is_refused_beside_a_shaping_response_format():
    """A stop string would end a shaped output short of its grammar's end (and call the
    broken JSON a stop); beside a free one it stays."""
    for fmt in ({"type": "json_object"}, {"type": "choice", "choice": ["a", "b"]},
                {"type": "json_schema", "json_schema": {"name": "n", "schema": POINT}}):
        with pytest.raises(ValueError, match="stop: not with a response_format"):
            Request(prompt="x", stop=[","], response_format=fmt)
        Request(prompt="x", response_format=fmt)
    assert Request(prompt="x", stop=[","], response_format={"type": "text"}).stop == [","]


@pytest.mark.parametrize("schema", [
    # recursion with a way out: an optional property, an array that may be empty, a branch
    {"$defs": {"n": {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}}}},
     "$ref": "#/$defs/n"},
    {"$defs": {"n": {"type": "object", "required": ["c"], "properties": {
        "c": {"type": "array", "items": {"$ref": "#/$defs/n"}}}}}, "$ref": "#/$defs/n"},
    {"$defs": {"n": {"anyOf": [{"type": "string"}, {"type": "object", "required": ["c"],
                                                    "properties": {"c": {"$ref": "#/$defs/n"}}}]}},
     "$ref": "#/$defs/n"},
    {"type": "object", "properties": {"id": {"enum": [2**53, -(2**53), "12345678901234567890"]}}},
])
def test_schemas_with_finite_instances_and_exact_numbers_compile(schema):
    Request(prompt="x", response_format={"type": "json_schema", "json_schema": {
        "name": "n", "schema": schema}})


@pytest.mark.parametrize("strict", ["yes", "no", 1, 0, "true", None])
def test_strict_is_a_json_boolean(strict):
    fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "object"},
                                                   "strict": strict}}
    if strict is None:
        Request(prompt="x", response_format=fmt)
        return
    with pytest.raises(ValueError, match="strict"):
        Request(prompt="x", response_format=fmt)


def test_a_schema_nested_past_what_can_be_read_is_refused_plainly():
    deep: dict = {"type": "string"}
    for _ in range(200):
        deep = {"type": "object", "properties": {"a": deep}}
    with pytest.raises(ValueError, match="json_schema.schema: nested too deeply") as err:
        Request(prompt="x", response_format=schema_format(deep))
    assert "serializ" not in str(err.value)
