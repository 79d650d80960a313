"""Reading prompts: each input shape becomes the same item row."""

from __future__ import annotations

import json

import pytest

from specq.api.inputs import InputError, JsonLine, normalise, open_source


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
])
def test_bad_lines_name_the_field(obj, message):
    with pytest.raises(ValueError, match=message):
        normalise(line(obj))


def test_a_missing_file_is_named(tmp_path):
    with pytest.raises(InputError, match="nope.jsonl: file not found"):
        open_source(tmp_path / "nope.jsonl")
