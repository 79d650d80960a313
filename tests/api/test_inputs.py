"""Reading prompts: each input shape becomes the same item row."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specq.api.inputs import InputError, JsonLine, normalise, open_source
from specq.api.server.batches import batch_errors
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
    ({"custom_id": "r", "body": {"messages": [], "logit_bias": {"50256": -100}}},
     "body.logit_bias: not supported"),
    ({"custom_id": "r", "body": {"messages": [], "logprobs": True}},
     "body.logprobs: not supported"),
    ({"custom_id": "r", "body": {"messages": [], "presence_penalty": 0.5}},
     "body.presence_penalty: not supported"),
    ({"custom_id": "r", "body": {"messages": None}}, "body.messages: required"),
    ({"custom_id": "r", "body": {"messages": [{"role": "user", "content": "x"}],
                                 "stop": ["a", ""]}},
     "body.stop: stop strings must not be empty"),
    ({"custom_id": "r", "body": {"messages": [{"role": "user", "content": "x"}],
                                 "max_completion_tokens": 0}},
     "body.max_completion_tokens: Input should be greater than or equal to 1"),
    ({"custom_id": "r", "body": {"messages": [{"role": "user", "content": "x"}],
                                 "response_format": {"type": "json_schema",
                                                     "json_schema": {"name": "p"}}}},
     "body.response_format.json_schema.schema: Field required"),
    ({"body": {"messages": []}}, "custom_id: required"),
    ([{"prompt": "a"}, {"prompt": "b"}], "one JSON object per line \\(JSONL\\), not an array"),
    ({"custom_id": "r", "body": {"messages": [], "temperature": 2.5}},
     "body.temperature: at most 2 in an OpenAI batch line"),
    ({"custom_id": "r", "body": {"messages": [], "max_tokens": 5, "max_completion_tokens": 6}},
     "body.max_completion_tokens: the same setting as body.max_tokens, which the line gives"),
    ({"custom_id": "r", "body": {"messages": []}, "extra": 1},
     "extra: unknown field of a request line"),
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


def test_an_openai_line_takes_openai_defaults_unless_the_job_gives_them():
    """What an OpenAI line leaves out, or sends as null, is OpenAI's default (sampled at
    temperature 1, no cap but the context), stored with the line's parameters; a job's
    parameters given explicitly go first; the values that ask for nothing are accepted;
    a problem found later names the line's own field."""
    from specq.api.inputs import parse_entries
    from specq.schema.generation import SamplingParams

    body = {"messages": [{"role": "user", "content": "hi"}]}
    lines = [{"custom_id": "a", "body": body},
             {"custom_id": "b", "body": {**body, "temperature": None, "max_tokens": None,
                                         "stop": None, "logprobs": False, "n": 1,
                                         "presence_penalty": 0, "frequency_penalty": 0.0,
                                         "tools": [], "logit_bias": None}},
             {"custom_id": "c", "body": {**body, "temperature": 0, "max_completion_tokens": 9}}]
    entries = [(f"line {i + 1}", line(obj)) for i, obj in enumerate(lines)]
    defaults = SamplingParams().model_dump()
    got = [e for _, e in parse_entries(entries, defaults)]
    assert [(e.request.temperature, e.request.max_new_tokens) for e in got] == [
        (1.0, None), (1.0, None), (0, 9)]
    assert got[0].row["params"] == {"temperature": 1.0, "max_new_tokens": None}
    assert got[2].names == {"max_new_tokens": "max_completion_tokens"}
    job = [e for _, e in parse_entries(entries, {**defaults, "temperature": 0.0,
                                                 "max_new_tokens": 32},
                                       frozenset({"temperature", "max_new_tokens"}))]
    assert [(e.request.temperature, e.request.max_new_tokens) for e in job] == [
        (0.0, 32), (0.0, 32), (0, 9)]
    assert job[0].row["params"] is None


def test_the_http_door_names_each_bad_field_as_the_line_holds_it():
    """A batch error's param is the line's own field: a top-level one as it is, a body's
    under body., and no message speaks of specq's own names (max_new_tokens)."""
    cases = [({"extra": 1}, "extra"), ({"body": {"messages": [], "x_y": 1}}, "body.x_y"),
             ({"body": {"messages": [], "max_tokens": 5, "max_completion_tokens": 6}},
              "body.max_completion_tokens"), ({"x": float("nan")}, "x"),
             ({"y": float("inf")}, "y"), ({"body": {"messages": [], "top_p": -1}},
                                          "body.top_p"),
             ({"body": {"messages": [], "temperature": float("nan")}}, "body.temperature")]
    for over, param in cases:
        obj = {"custom_id": "r", "method": "POST", "url": "/v1/chat/completions",
               "body": {"messages": []}, **over}
        with pytest.raises(ValueError) as exc:
            normalise(line(obj))
        (error,) = batch_errors(InputError([f"line 3: {exc.value}"]), "/v1/chat/completions")
        assert (error["line"], error["param"]) == (3, param), error
        assert error["message"].startswith(f"{param}: ") and "max_new" not in error["message"]


def test_store_asks_for_nothing_and_is_served():
    for store in (True, False):
        row = normalise(line({"custom_id": "r", "body": {
            "messages": [{"role": "user", "content": "x"}], "store": store}}))
        assert row["params"] is None


def test_fields_that_change_nothing_the_model_writes_are_served():
    """Who asks, OpenAI's caching and tiers, values that ask for nothing: accepted, no
    parameter set; top_p 0 is a parameter (the likeliest token alone)."""
    body = {"safety_identifier": "u-1", "prompt_cache_key": "k", "service_tier": "flex",
            "metadata": {"a": "b"}, "modalities": ["text"], "echo": False, "best_of": 1}
    for url, kind, prompt in (("/v1/chat/completions", "messages",
                               [{"role": "user", "content": "x"}]),
                              ("/v1/completions", "prompt", "x")):
        row = normalise(line({"custom_id": "r", "url": url, "body": {kind: prompt, **body}}))
        assert row["params"] is None
    row = normalise(line({"custom_id": "r", "url": "/v1/completions",
                          "body": {"prompt": "x", "top_p": 0}}))
    assert row["params"] == {"top_p": 0}
    for prompt in (["a", "b"], [1, 2, 3]):
        with pytest.raises(ValueError, match="body.prompt: one prompt string per request"):
            normalise(line({"custom_id": "r", "url": "/v1/completions",
                            "body": {"prompt": prompt}}))
    for asks in ({"echo": True}, {"best_of": 3}, {"modalities": ["text", "audio"]}):
        with pytest.raises(ValueError, match=f"body.{next(iter(asks))}: not supported"):
            normalise(line({"custom_id": "r", "url": "/v1/completions",
                            "body": {"prompt": "x", **asks}}))


def test_a_file_that_is_plainly_not_jsonl_says_what_it_is(tmp_path):
    """Parquet (a synthesis seed format), gzip, zip, UTF-16: one problem naming what the
    file is, not a line of "not valid UTF-8" per binary line."""
    import gzip

    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"prompt": ["a", "b"]}), tmp_path / "p.parquet")
    (tmp_path / "p.jsonl.gz").write_bytes(gzip.compress(b'{"prompt": "a"}\n' * 50))
    (tmp_path / "u16.jsonl").write_text('{"prompt": "a"}\n{"prompt": "b"}\n', "utf-16")
    for name, says in (("p.parquet", "a Parquet file, not JSON lines"),
                       ("p.jsonl.gz", "gzip-compressed: decompress it first"),
                       ("u16.jsonl", "UTF-16 text")):
        _, entries = open_source(tmp_path / name)
        ((where, bad),) = list(entries)
        assert where == "line 1" and says in bad


def test_an_object_expected_is_said_in_json_words_not_a_class_name():
    """pydantic's "a valid dictionary or instance of Message" names a class no user wrote."""
    from pydantic import ValidationError

    from specq.schema.errors import describe
    from specq.schema.generation import Request

    with pytest.raises(ValidationError) as exc:
        Request(messages=[1, "x"])
    assert describe(exc.value) == ["messages[0]: must be a JSON object, got a number",
                                   "messages[1]: must be a JSON object, got a string"]
