"""Result formats: an OpenAI Batch request file in, OpenAI Batch output lines out (parsed with
the openai package's own types), JSONL and Parquet; and exports that stream."""

from __future__ import annotations

import json
import tracemalloc
from functools import lru_cache

import pyarrow.parquet as pq
from openai.types import Completion
from openai.types.chat import ChatCompletion
from pydantic import BaseModel
from sqlalchemy import update

from specq.api.formats import JsonlSink, export, json_line, result_schema
from specq.configs.presets import get_preset
from specq.db import repository as repo
from specq.db.models import Item
from specq.worker.pairs import load_pair
from specq.worker.tasks import run_inline


class BatchError(BaseModel):
    code: str
    message: str


class BatchResponse(BaseModel):
    status_code: int
    request_id: str
    body: dict


class BatchOutputLine(BaseModel):
    """One line of an OpenAI Batch output file, as OpenAI documents it."""

    id: str
    custom_id: str
    response: BatchResponse | None
    error: BatchError | None


@lru_cache(maxsize=1)
def tiny_engine(data_dir: str):
    from specq.configs.settings import Settings

    return load_pair(get_preset("tiny"), Settings(data_dir=data_dir)).engine()


def openai_requests(path) -> list[str]:
    lines = []
    for i in range(6):
        if i % 2:
            body = {"model": "tiny", "prompt": f"Count to {i}:", "max_tokens": 5,
                    "temperature": 0.7, "top_p": 0.9, "seed": i, "stop": "\n\n"}
            url = "/v1/completions"
        else:
            body = {"model": "tiny", "messages": [{"role": "system", "content": "Be brief."},
                                                  {"role": "user", "content": f"Say {i}"}],
                    "max_tokens": 6, "temperature": 0, "stop": ["zzz"]}
            url = "/v1/chat/completions"
        lines.append(json.dumps({"custom_id": f"req-{i}", "method": "POST", "url": url,
                                 "body": body}))
    path.write_text("\n".join(lines) + "\n")
    return [f"req-{i}" for i in range(6)]


def test_openai_batch_round_trip(db_client, tmp_path):
    ids = openai_requests(tmp_path / "batch.jsonl")
    job = db_client.submit(str(tmp_path / "batch.jsonl"), pair="tiny", enqueue=False)
    with db_client.sessions() as s:
        items = list(repo.iter_items(s, job_id=job.id))
    assert items[1].params == {"max_new_tokens": 5, "temperature": 0.7, "top_p": 0.9,
                               "seed": 1, "stop": ["\n\n"]}
    assert items[0].messages[0]["role"] == "system" and items[1].prompt == "Count to 1:"
    run_inline(sessions=db_client.sessions, engine=tiny_engine(str(db_client.settings.data_dir)),
               pair="tiny", job_id=job.id, progress=False)

    out = tmp_path / "out" / "batch_output.jsonl"
    assert export(job, out, "openai") == 6
    lines = [BatchOutputLine.model_validate_json(x) for x in out.read_text().splitlines()]
    assert sorted(x.custom_id for x in lines) == sorted(ids)  # each exactly once
    assert len({x.id for x in lines}) == 6
    for x in lines:
        assert x.error is None and x.response.status_code == 200
        n = int(x.custom_id.split("-")[1])
        if n % 2:
            body = Completion.model_validate(x.response.body)
            assert body.object == "text_completion" and body.choices[0].text is not None
            choice = body.choices[0]
        else:
            body = ChatCompletion.model_validate(x.response.body)
            assert body.object == "chat.completion"
            choice = body.choices[0]
            assert choice.message.role == "assistant"
        assert choice.finish_reason in ("stop", "length")
        assert body.model == "tiny" and body.usage.completion_tokens >= 1
        assert body.usage.total_tokens == body.usage.prompt_tokens + body.usage.completion_tokens

    # A failed item comes back as an error line with its custom_id, no response.
    with db_client.sessions.begin() as s:
        s.execute(update(Item).where(Item.job_id == job.id, Item.index == 2)
                  .values(status="failed", error="engine said no"))
    export(job, out, "openai")
    failed = [BatchOutputLine.model_validate_json(x) for x in out.read_text().splitlines()][2]
    assert failed.custom_id == "req-2" and failed.response is None
    assert failed.error.message == "engine said no"

    assert export(job, tmp_path / "r.jsonl", "jsonl") == 6
    first = json.loads((tmp_path / "r.jsonl").read_text().splitlines()[0])
    assert first["custom_id"] == "req-0" and "counters" in first

    assert export(job, tmp_path / "r.parquet", "parquet") == 6
    table = pq.read_table(tmp_path / "r.parquet")
    assert table.schema.equals(result_schema()) and table.num_rows == 6
    assert table.column("custom_id").to_pylist() == ids


def test_exports_stream(db_client, tmp_path):
    """20,000 items export in row groups of 1,000 while the memory peak stays far below what
    holding them all would take (their outputs alone are ~20 MB of text)."""
    n = 20_000
    with db_client.sessions.begin() as s:
        job = repo.create_job(s, pair="tiny", params={}, chunk_size=1000, source=None)
        rows = ({"index": i, "custom_id": f"c{i}", "prompt": "p", "messages": None,
                 "params": None, "status": "completed", "output": "x" * 1000,
                 "finish_reason": "length", "new_tokens": 8} for i in range(n))
        repo.insert_items(s, job_id=job.id, rows=rows)
        job.total, job.status = n, "completed"
    handle = db_client.job(job.id)
    for fmt in ("parquet", "openai"):
        tracemalloc.start()
        assert export(handle, tmp_path / f"big.{fmt}", fmt) == n
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert peak < 12e6, f"{fmt}: peak {peak / 1e6:.1f} MB"
    meta = pq.ParquetFile(tmp_path / "big.parquet").metadata
    assert meta.num_rows == n and meta.num_row_groups == n // 1000


SUBMITTED = [
    {"prompt": "Plain one"},
    {"custom_id": "with-params", "prompt": "Count:", "max_new_tokens": 3, "temperature": 0.5,
     "top_p": 0.9, "top_k": 4, "stop": ["\n", "zz"], "seed": 2**62},
    {"messages": [{"role": "system", "content": "Be brief."},
                  {"role": "user", "content": "Hi \u00e9\U0001f600", "name": "ann"}],
     "temperature": 0},
    {"custom_id": "7", "prompt": "Only a seed", "seed": 0},
]


def rebuilt(row: dict) -> dict:
    """The input line an exported row stands for (its id given back only where one was)."""
    line = {} if row["custom_id"].startswith("request-") else {"custom_id": row["custom_id"]}
    for key in ("prompt", "messages"):
        if row[key] is not None:
            line[key] = row[key]
    line.update({k: v for k, v in (row["params"] or {}).items() if v is not None})
    return line


def test_exports_round_trip_the_input(db_client, tmp_path):
    """JSONL and Parquet rows carry the prompt or messages and the line's own parameters: the
    submitted lines can be rebuilt from either; --no-input leaves them out."""
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in SUBMITTED), encoding="utf-8")
    job = db_client.submit(str(path), pair="tiny", enqueue=False, max_new_tokens=8)

    assert export(job, tmp_path / "r.jsonl") == 4
    rows = [json.loads(x) for x in (tmp_path / "r.jsonl").read_text("utf-8").splitlines()]
    assert [rebuilt(r) for r in rows] == SUBMITTED
    assert rows[0]["custom_id"] == "request-0" and rows[0]["params"] is None

    assert export(job, tmp_path / "r.parquet", "parquet") == 4
    table = pq.read_table(tmp_path / "r.parquet")
    assert table.schema.equals(result_schema())
    back = table.to_pylist()
    for r in back:
        r["messages"] = None if r["messages"] is None else json.loads(r["messages"])
    assert [rebuilt(r) for r in back] == SUBMITTED

    assert export(job, tmp_path / "lean.jsonl", input=False) == 4
    lean = json.loads((tmp_path / "lean.jsonl").read_text().splitlines()[1])
    assert not {"prompt", "messages", "params"} & set(lean) and lean["custom_id"] == "with-params"
    export(job, tmp_path / "lean.parquet", "parquet", input=False)
    assert pq.read_table(tmp_path / "lean.parquet").schema.equals(result_schema(input=False))


def test_plain_prompts_get_stable_ids_in_every_format(db_client, tmp_path):
    """A list of plain prompts has no custom_id: every format gives request-INDEX, the id an
    OpenAI output line needs, the same on every export."""
    job = db_client.submit(["first", "second", "third"], pair="tiny", enqueue=False)
    want = ["request-0", "request-1", "request-2"]
    assert [r.custom_id for r in job.results()] == want
    for fmt in ("jsonl", "openai"):
        export(job, tmp_path / f"r.{fmt}", fmt)
        lines = [json.loads(x) for x in (tmp_path / f"r.{fmt}").read_text().splitlines()]
        assert [x["custom_id"] for x in lines] == want
    export(job, tmp_path / "r.parquet", "parquet")
    assert pq.read_table(tmp_path / "r.parquet").column("custom_id").to_pylist() == want
    assert [r.prompt for r in job.results()] == ["first", "second", "third"]


def test_a_jsonl_record_is_one_line_to_every_line_splitter(tmp_path):
    """A model may emit U+0085, U+2028 or U+2029, which str.splitlines() ends a line at
    while JSON leaves them raw: JSONL lines (`specq results`, the HTTP door's output files)
    write them escaped, the same JSON, one record a line to any reader."""
    rows = [{"custom_id": "a", "output": "one\u2028two\u2029three\u0085four"},
            {"custom_id": "b\u2028", "output": "caf\u00e9 \u00e0 la ligne\n\x1c\x1d\x1e"},
            {"custom_id": "c", "output": "plain"}]
    assert json.loads(json_line(rows[0])) == rows[0]
    assert "\u00e9" in json_line(rows[1])  # the rest stays UTF-8 as written
    sink = JsonlSink(tmp_path / "out.jsonl")
    sink.write(rows)
    sink.close()
    text = (tmp_path / "out.jsonl").read_text(encoding="utf-8")
    assert [json.loads(line) for line in text.splitlines()] == rows
    assert [json.loads(line) for line in text.encode().split(b"\n")[:-1]] == rows
