"""Exports of jobs whose lines mix shapes: prompts and messages, each line's own
response_format and parameters, message fields of any JSON type. Every format writes every
item, the submitted lines can be rebuilt from JSONL and Parquet rows, and a failed export
leaves no file (not an empty one)."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import update

from specq.api.client import Client
from specq.api.formats import export, infer_schema, result_schema
from specq.configs.settings import Settings
from specq.db.models import Item

text = st.text(st.characters(blacklist_categories=("Cs", "Cc")), min_size=1, max_size=12
               ).filter(str.strip)
json_value = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**63 - 1) | text
    | st.floats(allow_nan=False, allow_infinity=False),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(text, inner, max_size=3),
    max_leaves=6)
message = st.builds(lambda role, content, extra: {"role": role, "content": content, **extra},
                    st.sampled_from(["system", "user", "assistant"]), text,
                    st.dictionaries(st.sampled_from(["name", "tag", "meta"]), json_value,
                                    max_size=2))
response_format = st.sampled_from([
    {"type": "text"},
    {"type": "json_object"},
    {"type": "regex", "regex": "[a-c]{1,4}"},
    {"type": "choice", "choice": ["yes", "no"]},
    {"type": "json_schema", "json_schema": {"name": "n", "schema": {
        "type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}}},
])
params = st.fixed_dictionaries({}, optional={
    "max_new_tokens": st.integers(1, 64),
    "temperature": st.sampled_from([0, 0.0, 0.7, 1.5]),
    "top_p": st.sampled_from([0.5, 1.0, 1]),
    "top_k": st.integers(0, 50),
    "stop": st.lists(text, max_size=2),
    "seed": st.integers(0, 2**63 - 1),
    "response_format": response_format,
})
def _line(body: dict, p: dict) -> dict:
    """A line; its stop strings dropped where a response_format shapes it (refused)."""
    if p.get("response_format", {}).get("type", "text") != "text":
        p = {k: v for k, v in p.items() if k != "stop"}
    return {**body, **p}


line = st.builds(_line,
                 st.one_of(st.fixed_dictionaries({"prompt": text}),
                           st.fixed_dictionaries({"messages": st.lists(message, min_size=1,
                                                                       max_size=3)})),
                 params)
outcome = st.sampled_from([
    {"status": "completed", "output": '{"n": 1}', "finish_reason": "stop", "new_tokens": 4,
     "proposed": 6, "accepted": 3, "draft_steps": 2},
    {"status": "completed", "output": "", "finish_reason": "length", "new_tokens": 0},
    {"status": "failed", "error": "engine said no"},
    {"status": "pending"},
])


def rebuilt(row: dict) -> dict:
    """The input line an exported row stands for, without its id."""
    line = {key: row[key] for key in ("prompt", "messages") if row[key] is not None}
    line.update({k: v for k, v in (row["params"] or {}).items() if v is not None})
    return line


@pytest.fixture(scope="module")
def client(data_dir, tmp_path_factory):
    url = f"sqlite:///{tmp_path_factory.mktemp('shapes') / 'specq.db'}"
    return Client(Settings(database_url=url, data_dir=data_dir, chunk_size=4,
                           broker_url="redis://127.0.0.1:6379/15", queue_prefix="specq-unused"),
                  auto_migrate=True)


@settings(max_examples=25, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(lines=st.lists(line, min_size=1, max_size=6), outcomes=st.data())
def test_every_format_writes_any_mix_of_lines(client, tmp_path, lines, outcomes):
    job = client.submit(lines, pair="tiny", enqueue=False)
    with client.sessions.begin() as s:
        for i in range(len(lines)):
            s.execute(update(Item).where(Item.job_id == job.id, Item.index == i)
                      .values(**outcomes.draw(outcome)))

    out = tmp_path / f"job{job.id}"
    assert export(job, f"{out}.jsonl") == len(lines)
    rows = [json.loads(x) for x in open(f"{out}.jsonl", encoding="utf-8")]
    assert [rebuilt(r) for r in rows] == lines

    assert export(job, f"{out}.parquet", "parquet") == len(lines)
    table = pq.read_table(f"{out}.parquet")
    assert table.schema.equals(result_schema())
    back = table.to_pylist()
    for r in back:
        r["messages"] = None if r["messages"] is None else json.loads(r["messages"])
        if r["params"] and r["params"]["response_format"] is not None:
            r["params"]["response_format"] = json.loads(r["params"]["response_format"])
    assert [rebuilt(r) for r in back] == [rebuilt(r) for r in rows]

    assert export(job, f"{out}.openai.jsonl", "openai") == len(lines)
    answers = [json.loads(x) for x in open(f"{out}.openai.jsonl", encoding="utf-8")]
    assert [a["custom_id"] for a in answers] == [r["custom_id"] for r in rows]
    assert all((a["response"] is None) != (a["error"] is None) for a in answers)
    assert not list(tmp_path.glob(".*.part"))


@settings(max_examples=60, deadline=None, derandomize=True)
@given(rows=st.lists(st.dictionaries(st.sampled_from("abcd"), json_value, max_size=4),
                     min_size=1, max_size=8))
def test_inferred_columns_take_any_values(tmp_path_factory, rows):
    """A schema inferred from rows of any shapes holds every one of them: typed where the
    values agree, JSON text where they do not (each value its JSON, strings too, so the
    text "3" and the number 3 read back apart)."""
    from specq.api.formats import ParquetSink, write_batches

    path = tmp_path_factory.mktemp("inferred") / "x.parquet"
    assert write_batches(ParquetSink(path, infer_schema(rows)), rows, batch=3) == len(rows)
    table = pq.read_table(path)
    json_text = {f.name for f in table.schema if (f.metadata or {}).get(b"specq") == b"json"}
    for got, want in zip(table.to_pylist(), rows):
        for key, value in want.items():
            kept = got[key]
            if key in json_text and kept is not None:
                kept = json.loads(kept)
            assert kept == value or (isinstance(value, int) and float(value) == kept)
            assert type(kept) is type(value) or isinstance(value, int) and \
                isinstance(kept, float) or value is None


def test_a_failed_export_leaves_no_file(client, tmp_path):
    """A row that fits no column stops the export: the error names the column, and neither
    the file nor a part of it is left (an earlier file of that name is kept as it was)."""
    import pyarrow as pa

    from specq.api.formats import ParquetSink, write_batches

    path = tmp_path / "x.parquet"
    schema = pa.schema([("n", pa.int64())])
    with pytest.raises(ValueError, match="column n"):
        write_batches(ParquetSink(path, schema), [{"n": 1}, {"n": "two"}], batch=1)
    assert list(tmp_path.iterdir()) == []

    path.write_text("before")
    with pytest.raises(ValueError, match="column n"):
        write_batches(ParquetSink(path, schema), [{"n": "two"}])
    assert path.read_text() == "before" and list(tmp_path.iterdir()) == [path]
