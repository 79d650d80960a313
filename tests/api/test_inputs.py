"""Reading prompts: each input shape becomes the same item row."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specq.api.inputs import InputError, JsonLine, normalise, open_source
from tests.conftest import DERANDOMIZE


def line(obj) -> JsonLine:
    return JsonLine(json.dumps(obj) + "\n")


def test_plain_prompts_and_message_lists():
    assert normalise("hello")["prompt"] == "hello"
    msgs = [{"role": "user", "content": "hi"}]
    assert normalise(msgs)["messages"] == msgs


def test_specq_line_with_its_own_parameters():
    row = normalise(line({"custom_id": "a", "prompt": "x", "temperature": 0.5, "stop": ["\n"]}))
    assert row == {"custom_id": "a", "prompt": "x", "messages": None,
                   "params": {"temperature": 0.5, "stop": ["\n"]}}


def test_openai_batch_line():
    row = normalise(line({
        "custom_id": "r1", "method": "POST", "url": "/v1/chat/completions",
        "body": {"model": "gpt-x", "messages": [{"role": "user", "content": "hi"}],
                 "max_tokens": 12, "temperature": 0.7, "top_p": 0.9, "stop": "END", "seed": 3},
    }))
    assert row["custom_id"] == "r1" and row["messages"][0]["content"] == "hi"
    assert row["params"] == {"max_new_tokens": 12, "temperature": 0.7, "top_p": 0.9,
                             "stop": ["END"], "seed": 3}


@pytest.mark.parametrize("obj, message", [
    ({"prompt": "x", "temprature": 1}, "temprature: unknown field"),
    ({"custom_id": "r", "url": "/v1/embeddings", "body": {"input": "x"}}, "url: must be one of"),
    ({"custom_id": "r", "body": {"messages": [], "logit_bias": {}}},
     "body.logit_bias: not supported"),
    ({"body": {"messages": []}}, "custom_id: required"),
    ([{"prompt": "a"}, {"prompt": "b"}], "one JSON object per line \\(JSONL\\), not an array"),
    ({"custom_id": "r", "body": {"messages": [], "temperature": 2.5}},
     "body.temperature: at most 2 in an OpenAI batch line"),
])
def test_bad_lines_name_the_field(obj, message):
    with pytest.raises(ValueError, match=message):
        normalise(line(obj))


def test_a_missing_file_is_named(tmp_path):
    with pytest.raises(InputError, match="nope.jsonl: file not found"):
        open_source(tmp_path / "nope.jsonl")


_TEXT = st.text(st.characters(blacklist_categories=[]), max_size=6)  # NUL, lone surrogates
_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-2**70, max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True) | _TEXT,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_TEXT, inner, max_size=4),
    max_leaves=20)


@settings(max_examples=300, deadline=None, derandomize=DERANDOMIZE)
@given(_JSON)
def test_the_fast_check_of_storable_values_agrees_with_the_full_walk(value):
    """`storable` skips its path-naming walk when `_fine` passes a value: on JSON's own
    types the two agree, so the walk runs exactly when there is a problem to name."""
    from specq.api.inputs import _fine, storable

    assert _fine(value) == (storable(value, "prompt") is None)


def test_a_pipe_is_read_once_as_standard_input_is(tmp_path):
    """`specq submit <(cmd)` names a pipe (/dev/fd/N), which can be read once: its lines are
    kept in memory (as "-" keeps standard input's), not refused as a file not found."""
    import os
    import threading

    fifo = tmp_path / "lines"
    os.mkfifo(fifo)

    def write() -> None:
        with open(fifo, "wb") as f:
            f.write(b'{"prompt": "a"}\n\n{"prompt": "b"}\n')

    writer = threading.Thread(target=write)
    writer.start()
    name, entries = open_source(str(fifo))
    writer.join()
    assert name == str(fifo)
    assert [normalise(raw)["prompt"] for _, raw in entries] == ["a", "b"]
    assert [normalise(raw)["prompt"] for _, raw in entries] == ["a", "b"]  # again: kept
