"""Bad input, generated: every reader (JSONL lines, OpenAI Batch lines, Python lists, CLI
flags, SPECQ_* settings) refuses it with one line naming the line and the field, and a
refused submission stores nothing (on SQLite for speed; on PostgreSQL, which is stricter
about text, for the text cases)."""

from __future__ import annotations

import json
import math
import os
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import func, select

from specq.api import cli
from specq.api.client import Client
from specq.api.formats import export
from specq.api.inputs import LINE_FIELDS, OPENAI_NOOPS, InputError
from specq.api.outputs import OutputError, check_output
from specq.configs.settings import Settings, get_settings
from specq.db.models import Item, Job
from specq.db.session import migrate
from specq.schema.generation import Request, SamplingParams
from tests.conftest import DERANDOMIZE

# BAD_INPUT_EXAMPLES=2000 pytest ... digs deeper than the default run.
FUZZ = settings(max_examples=int(os.environ.get("BAD_INPUT_EXAMPLES", 60)), deadline=None,
                derandomize=DERANDOMIZE,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])
GOOD = b'{"custom_id": "a", "prompt": "Fix: he go home"}\n'
ROLES = {"system", "developer", "user", "assistant", "tool", "function"}


# -- generated values ----------------------------------------------------------------------

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                                 max_size=3),
    max_leaves=6,
)
# What each field of a specq line may be; any other JSON type is wrong.
TYPES = {"custom_id": (str, int, type(None)), "prompt": (str,), "messages": (list,),
         "max_new_tokens": (int, type(None)), "temperature": (int, float), "top_p": (int, float),
         "top_k": (int,), "stop": (list,), "seed": (int, type(None))}
NUL = st.just("\x00")
SURROGATE = st.integers(0xD800, 0xDFFF).map(chr)
BEYOND_INT64 = st.integers(min_value=2**63) | st.integers(max_value=-(2**63) - 1)
NON_FINITE = st.sampled_from([math.nan, math.inf, -math.inf])


def around(bad: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    """Some text with ``bad`` somewhere in it."""
    return st.tuples(st.text(max_size=4), bad, st.text(max_size=4)).map("".join)


UNSTORABLE_TEXT = around(NUL | SURROGATE)
BAD_PROMPT = st.just("") | st.text(" \t\n\r", min_size=1, max_size=4) | UNSTORABLE_TEXT


USER, HI = st.just("user"), st.just("hi")


def message(role=USER, content=HI) -> st.SearchStrategy[dict]:
    return st.fixed_dictionaries({"role": role, "content": content})


BAD_MESSAGES = st.one_of(
    st.just([]),
    st.lists(JSON.filter(lambda v: not isinstance(v, dict)), min_size=1, max_size=2),
    message(role=st.text(max_size=10).filter(lambda r: r not in ROLES)).map(lambda m: [m]),
    message(role=JSON.filter(lambda v: not isinstance(v, str))).map(lambda m: [m]),
    message(content=UNSTORABLE_TEXT).map(lambda m: [m]),
    message(content=JSON.filter(lambda v: not isinstance(v, str))).map(lambda m: [m]),
    message(role=UNSTORABLE_TEXT).map(lambda m: [m]),
    st.builds(lambda k, v: [{"role": "user", "content": "hi", k: v}], UNSTORABLE_TEXT, JSON),
    st.builds(lambda v: [{"role": "user", "content": "hi", "name": v}],
              UNSTORABLE_TEXT | NON_FINITE | BEYOND_INT64),
    st.just([{"role": "user"}]),
)
BAD_STOP = st.one_of(
    st.lists(st.text(min_size=1, max_size=3), max_size=2).flatmap(
        lambda good: st.one_of(st.just(""), UNSTORABLE_TEXT, st.text(min_size=1001, max_size=1010),
                               JSON.filter(lambda v: not isinstance(v, str)))
        .map(lambda bad: [*good, bad])),
    st.lists(st.text(min_size=1, max_size=2), min_size=65, max_size=70),
)
OUT_OF_RANGE = {
    "custom_id": st.just("") | UNSTORABLE_TEXT | st.text(min_size=513, max_size=530)
    | BEYOND_INT64,
    "prompt": BAD_PROMPT,
    "messages": BAD_MESSAGES,
    "max_new_tokens": st.integers(max_value=0) | st.integers(min_value=2**31) | NON_FINITE,
    "temperature": st.floats(max_value=-1e-12) | st.integers(max_value=-1) | NON_FINITE
    | st.floats(min_value=1e6, exclude_min=True) | BEYOND_INT64,
    "top_p": st.floats(max_value=0.0, exclude_max=True)
    | st.floats(min_value=1.0, exclude_min=True) | st.integers(max_value=-1)
    | st.integers(min_value=2) | NON_FINITE,
    "top_k": st.integers(max_value=-1) | st.integers(min_value=2**31) | NON_FINITE,
    "stop": BAD_STOP,
    "seed": st.integers(max_value=-1) | st.integers(min_value=2**63) | NON_FINITE,
}


def bad_value(field: str) -> st.SearchStrategy:
    """A value ``field`` must refuse: a wrong JSON type, or the right type out of range."""
    return JSON.filter(lambda v: not isinstance(v, TYPES[field]) or isinstance(v, bool)) \
        | OUT_OF_RANGE[field]


@st.composite
def bad_field(draw, prompt: str) -> tuple[str, dict]:
    """(a field, an entry whose one problem is that field's value): ``prompt`` beside any
    field but the prompt and the messages."""
    field = draw(st.sampled_from(sorted(TYPES)))
    value = draw(bad_value(field))
    return field, ({field: value} if field in ("prompt", "messages")
                   else {"prompt": prompt, field: value})


@st.composite
def bad_specq_line(draw) -> tuple[str, bytes]:
    """(what the error must name, a JSONL line with exactly one thing wrong)."""
    kind = draw(st.sampled_from(["field", "field", "field", "utf8", "json", "unknown", "shape"]))
    if kind == "field":
        field, line = draw(bad_field("Fix: he go"))
        return field, json.dumps(line).encode()
    if kind == "utf8":
        junk = draw(st.binary(min_size=1, max_size=6).filter(
            lambda b: undecodable(b) and b"\n" not in b))
        return "UTF-8", b'{"prompt": "' + junk + b'"}'
    if kind == "json":
        text = '{"prompt": "Fix: he go", "seed": 1}'
        return "JSON", text[:draw(st.integers(1, len(text) - 1))].encode()
    if kind == "unknown":
        name = draw(st.from_regex(r"[a-z_]{1,12}", fullmatch=True).filter(
            lambda n: n not in LINE_FIELDS | {"body"}))
        return name, json.dumps({"prompt": "ok", name: 1}).encode()
    value = draw(JSON.filter(lambda v: not isinstance(v, (str, list, dict))))
    return "expected a prompt", json.dumps(value).encode()


def undecodable(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return True
    return False


OPENAI_BASE = {"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions",
               "body": {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                        "max_tokens": 4}}
BODY_FIELDS = {"max_tokens": "max_new_tokens", "max_completion_tokens": "max_new_tokens",
               "temperature": "temperature", "top_p": "top_p", "seed": "seed"}


def _asks_nothing(key: str, value) -> bool:
    return value is None or any(value == v and type(value) is type(v)
                                for v in OPENAI_NOOPS.get(key, ()))


@st.composite
def bad_openai_line(draw) -> tuple[str, bytes]:
    """(what the error must name, an OpenAI Batch request line with one thing wrong)."""
    line = json.loads(json.dumps(OPENAI_BASE))
    kind = draw(st.sampled_from(["top", "param", "param", "messages", "stop", "n",
                                 "unsupported"]))
    if kind == "top":
        field = draw(st.sampled_from(["custom_id", "method", "url", "body"]))
        if field == "custom_id":
            value = draw(st.none() | bad_value("custom_id").filter(lambda v: v is not None))
        elif field == "method":
            value = draw(JSON.filter(lambda v: v != "POST"))
        elif field == "url":
            value = draw(JSON.filter(lambda v: v not in ("/v1/chat/completions",
                                                          "/v1/completions")))
        else:
            value = draw(JSON.filter(lambda v: not isinstance(v, dict)))
        line[field] = value
        return field, json.dumps(line).encode()
    if kind == "param":
        key = draw(st.sampled_from(sorted(BODY_FIELDS)))
        # null is OpenAI's "not given": the default, not a problem
        line["body"][key] = draw(bad_value(BODY_FIELDS[key]).filter(lambda v: v is not None))
        return key, json.dumps(line).encode()
    if kind == "messages":
        line["body"]["messages"] = draw(bad_value("messages"))
        return "messages", json.dumps(line).encode()
    if kind == "stop":
        line["body"]["stop"] = draw(bad_value("stop").filter(
            lambda v: not isinstance(v, str) and v is not None) | st.just("") | UNSTORABLE_TEXT)
        return "stop", json.dumps(line).encode()
    if kind == "n":  # one choice per request is served; more is refused, not dropped
        line["body"]["n"] = draw(st.integers(min_value=2) | st.integers(max_value=0)
                                 | st.booleans() | st.floats() | st.text())
        return "body.n", json.dumps(line).encode()
    key = draw(st.sampled_from(["logit_bias", "tools", "response_format", "logprobs"]))
    # unsupported keys are refused at any value that asks for something (null and the
    # values that ask for nothing, such as "logprobs": false, are OpenAI's defaults);
    # response_format is supported, so only values it cannot be (a valid one is served)
    line["body"][key] = draw(JSON.filter(_not_a_response_format) if key == "response_format"
                             else JSON.filter(lambda v: not _asks_nothing(key, v)))
    return key, json.dumps(line).encode()


def _not_a_response_format(value: object) -> bool:
    if value is None:
        return False
    try:
        SamplingParams.model_validate({"response_format": value})
    except ValueError:
        return True
    return False


@st.composite
def bad_python_entry(draw) -> tuple[str, object]:
    """(what the error must name, a prompt entry a Client must refuse)."""
    kind = draw(st.sampled_from(["line", "line", "scalar", "object", "text", "keys", "deep"]))
    if kind == "line":
        return draw(bad_field("ok"))
    if kind == "scalar":
        return "expected a prompt", draw(st.none() | st.booleans() | st.integers() | st.floats()
                                         | st.tuples(st.text()) | st.binary())
    if kind == "object":
        return "not a JSON value", [{"role": "user", "content": "hi",
                                     "x": draw(st.sampled_from([object(), {1, 2}, 1j, b"b"]))}]
    if kind == "text":
        return "prompt", draw(BAD_PROMPT)
    if kind == "keys":
        key = draw(st.integers() | st.none() | st.tuples(st.integers()))
        return "keys must be strings", {"prompt": "ok", key: 1}
    cyclic: list = [{"role": "user", "content": "hi"}]
    cyclic[0]["name"] = cyclic
    deep: list = ["deep"]
    for _ in range(40):
        deep = [deep]
    return "nested", draw(st.sampled_from([cyclic, deep]))


# -- fixtures ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def lite(data_dir, tmp_path_factory):
    """A client on a SQLite file of this module (the tiny pair from the session's data_dir)."""
    db = tmp_path_factory.mktemp("lite") / "specq.db"
    return Client(Settings(database_url=f"sqlite:///{db}", data_dir=data_dir,
                           broker_url="redis://127.0.0.1:6379/15", queue_prefix="specq-unused"),
                  auto_migrate=True)


@pytest.fixture(scope="module")
def pg(data_dir, pg_url):
    return Client(Settings(database_url=pg_url, data_dir=data_dir,
                           broker_url="redis://127.0.0.1:6379/15", queue_prefix="specq-unused"),
                  auto_migrate=True)


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    return tmp_path_factory.mktemp("scratch")


def counts(client) -> tuple[int, int]:
    with client.sessions() as s:
        return (s.scalar(select(func.count()).select_from(Job)),
                s.scalar(select(func.count()).select_from(Item)))


def refused(client, source, **kwargs) -> InputError:
    """Submit ``source``; it must raise InputError and store nothing."""
    before = counts(client)
    with pytest.raises(InputError) as err:
        client.submit(source, pair="tiny", enqueue=False, **kwargs)
    assert counts(client) == before
    for problem in err.value.problems:
        assert "\n" not in problem and "Traceback" not in problem and problem.isprintable()
    return err.value


def only_problem(err: InputError, where: str, names: str) -> str:
    """The one problem of ``err``, which starts with ``where`` and mentions ``names``."""
    assert len(err.problems) == 1, err.problems
    problem = err.problems[0]
    assert problem.startswith(f"{where}: "), problem
    assert names.lower() in problem.lower(), (names, problem)
    assert len(str(err).splitlines()) == 1
    return problem


# -- the readers ---------------------------------------------------------------------------


def test_a_good_file_is_stored(lite, scratch):
    """The control: the lines around each bad one are good."""
    path = scratch / "good.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + GOOD + b'{"prompt": "\xc3\xa9t\xc3\xa9 \xf0\x9f\x98\x80"}\n')
    before = counts(lite)
    job = lite.submit(path, pair="tiny", enqueue=False)
    assert counts(lite) == (before[0] + 1, before[1] + 2)
    assert [i.custom_id for i in job.results()] == ["a", "request-1"]


@FUZZ
@given(case=bad_specq_line())
def test_a_bad_jsonl_line_is_named_and_nothing_is_stored(lite, scratch, case):
    names, line = case
    path = scratch / "bad.jsonl"
    path.write_bytes(GOOD + line + b"\n" + GOOD.replace(b'"a"', b'"b"'))
    only_problem(refused(lite, path), "line 2", names)


@FUZZ
@given(case=bad_openai_line())
def test_a_bad_openai_batch_line_is_named_and_nothing_is_stored(lite, scratch, case):
    names, line = case
    path = scratch / "batch.jsonl"
    good = json.dumps({**OPENAI_BASE, "custom_id": "r0"}).encode()
    path.write_bytes(good + b"\n" + line + b"\n")
    only_problem(refused(lite, path), "line 2", names)


def test_openai_n_above_one_is_refused_by_line_and_one_is_served(lite, scratch):
    path = scratch / "n.jsonl"
    lines = [{**OPENAI_BASE, "custom_id": f"r{i}", "body": {**OPENAI_BASE["body"], **extra}}
             for i, extra in enumerate([{"n": 1}, {"n": None}, {}, {"n": 3}])]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    problem = only_problem(refused(lite, path), "line 4", "body.n")
    assert "3 choices per request are not served" in problem
    path.write_text("".join(json.dumps(x) + "\n" for x in lines[:3]))
    assert lite.submit(path, pair="tiny", enqueue=False).status(check_workers=False).total == 3


def test_a_custom_id_an_unnamed_requests_result_gets_is_refused(lite, scratch):
    """An item without a custom_id is request-INDEX in every result; another item that
    names itself so would give two results one id. Refused, whichever comes first; the
    same id on the item of that index, or on none without, is fine."""
    for entries in ([{"prompt": "a", "custom_id": "request-1"}, "b"],
                    ["a", "b", {"prompt": "c", "custom_id": "request-1"}]):
        err = refused(lite, entries)
        assert len(err.problems) == 1 and "custom_id: 'request-1' is the id the results " \
            "give the input's request at index 1 (its request 2" in err.problems[0], \
            err.problems
    for entries in ([{"prompt": "a", "custom_id": "request-1"}, {"prompt": "b", "custom_id":
                                                                   "x"}],
                    ["a", {"prompt": "b", "custom_id": "request-1"}],
                    ["a", {"prompt": "b", "custom_id": "request-01"}]):
        assert lite.submit(entries, pair="tiny", enqueue=False).status(
            check_workers=False).total == 2


def test_the_python_api_refuses_odd_arguments_naming_them(lite):
    """Arguments the command line checks for itself, given from Python: an error naming
    the argument, never a TypeError, an overflow from the database or a bare number."""
    from specq.api.client import Job

    for limit, says in ((10**20, "limit: must be at most"), (-1, "limit: must be at least 1"),
                        ("3", "limit: must be an integer")):
        with pytest.raises(InputError, match=says):
            lite.jobs(limit=limit)
    refused(lite, ["Fix: he go home"], priority=["high"])
    with pytest.raises(KeyError, match="job 999999: not found") as gone:
        Job(lite, 999999).cancel()
    assert str(gone.value) == "job 999999: not found"  # its message, not a quoted key
    with pytest.raises(ValueError, match="poll: seconds between looks"):
        Job(lite, 1).wait(poll=-1)
    for timeout in ("1", -1, float("nan")):
        with pytest.raises(ValueError, match="timeout: seconds to wait at most, 0 or more"):
            Job(lite, 1).wait(timeout=timeout)
    for batch, says in ((-1, "batch: must be at least 1"), (0, "batch: must be at least 1"),
                        ("x", "batch: must be an integer")):
        with pytest.raises(InputError, match=says):
            Job(lite, 1).results(batch=batch)  # at the call, before any item is read


def test_openai_content_parts_of_text_are_served_and_others_refused_by_line(lite, scratch):
    """OpenAI's list of content parts, every part text: served as the texts joined by
    newlines (the request the same line with that string makes); an image part is refused,
    naming the line and the field."""
    path = scratch / "parts.jsonl"

    def with_content(cid: str, content) -> dict:
        return {**OPENAI_BASE, "custom_id": cid,
                "body": {**OPENAI_BASE["body"],
                         "messages": [{"role": "user", "content": content}]}}

    parts = [{"type": "text", "text": "Fix: he go"}, {"type": "text", "text": "home"}]
    path.write_text(json.dumps(with_content("p", parts)) + "\n"
                    + json.dumps(with_content("s", "Fix: he go\nhome")) + "\n")
    job = lite.submit(path, pair="tiny", enqueue=False)
    with lite.sessions() as s:
        stored = [row[0] for row in s.execute(
            select(Item.messages).where(Item.job_id == job.id).order_by(Item.index))]
    # stored as sent; the request the worker builds from each is the same
    built = [Request(messages=m).messages for m in stored]
    assert built[0] == built[1] and built[0][0].content == "Fix: he go\nhome"
    image = [{"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]
    path.write_text(json.dumps(with_content("p", parts)) + "\n"
                    + json.dumps(with_content("i", image)) + "\n")
    problem = only_problem(refused(lite, path), "line 2", "content")
    assert "only text parts" in problem
    calls = {**OPENAI_BASE, "custom_id": "t", "body": {**OPENAI_BASE["body"], "messages": [
        {"role": "user", "content": "add 1 and 2"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "c1", "type": "function", "function": {"name": "add", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "3"}]}}
    path.write_text(json.dumps(with_content("p", parts)) + "\n" + json.dumps(calls) + "\n")
    problem = only_problem(refused(lite, path), "line 2", "tool_calls")
    assert "tool calls are not served" in problem and "valid string" not in problem


@FUZZ
@given(case=bad_python_entry())
def test_a_bad_python_prompt_is_named_and_nothing_is_stored(lite, case):
    names, entry = case
    only_problem(refused(lite, ["Fix: he go home", entry]), "prompt 2", names)


@FUZZ
@given(field=st.sampled_from(sorted(set(TYPES) - {"custom_id", "prompt", "messages"}))
       .flatmap(lambda f: st.tuples(st.just(f), bad_value(f))))
def test_bad_job_sampling_parameters_are_named(lite, field):
    name, value = field
    err = refused(lite, ["Fix: he go home"], **{name: value})
    assert err.problems[0].startswith(f"sampling parameter {name}"), err.problems


@FUZZ
@given(size=st.integers(max_value=0) | st.integers(min_value=2**31) | st.booleans()
       | st.floats() | st.text(max_size=3) | st.lists(st.integers(), max_size=1))
def test_a_bad_chunk_size_is_refused_not_replaced(lite, size):
    only_problem(refused(lite, ["Fix: he go home"], chunk_size=size), "chunk_size", "chunk_size")


@pytest.mark.parametrize("source", [5, 1.5, None, b"prompts", {"prompt": "x"}, object()])
def test_a_source_that_is_neither_file_nor_list(lite, source):
    only_problem(refused(lite, source), "prompts", "expected a file path or a list")


@pytest.mark.parametrize("source", [{"a", "b"}, frozenset({"a"})])
def test_a_set_of_prompts_is_refused_for_having_no_order(lite, source):
    only_problem(refused(lite, source), "prompts", "has no order")


def test_an_openai_line_without_its_body_says_so(lite, scratch):
    path = scratch / "nobody.jsonl"
    path.write_text('{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions"}\n')
    assert refused(lite, path).problems == [
        "line 1: body: required in an OpenAI batch line (custom_id, method, url, body), the "
        "request's parameters"]


def test_file_problems_are_named(lite, scratch):
    assert "a directory" in only_problem(refused(lite, scratch), str(scratch), "directory")
    path = scratch / "latin1.jsonl"
    path.write_bytes(GOOD + '{"prompt": "café"}\n'.encode("latin-1") + b"\xff\xfe\n")
    err = refused(lite, path)
    assert err.problems == ["line 2: not valid UTF-8 (byte 0xe9 at byte 16 of the line)",
                            "line 3: not valid UTF-8 (byte 0xff at byte 1 of the line)"]


def test_json_too_deep_or_too_long_a_number(lite, scratch):
    path = scratch / "deep.jsonl"
    path.write_text(GOOD.decode() + "[" * 100_000 + "\n" + '{"prompt": "x", "seed": '
                    + "9" * 5000 + "}\n")
    err = refused(lite, path)
    assert err.problems[0].startswith("line 2: not valid JSON")
    assert err.problems[1].startswith("line 3: not valid JSON")


# -- PostgreSQL, stricter about text -------------------------------------------------------

STORED_TEXT_FIELDS = st.sampled_from(["prompt", "custom_id", "content", "role", "name", "key",
                                      "stop"])


def with_text(field: str, text: str) -> dict:
    """A specq line whose ``field`` holds ``text``."""
    msg = {"role": "user", "content": "hi"}
    if field == "prompt":
        return {"prompt": text}
    if field == "custom_id":
        return {"custom_id": text, "prompt": "ok"}
    if field == "stop":
        return {"prompt": "ok", "stop": ["\n", text]}
    if field == "key":
        return {"messages": [{**msg, text: "x"}]}
    return {"messages": [{**msg, field: text}]}


@FUZZ
@given(field=STORED_TEXT_FIELDS, text=UNSTORABLE_TEXT, as_file=st.booleans())
def test_postgresql_stores_nothing_for_unstorable_text(pg, scratch, field, text, as_file):
    line = with_text(field, text)
    if as_file:
        path = scratch / "pg.jsonl"
        path.write_bytes(GOOD + json.dumps(line).encode() + b"\n")
        where, source = "line 2", path
    else:
        where, source = "prompt 2", ["Fix: he go home", line]
    problem = only_problem(refused(pg, source), where, "")
    assert re.search(r"NUL character|lone surrogate", problem), problem


def test_postgresql_keeps_odd_but_valid_unicode(pg):
    odd = ["\uffff tail", "line\u2028sep", "e\u0301 \u202eRTL", "\x01\x1f ctrl", "😀" * 50,
           "\U0010ffff", "tab\there"]
    cid = "é" * 512
    job = pg.submit([{"custom_id": cid, "prompt": odd[0]}]
                    + [[{"role": "user", "content": t, "name": t}] for t in odd[1:]],
                    pair="tiny", enqueue=False, stop=["\u2028"])
    with pg.sessions() as s:
        items = s.scalars(select(Item).where(Item.job_id == job.id).order_by(Item.index)).all()
        assert items[0].prompt == odd[0] and items[0].custom_id == cid
        assert [it.messages[0]["content"] for it in items[1:]] == odd[1:]
        assert s.get(Job, job.id).params["stop"] == ["\u2028"]


def test_postgresql_job_ids_beyond_its_integer(pg):
    with pytest.raises(KeyError, match="job 2147483647: not found"):
        pg.job(2**31 - 1)


# -- the command line ----------------------------------------------------------------------


@pytest.fixture
def cli_env(monkeypatch, tmp_path, data_dir):
    """SPECQ_* of an empty SQLite database in tmp_path (the tiny pair from data_dir)."""
    for key in list(os.environ):
        if key.startswith("SPECQ_"):
            monkeypatch.delenv(key)
    monkeypatch.setenv("SPECQ_DATA_DIR", str(data_dir))
    monkeypatch.setenv("SPECQ_DATABASE_URL", f"sqlite:///{tmp_path / 'cli.db'}")
    migrate(f"sqlite:///{tmp_path / 'cli.db'}")
    monkeypatch.setenv("SPECQ_BROKER_URL", "redis://127.0.0.1:6379/15")
    monkeypatch.setenv("SPECQ_QUEUE_PREFIX", "specq-unused")
    get_settings.cache_clear()
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_bytes(GOOD)
    yield {"file": str(prompts), "db": tmp_path / "cli.db"}
    get_settings.cache_clear()


def run_cli(argv: list[str], capsys) -> tuple[int, list[str]]:
    """(exit code, stderr lines) of `specq ARGV` run in this process."""
    capsys.readouterr()
    try:
        code = cli.main(argv)
    except SystemExit as exc:
        code = exc.code
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return code, [line for line in err.splitlines() if line.strip()]


def jobs_stored(db) -> int:
    if not db.exists():
        return 0
    from sqlalchemy import create_engine

    engine = create_engine(f"sqlite:///{db}")
    try:
        with engine.connect() as conn:
            return conn.scalar(select(func.count()).select_from(Job))
    finally:
        engine.dispose()


def not_int(text: str) -> bool:
    try:
        int(text)
    except ValueError:
        return True
    return False


def not_float(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return True
    return False


def bad_int_text(low: int, high: int) -> st.SearchStrategy[str]:
    return (st.text(max_size=8).filter(not_int)
            | (st.integers(max_value=low - 1) | st.integers(min_value=high + 1)).map(str)
            | st.floats().map(repr))


def bad_float_text(low: float, inclusive: bool) -> st.SearchStrategy[str]:
    below = st.floats(max_value=low - 1e-9 if inclusive else low, allow_nan=False)
    return (st.text(max_size=8).filter(not_float) | NON_FINITE.map(str) | below.map(repr)
            | st.sampled_from(["nan", "NaN", "-inf", "Infinity", "1e999"]))


INT32 = 2**31 - 1
# (argv before the value, the flag as the message names it, bad values)
FLAGS = [
    (["run", "{file}", "--pair", "tiny", "--max-new-tokens="], "--max-new-tokens",
     bad_int_text(1, INT32)),
    (["submit", "{file}", "--pair", "tiny", "--chunk-size="], "--chunk-size",
     bad_int_text(1, INT32)),
    (["run", "{file}", "--pair", "tiny", "--chunk-size="], "--chunk-size", bad_int_text(1, INT32)),
    (["submit", "{file}", "--pair", "tiny", "--top-k="], "--top-k", bad_int_text(0, INT32)),
    (["run", "{file}", "--pair", "tiny", "--seed="], "--seed", bad_int_text(0, 2**63 - 1)),
    (["submit", "{file}", "--pair", "tiny", "--temperature="], "--temperature",
     bad_float_text(0.0, True)),
    (["run", "{file}", "--pair", "tiny", "--top-p="], "--top-p", bad_float_text(0.0, False)),
    (["status", "1", "--watch", "--interval="], "--interval", bad_float_text(0.0, False)),
    (["synth", "run", "{file}", "--timeout="], "--timeout", bad_float_text(0.0, False)),
    (["jobs", "--limit="], "--limit", bad_int_text(1, INT32)),
    (["synth", "runs", "nightly", "--limit="], "--limit", bad_int_text(1, INT32)),
    (["worker", "--pair", "tiny", "--loglevel="], "--loglevel",
     st.text(max_size=8).filter(lambda t: t.upper() not in
                                ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"))),
] + [
    (["bench", f"{flag}="], flag, bad_int_text(1, INT32))
    for flag in ("--prompts", "--max-new-tokens", "--repeat", "--threads", "--hf-lookup-tokens")
] + [
    (["bench-pipeline", f"{flag}="], flag, bad_int_text(1, INT32))
    for flag in ("--prompts", "--batch-size", "--chunk-size", "--submit-prompts")
] + [
    ([*command, "--"], "job", bad_int_text(1, INT32))
    for command in (["status"], ["cancel"], ["metrics"], ["report"], ["results"],
                    ["synth", "write"])
]


@FUZZ
@given(flag=st.sampled_from(FLAGS).flatmap(
    lambda f: st.tuples(st.just(f[0]), st.just(f[1]), f[2])))
def test_a_bad_flag_value_is_one_line_exit_2_and_stores_nothing(cli_env, capsys, flag):
    argv, name, value = flag
    argv = [a.format(**cli_env) for a in argv]
    if argv[-1].endswith("="):
        argv[-1] += value
    else:
        argv.append(value)
    code, lines = run_cli(argv, capsys)
    assert code == 2 and len(lines) == 1, (argv, lines)
    assert name in lines[0] or name.lstrip("-").replace("-", "_") in lines[0], lines
    assert jobs_stored(cli_env["db"]) == 0


@pytest.mark.parametrize("argv, message", [
    (["submit", "{file}", "--pair", "tiny", "--top-p", "1.5"], "top_p"),
    (["submit", "{file}", "--pair", "tiny", "--stop", ""], "stop"),
    (["submit", "{file}", "--pair", "no-such-pair"], "pair: unknown pair"),
    (["run", "{file}.missing", "--pair", "tiny"], "file not found"),
    (["status", "2147483647"], "job 2147483647: not found"),
])
def test_bad_values_the_flags_let_through_are_refused_later(cli_env, capsys, argv, message):
    code, lines = run_cli([a.format(**cli_env) for a in argv], capsys)
    assert code in (1, 2) and len(lines) == 1 and message in lines[0], lines
    assert jobs_stored(cli_env["db"]) == 0


def test_output_paths_that_cannot_be_written(cli_env, capsys, tmp_path):
    a_file = tmp_path / "a-file.txt"
    a_file.write_text("x")
    for output in (f"{a_file}/out.jsonl", f"{a_file}/deeper/out.jsonl", str(tmp_path), ""):
        for argv in (["results", "1", "-o", output], ["report", "1", "-o", output],
                     ["run", cli_env["file"], "--pair", "tiny", "-o", output]):
            code, lines = run_cli(argv, capsys)
            assert code == 2 and len(lines) == 1 and "--output" in lines[0], (argv, lines)
    assert jobs_stored(cli_env["db"]) == 0
    with pytest.raises(OutputError, match="Parquet needs a file"):
        check_output("-", "parquet")
    with pytest.raises(OutputError, match="a-file.txt is not a directory"):
        export(None, a_file / "x.parquet", "parquet")


def test_results_without_a_format_take_it_from_the_file_name(cli_env, capsys, tmp_path):
    """`specq results JOB -o out.parquet` writes Parquet (it wrote JSON lines into the
    .parquet file, saying nothing); any other name, and stdout, JSON lines."""
    job = Client().submit(["Fix: he go home", "Fix: she go home"], pair="tiny", enqueue=False)
    for name, head in (("out.parquet", b"PAR1"), ("OUT.PARQUET", b"PAR1"), ("out.jsonl", b"{"),
                       ("out.txt", b"{")):
        code, _ = run_cli(["results", str(job.id), "-o", str(tmp_path / name)], capsys)
        assert code == 0 and (tmp_path / name).read_bytes()[:4].startswith(head), name
    code, _ = run_cli(["results", str(job.id), "-o", str(tmp_path / "x.parquet"), "-f",
                       "jsonl"], capsys)
    assert code == 0 and (tmp_path / "x.parquet").read_bytes()[:1] == b"{"  # as told


# -- SPECQ_* settings ----------------------------------------------------------------------


def test_a_misspelt_flag_names_its_commands_help_and_the_flag_it_may_mean(cli_env, capsys):
    code, lines = run_cli(["results", "1", "--fromat", "parquet"], capsys)
    assert code == 2 and lines == ["specq results: error: unrecognized arguments: --fromat "
                                   "parquet; did you mean --format? (see specq results -h)"]
    code, lines = run_cli(["jobs", "--zzz"], capsys)
    assert code == 2 and lines == ["specq jobs: error: unrecognized arguments: --zzz (see "
                                   "specq jobs -h)"]


def test_a_misspelt_setting_is_named_not_silently_ignored(cli_env, capsys, caplog,
                                                          monkeypatch, tmp_path):
    """A SPECQ_ name that is no setting, in the environment or in .env, draws one warning
    with the setting it may mean; names read elsewhere (the engine's switches, docker
    compose's) draw none, and the command still runs."""
    monkeypatch.setenv("SPECQ_CHUNKSIZE", "3")
    monkeypatch.chdir(tmp_path)
    (tmp_path / ".env").write_text("SPECQ_CHUNK_SIZ=8\nSPECQ_PACKED_LINEAR=0\nSPECQ_BIND=0.0.0.0\n")
    code, _ = run_cli(["config"], capsys)
    assert code == 0
    assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == [
        "SPECQ_CHUNKSIZE (in the environment) is no setting of specq's and is ignored; did "
        "you mean SPECQ_CHUNK_SIZE?",
        "SPECQ_CHUNK_SIZ (in .env) is no setting of specq's and is ignored; did you mean "
        "SPECQ_CHUNK_SIZE?"]


def bound(field, kind: type) -> dict:
    """The numeric bounds (ge, gt, le, lt) of a Settings field."""
    out = {}
    for m in field.metadata:
        for name in ("ge", "gt", "le", "lt"):
            if getattr(m, name, None) is not None:
                out[name] = kind(getattr(m, name))
    return out


def bad_setting(name: str, tmp_text: str) -> st.SearchStrategy[str]:
    """Values SPECQ_<NAME> must refuse, derived from the field's type and bounds (so fields
    added later are fuzzed too), or given for the fields with their own validation."""
    field = Settings.model_fields[name]
    special = {
        "broker_url": st.text(max_size=10).filter(lambda t: "://" not in t),
        "database_url": st.text(min_size=1, max_size=10).filter(lambda t: "://" not in t)
        | st.sampled_from(["mysql://u@h/db", "redis://h/0", "oracle://x"]),
        "device": st.text(max_size=8).filter(
            lambda t: not re.fullmatch(r"auto|cpu|mps|cuda(:\d+)?", t)),
        "dtype": st.text(max_size=8).filter(
            lambda t: t not in ("auto", "float32", "bfloat16", "float16")),
        "queue_prefix": st.just("") | around(st.sampled_from([" ", "/", "*", "\n", "#"])),
        "worker_pair": st.just(""),
        "data_dir": st.just(tmp_text),
        "presets_file": st.just(tmp_text + ".missing") | st.just(os.path.dirname(tmp_text)),
    }
    if name in special:
        return special[name]
    kind = field.annotation
    if kind is int:
        b = bound(field, int)
        low = b.get("ge", b.get("gt", -(2**63)) + 1)
        high = b.get("le", b.get("lt", 2**63) - 1)
        return bad_int_text(low, high)
    if kind is float:
        b = bound(field, float)
        values = [st.text(max_size=8).filter(not_float),
                  st.sampled_from(["nan", "inf", "-inf", "1e999"])]
        if "ge" in b:
            values.append(st.floats(max_value=b["ge"], exclude_max=True).map(repr))
        if "gt" in b:
            values.append(st.floats(max_value=b["gt"]).map(repr))
        if "le" in b:
            values.append(st.floats(min_value=b["le"], exclude_min=True).map(repr))
        return st.one_of(values)
    return st.nothing()


ENV_SAFE = st.characters(exclude_categories=["Cs", "Cc"])  # os.environ takes no NUL


def env_text(strategy: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    return strategy.filter(lambda t: "\x00" not in t and t.encode("utf-8", "ignore").decode() == t)


FUZZED_SETTINGS = [n for n in sorted(Settings.model_fields)
                   if Settings.model_fields[n].annotation in (int, float)
                   or n in ("broker_url", "database_url", "device", "dtype", "queue_prefix",
                            "worker_pair", "data_dir", "presets_file")]


@FUZZ
@given(data=st.data())
def test_a_bad_environment_value_is_one_line_naming_the_variable(cli_env, capsys, monkeypatch,
                                                                 tmp_path, data):
    name = data.draw(st.sampled_from(FUZZED_SETTINGS))
    value = data.draw(env_text(bad_setting(name, cli_env["file"])))
    with monkeypatch.context() as env:
        env.setenv(f"SPECQ_{name.upper()}", value)
        get_settings.cache_clear()
        code, lines = run_cli(["jobs"], capsys)
    get_settings.cache_clear()
    assert code == 2 and len(lines) == 1, (name, value, lines)
    assert lines[0].startswith(f"error: SPECQ_{name.upper()}: "), lines
    if "url" in name:
        assert value not in lines[0] or len(value) < 3  # a URL may hold a password


def test_every_numeric_setting_is_fuzzed():
    numeric = {n for n, f in Settings.model_fields.items() if f.annotation in (int, float)}
    assert {"chunk_size", "max_batch_size", "visibility_timeout"} <= numeric
    assert numeric <= set(FUZZED_SETTINGS)


def test_files_named_by_settings_that_are_not_there(cli_env, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("SPECQ_SCHEDULES_FILE", str(tmp_path / "missing.yaml"))
    get_settings.cache_clear()
    code, lines = run_cli(["beat"], capsys)
    assert code == 2 and lines == [f"error: invalid schedules: {tmp_path}/missing.yaml: file not "
                                   f"found"]
    bad = tmp_path / "presets.yaml"
    for content in ("tiny: [1, 2]\n", "- a\n", "tiny: {target: }\n", "a: [\n"):
        bad.write_text(content)
        monkeypatch.setenv("SPECQ_PRESETS_FILE", str(bad))
        get_settings.cache_clear()
        code, lines = run_cli(["submit", cli_env["file"], "--pair", "tiny"], capsys)
        assert code == 2 and len(lines) == 1 and str(bad) in lines[0], lines
    assert jobs_stored(cli_env["db"]) == 0


def test_the_example_of_the_issue(cli_env, capsys, monkeypatch):
    monkeypatch.setenv("SPECQ_CHUNK_SIZE", "0")
    get_settings.cache_clear()
    assert run_cli(["jobs"], capsys) == (2, ["error: SPECQ_CHUNK_SIZE: must be at least 1, "
                                             "got '0'"])


def test_the_beat_refuses_to_start_with_a_schedule_whose_spec_is_bad(cli_env, capsys,
                                                                     monkeypatch, tmp_path):
    """A schedule's spec is checked as `specq synth check` checks it when the beat starts
    (a missing file, an undefined column), each named by its schedule: not found broken
    at its first firing. Nothing is exec'd."""
    from tests.api.conftest import spec_file

    good = tmp_path / "good"
    good.mkdir()
    undefined = tmp_path / "undefined"
    undefined.mkdir()
    typo = spec_file(undefined, template="About {{ topik }}")
    schedules = tmp_path / "schedules.yaml"
    schedules.write_text(f"gone: {{spec: nowhere.yaml, every: 5}}\n"
                         f"typo: {{spec: {typo}, every: 5}}\n"
                         f"fine: {{spec: {spec_file(good)}, every: 5}}\n")
    monkeypatch.setenv("SPECQ_SCHEDULES_FILE", str(schedules))
    get_settings.cache_clear()
    monkeypatch.setattr(os, "execv", lambda *a: pytest.fail("the beat was started"))
    assert cli.main(["beat"]) != 0
    err = capsys.readouterr().err
    assert "schedule gone: " in err and "nowhere.yaml: file not found" in err, err
    assert "schedule typo: " in err and "topik" in err, err
    assert "schedule fine" not in err


def test_the_runs_of_a_schedule_no_file_names_are_an_error_not_an_empty_table(cli_env,
                                                                               capsys):
    """`specq jobs --schedule NAME` of a typo: exit 2 naming the known schedules; a known
    schedule that has not fired yet: its (empty) table."""
    assert cli.main(["jobs", "--schedule", "exmaple-nightly"]) == 2
    err = capsys.readouterr().err
    assert "no such schedule" in err and "example-nightly" in err, err
    assert cli.main(["synth", "runs", "example-nightly"]) == 0
    assert "status" in capsys.readouterr().out


def test_reconcile_names_the_broker_it_cannot_reach_and_hides_its_password(cli_env, capsys,
                                                                           monkeypatch):
    monkeypatch.setenv("SPECQ_BROKER_URL", "redis://:s3cret@127.0.0.1:1/0")
    monkeypatch.setenv("SPECQ_BROKER_TIMEOUT", "1")
    get_settings.cache_clear()
    Client().submit(["a"], pair="tiny")  # stored; its send fails (a warning): in the queue
    assert cli.main(["reconcile"]) == 1
    err = capsys.readouterr().err
    assert "the broker at redis://:***@127.0.0.1:1/0 cannot be reached" in err, err
    assert "s3cret" not in err


def test_a_bad_argument_of_the_client_is_no_job_spec(lite):
    """A job id, a page's limit or a batch size out of range is an ArgumentError ("invalid
    argument: ..."), still an InputError for code that catches those."""
    from specq.api.inputs import ArgumentError

    job = lite.submit(["Fix: he go home"], pair="tiny", enqueue=False)
    for call, said in ((lambda: lite.job(0), "invalid argument: job: must be at least 1"),
                       (lambda: lite.jobs(limit=0), "invalid argument: limit: must be"),
                       (lambda: job.results(batch=0), "invalid argument: batch: must be"),
                       (lambda: lite.retry("x"), "invalid argument: job: must be an integer")):
        with pytest.raises(ArgumentError) as err:
            call()
        assert str(err.value).startswith(said) and isinstance(err.value, InputError)
