"""Structured outputs on every way in: OpenAI batch lines (response_format, vLLM's guided_*),
plain lines, Client.submit defaults and synthesis specs; refusals name the line and store
nothing; the grammar's drafts are counted in SQL and `specq metrics`."""

from __future__ import annotations

import json
import re
import time

import jsonschema
import pyarrow.parquet as pq
import pytest
from sqlalchemy import func, select, text, update

from specq.api import synthesis
from specq.api.report import format_metrics
from specq.api.tokenizer import _grammar_problem
from specq.configs.presets import get_preset
from specq.db.models import Job as JobRow
from specq.db.models import utcnow
from specq.schema.errors import InputError
from specq.worker.pairs import load_pair
from specq.worker.tasks import run_inline

LABEL = {"type": "object", "additionalProperties": False, "required": ["label", "note"],
         "properties": {"label": {"enum": ["good", "bad", "unsure"]},
                        "note": {"type": "string", "maxLength": 6}}}


def _chat(cid: str, **body) -> dict:
    """An OpenAI line, greedy (OpenAI's default temperature is 1: a sampled line would end
    where its seed, drawn at random, takes it)."""
    return {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": f"rate item {cid}"}],
                     "max_tokens": 40, "temperature": 0, **body}}


LINES = [
    _chat("schema", response_format={"type": "json_schema", "json_schema": {
        "name": "label", "schema": LABEL, "strict": True}}),
    _chat("object", response_format={"type": "json_object"}),
    _chat("cut", response_format={"type": "json_schema", "json_schema": {
        "name": "label", "schema": LABEL}}, max_tokens=6),  # cut inside the object
    _chat("guided-choice", guided_choice=["yes", "no", "maybe"]),
    _chat("guided-regex", guided_regex="[0-9]{3}-[a-z]{2}"),
    _chat("free"),
    {"custom_id": "plain", "prompt": "label this",
     "response_format": {"type": "choice", "choice": ["alpha", "beta"]}},
]


@pytest.fixture(scope="module")
def engine(settings):
    return load_pair(get_preset("tiny-lookup"), settings).engine(max_batch_size=4)


def _jobs(client) -> int:
    with client.sessions() as s:
        return s.scalar(select(func.count()).select_from(JobRow))


def test_every_line_shape_is_served_and_counted(client, engine):
    job = client.submit(LINES, pair="tiny-lookup", enqueue=False)
    run_inline(sessions=client.sessions, engine=engine, pair="tiny-lookup", job_id=job.id,
               progress=False)
    out = {it.custom_id: it for it in job.results()}
    assert all(it.status == "completed" for it in out.values())
    assert out["schema"].finish_reason == "stop"
    jsonschema.validate(json.loads(out["schema"].output), LABEL)
    if out["object"].finish_reason == "stop":
        assert isinstance(json.loads(out["object"].output), dict)
    assert out["cut"].finish_reason == "length"  # max_tokens inside the object: the
    assert out["cut"].output == '{"labe'  # partial text, as OpenAI gives it
    assert out["guided-choice"].output in ("yes", "no", "maybe")
    assert re.fullmatch("[0-9]{3}-[a-z]{2}", out["guided-regex"].output)
    assert out["plain"].output in ("alpha", "beta")
    assert out["schema"].counters["forced_proposed"] > 0  # keys and quotes drafted for free
    assert out["free"].counters["forced_proposed"] == 0
    m = job.metrics()
    assert 0 < m.forced_accepted <= m.forced_proposed <= m.proposed
    assert "grammar drafts" in format_metrics(m)
    with client.sessions() as s:  # the views carry them
        row = s.execute(text("SELECT forced_proposed, forced_accepted, forced_acceptance_rate,"
                             " mask_time FROM job_metrics WHERE job_id = :j"),
                        {"j": job.id}).one()
    assert row[0] == m.forced_proposed and row[1] == m.forced_accepted
    assert row[2] == pytest.approx(m.forced_accepted / m.forced_proposed)
    assert row[3] > 0


def test_a_job_default_shapes_every_line(client, engine):
    """Client.submit(response_format=...) is every line's default; a line's own wins."""
    lines = ["first", "second", {"prompt": "third", "response_format": {"type": "text"}}]
    job = client.submit(lines, pair="tiny-lookup", enqueue=False, max_new_tokens=30,
                        response_format={"type": "regex", "regex": "(ab|cd){1,3}"})
    run_inline(sessions=client.sessions, engine=engine, pair="tiny-lookup", job_id=job.id,
               progress=False)
    out = [it for it in job.results()]
    assert all(re.fullmatch("(ab|cd){1,3}", it.output) for it in out[:2])
    assert not re.fullmatch("(ab|cd){1,3}", out[2].output)  # free text


@pytest.mark.parametrize("line, problem", [
    (_chat("a", response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "not": {"type": "string"}}}}),
     'line 2: body.response_format: json_schema.schema: the grammar library refused it: '
     'Unimplemented keys: ["not"] (at /)'),
    (_chat("a2", response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"b": {
            "type": "array", "items": {"properties": {"c": {"uniqueItems": True}}}}}}}}),
     'Unimplemented keys: ["uniqueItems"] (at /properties/b/items/properties/c)'),
    (_chat("b", guided_regex="([a-z]"),
     "line 2: body.guided_regex: regex: the grammar library refused it: error: unclosed group"),
    ({"prompt": "p", "response_format": {"type": "choice", "choice": []}},
     "line 2: response_format.choice: List should have at least 1 item"),
    ({"prompt": "p", "response_format": {"type": "xml"}},
     "line 2: response_format: Input tag 'xml' found using 'type' does not match"),
    (_chat("c", response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"$ref": "#/definitions/missing"}}}),
     "line 2: body.response_format: json_schema.schema: the grammar library refused it"),
])
def test_a_response_format_the_library_refuses_is_named_and_nothing_is_stored(
        client, line, problem, tmp_path):
    path = tmp_path / "lines.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in [LINES[0], line]) + "\n")
    before = _jobs(client)
    with pytest.raises(InputError) as err:
        client.submit(str(path), pair="tiny-lookup", enqueue=False)
    assert problem in str(err.value), str(err.value)
    assert _jobs(client) == before


def test_a_tokenizer_the_library_cannot_read_is_named():
    bad = json.dumps({"model": {"type": "WordLevel", "vocab": {}}})
    assert "cannot read this pair's tokenizer" in _grammar_problem("{}", "/nowhere", bad)


def test_a_shaped_synthesis_spec_writes_only_rows_that_completed_their_shape(
        client, engine, settings, tmp_path):
    spec = synthesis.SynthSpec.model_validate({
        "name": "shaped", "pair": "tiny-lookup", "template": "Label {{ word }}:",
        "seed_data": [{"word": f"w{i}"} for i in range(8)], "n": 2,
        "sampling": {"max_new_tokens": 40, "temperature": 0.8},
        "response_format": {"type": "json_schema", "json_schema": {"name": "l",
                                                                   "schema": LABEL}},
        "output": {"path": str(tmp_path / "shaped-{job_id}.parquet")}})
    job = synthesis.submit(client, spec)  # its chunks wait on a queue no worker serves
    run_inline(sessions=client.sessions, engine=engine, pair="tiny-lookup", job_id=job.id,
               progress=False)
    items = list(job.results())
    finished = [it for it in items if it.finish_reason == "stop"]
    assert 0 < len(finished) < len(items)  # some were cut by max_new_tokens
    rows = pq.read_table(synthesis.write_output(client, job.id)).to_pylist()
    assert [r["custom_id"] for r in rows] == [it.custom_id for it in finished]
    for r in rows:
        jsonschema.validate(json.loads(r["output"]), LABEL)


def test_a_spec_gives_its_response_format_once():
    with pytest.raises(ValueError, match="given twice"):
        synthesis.SynthSpec.model_validate({
            "name": "x", "pair": "tiny", "template": "t", "seed_data": [{"a": 1}],
            "sampling": {"response_format": {"type": "json_object"}},
            "response_format": {"type": "json_object"}, "output": {"path": "o.jsonl"}})


def test_a_data_set_is_not_written_from_a_seed_file_changed_since_the_run(
        client, engine, tmp_path):
    """The data set pairs each sample with its seed row read again from the file: a file
    changed since the run was submitted (other rows, more rows) writes nothing, naming it."""
    seed = tmp_path / "seed.jsonl"
    seed.write_text("".join(json.dumps({"word": w}) + "\n" for w in ("ant", "bee")))
    spec = synthesis.SynthSpec.model_validate({
        "name": "changed", "pair": "tiny-lookup", "template": "Say {{ word }}:",
        "seed_data": str(seed), "sampling": {"max_new_tokens": 3},
        "output": {"path": str(tmp_path / "out-{job_id}.jsonl")}})
    job = synthesis.submit(client, spec)
    run_inline(sessions=client.sessions, engine=engine, pair="tiny-lookup", job_id=job.id,
               progress=False)
    seed.write_text("".join(json.dumps({"word": w}) + "\n" for w in ("ant", "cow")))
    with pytest.raises(RuntimeError, match="changed since the run was submitted .its row 1 "):
        synthesis.write_output(client, job.id)
    seed.write_text("".join(json.dumps({"word": w}) + "\n" for w in ("ant", "bee", "cow")))
    with pytest.raises(RuntimeError, match="it has more rows than the job"):
        synthesis.write_output(client, job.id)
    assert not list(tmp_path.glob("out-*"))  # nothing written either time
    seed.write_text("".join(json.dumps({"word": w}) + "\n" for w in ("ant", "bee")))
    rows = [json.loads(x) for x in synthesis.write_output(client, job.id).open()]
    assert [r["word"] for r in rows] == ["ant", "bee"]


def test_a_data_set_is_named_for_its_run_and_never_rewritten_from_swept_results(
        client, engine, tmp_path):
    """{date} is the run's start: a data set written again lands on the same path; once
    retention swept the run's results, writing it again is refused and the file kept."""
    spec = synthesis.SynthSpec.model_validate({
        "name": "dated", "pair": "tiny-lookup", "template": "Say {{ word }}:",
        "seed_data": [{"word": "ant"}, {"word": "bee"}], "sampling": {"max_new_tokens": 3},
        "output": {"path": str(tmp_path / "out-{job_id}-{date}.jsonl")}})
    job = synthesis.submit(client, spec)
    run_inline(sessions=client.sessions, engine=engine, pair="tiny-lookup", job_id=job.id,
               progress=False)
    first = synthesis.write_output(client, job.id)
    time.sleep(1.1)  # a clock's second later: the same name all the same
    assert synthesis.write_output(client, job.id) == first
    assert list(tmp_path.glob("out-*")) == [first]
    written = first.read_bytes()
    with client.sessions.begin() as s:
        s.execute(update(JobRow).where(JobRow.id == job.id).values(swept_at=utcnow()))
    with pytest.raises(RuntimeError, match=f"job {job.id}: its results were swept"):
        synthesis.write_output(client, job.id)
    assert first.read_bytes() == written
