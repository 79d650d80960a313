"""The fast path for plain prompts (api/inputs.py: plain_row) accepts and refuses exactly what
the full path (normalise, then Request) does, and gives the same rows, requests and
problems; generated entries come as JSONL lines and as Python values."""

from __future__ import annotations

import json
import os

from hypothesis import given, settings
from hypothesis import strategies as st

from specq.api.inputs import (
    MAX_CUSTOM_ID,
    Entry,
    JsonLine,
    Refused,
    _Problem,
    parse_entries,
    plain_row,
    read_entry,
)
from specq.schema.generation import Request
from tests.conftest import DERANDOMIZE

EXAMPLES = settings(max_examples=int(os.environ.get("BAD_INPUT_EXAMPLES", 300)), deadline=None,
                    derandomize=DERANDOMIZE)

BAD_CHAR = st.sampled_from(["\x00", "\ud800", "\udfff"])
TEXT = st.one_of(
    st.text(max_size=8),
    st.text(" \t\n\r\u3000\x0b", max_size=3),  # blank, by str.strip's reckoning
    st.tuples(st.text(max_size=3), BAD_CHAR, st.text(max_size=3)).map("".join),
)
CUSTOM_ID = st.one_of(
    st.none(), TEXT, st.integers(), st.booleans(), st.floats(), st.lists(st.integers(), max_size=1),
    st.integers(MAX_CUSTOM_ID - 2, MAX_CUSTOM_ID + 2).map(lambda n: "é" * n),
)
SCALAR = st.none() | st.booleans() | st.integers() | st.floats() | TEXT


class Text(str):
    """A str subclass: Python callers may pass one; the fast path leaves it to the full one."""


class Alias:
    """A key that a dict finds as "prompt", but no string: the full path refuses it."""

    def __hash__(self) -> int:
        return hash("prompt")

    def __eq__(self, other: object) -> bool:
        return other == "prompt"


ENTRY = st.one_of(
    TEXT,
    TEXT.map(Text),
    st.fixed_dictionaries({"prompt": TEXT}, optional={"custom_id": CUSTOM_ID}),
    st.fixed_dictionaries({"custom_id": CUSTOM_ID}, optional={"prompt": SCALAR}),
    st.fixed_dictionaries({"prompt": TEXT | TEXT.map(Text)},
                          optional={"custom_id": CUSTOM_ID | TEXT.map(Text)}),
    st.dictionaries(st.sampled_from(["prompt", "custom_id", "messages", "temperature", "seed",
                                     "stop", "body", "x"]), SCALAR, max_size=3),
    st.builds(lambda p: {Text("prompt"): p}, TEXT),
    st.builds(lambda p: {Alias(): p}, TEXT),
    st.lists(SCALAR, max_size=2),
    SCALAR,
)
DEFAULTS = st.sampled_from([
    {}, {"max_new_tokens": 1}, {"temperature": 0.5, "stop": ["\n"], "seed": 3},
    {"temperature": -1.0},  # a bad default: every entry is refused, by the full path
])


def as_line(value) -> JsonLine:
    return JsonLine(json.dumps(value) + "\n")


def full_entries(raw_entries, defaults):
    """parse_entries without its fast path: every entry read in full."""
    for index, (where, raw) in enumerate(raw_entries):
        yield where, read_entry(index, where, raw, defaults)


def same(got, want) -> None:
    assert len(got) == len(want)
    for (where, g), (where2, w) in zip(got, want):
        assert where == where2
        assert type(g) is type(w), (where, g, w)
        if isinstance(w, Refused):
            assert g == w
        else:
            assert g.row == w.row
            assert type(g.request) is Request
            assert g.request.model_dump() == w.request.model_dump()
            assert g.request.model_fields_set == w.request.model_fields_set


def outcome(read, raw):
    """What ``read(raw)`` returns, or the problem it names."""
    try:
        return read(raw)
    except _Problem as exc:
        return ("problem", str(exc))


@EXAMPLES
@given(entries=st.lists(ENTRY, min_size=1, max_size=6), defaults=DEFAULTS,
       as_file=st.booleans())
def test_parse_entries_is_the_full_path(entries, defaults, as_file):
    if as_file:
        entries = [e for e in entries if type(e) is not Text
                   and not (isinstance(e, dict) and any(type(k) is not str for k in e))]
        raw = [(f"line {i + 1}", as_line(e)) for i, e in enumerate(entries)]
    else:
        raw = [(f"prompt {i + 1}", e) for i, e in enumerate(entries)]
    same(list(parse_entries(raw, defaults)), list(full_entries(raw, defaults)))


@EXAMPLES
@given(prompt=TEXT, custom_id=st.none() | TEXT, as_file=st.booleans())
def test_every_good_plain_prompt_takes_the_fast_path(prompt, custom_id, as_file):
    """Not only correct but used: what the full path accepts of this shape, plain_row does."""
    line = {"prompt": prompt} if custom_id is None else {"custom_id": custom_id,
                                                          "prompt": prompt}
    value = json.loads(as_line(line)) if as_file else line
    want = list(full_entries([("line 1", value)], {}))[0][1]
    assert (plain_row(value) is not None) == isinstance(want, Entry)
    want = list(full_entries([("prompt 1", prompt)], {}))[0][1]
    assert (plain_row(prompt) is not None) == isinstance(want, Entry)


def test_the_lines_of_a_big_job_take_it():
    line = as_line({"custom_id": "big-7", "prompt": "Label the sentiment of review 7: fine"})
    assert plain_row(json.loads(line)) == {"custom_id": "big-7", "messages": None,
                                           "params": None,
                                           "prompt": "Label the sentiment of review 7: fine"}
    assert plain_row("Fix: he go home") is not None
    for other in ({"prompt": "x", "seed": 1}, {"messages": [{"role": "user", "content": "x"}]},
                  {"custom_id": 7, "prompt": "x"}, {"prompt": " "}, {"prompt": "a\x00"}):
        assert plain_row(other) is None
