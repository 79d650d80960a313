"""Submission: the whole spec is validated first; bad input stores nothing."""

from __future__ import annotations

import json

import pytest
from sqlalchemy import func, select, update

from specq.api.inputs import InputError
from specq.db import repository as repo
from specq.db.models import Item, Job, JobStatus


def counts(client) -> tuple[int, int]:
    with client.sessions() as s:
        return s.scalar(select(func.count()).select_from(Job)), s.scalar(
            select(func.count()).select_from(Item))


def write_jsonl(path, lines) -> str:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return str(path)


def test_a_file_is_stored_with_its_items(db_client, tmp_path):
    path = write_jsonl(tmp_path / "in.jsonl", [
        {"custom_id": "a", "prompt": "Correct: he go home"},
        "",
        {"messages": [{"role": "user", "content": "Summarise: the cat sat"}], "max_new_tokens": 4},
        {"custom_id": "c", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": "Rewrite: hi", "max_tokens": 3}},
    ])
    job = db_client.submit(path, pair="tiny", enqueue=False, max_new_tokens=8, temperature=0.5)
    state = job.status(check_workers=False)
    assert (state.status, state.total, state.pending) == (JobStatus.queued.value, 3, 3)
    items = list(job.results())
    assert [(i.index, i.custom_id) for i in items] == [(0, "a"), (1, "request-1"), (2, "c")]
    with db_client.sessions() as s:
        job_row = s.get(Job, job.id)
        assert job_row.params["max_new_tokens"] == 8 and job_row.params["temperature"] == 0.5
        assert s.get(Item, (job.id, 1)).params == {"max_new_tokens": 4}
        assert s.get(Item, (job.id, 2)).params == {"max_new_tokens": 3}


def test_prompts_from_python(db_client):
    job = db_client.submit(["Fix: he go", [{"role": "user", "content": "Sum up: a b c"}]],
                           pair="tiny", enqueue=False)
    assert job.status(check_workers=False).total == 2
    assert [j.id for j in db_client.jobs()][0] == job.id


LONG = " ".join(["word"] * 600)  # 3000 bytes: beyond the tiny model's 512-token context


@pytest.mark.parametrize("lines, pair, sampling, expected", [
    (['{"prompt": "ok"}', '{"prompt": "broken"'], "tiny", {}, r"line 2: not valid JSON"),
    ([{"prompt": "ok"}], "no-such-pair", {}, r"pair: unknown pair 'no-such-pair'; known: .*tiny"),
    ([{"prompt": "ok"}, {"prompt": "   "}], "tiny", {}, r"line 2: prompt: must not be empty"),
    ([{"prompt": "ok"}, {"prompt": LONG}], "tiny", {},
     r"line 2: prompt: (at least )?\d+ tokens, the model's context is 512"),
    ([{"prompt": "ok", "temperature": -1}], "tiny", {},
     r"line 1: temperature: Input should be greater than or equal to 0"),
    ([{"prompt": "ok"}], "tiny", {"temperature": -1},
     r"sampling parameter temperature: Input should be greater than or equal to 0"),
    ([{"custom_id": "x", "prompt": "a"}, {"custom_id": "y", "prompt": "b"},
      {"custom_id": "x", "prompt": "c"}], "tiny", {},
     r"line 3: custom_id: 'x' is already used at line 1"),
    ([{"prompt": "ok", "max_new_tokens": 0}], "tiny", {}, r"line 1: max_new_tokens: Input should"),
    # the job's default past the context: said once, as the job's, not once a line
    ([{"prompt": "ok"}, {"prompt": "fine"}], "tiny", {"max_new_tokens": 10**9},
     r"sampling parameter max_new_tokens: 1000000000 leaves no room for a prompt in the "
     r"model's context of 512 tokens$"),
    ([{"prompt": "ok", "max_new_tokens": 4}, {"prompt": LONG[:100]}], "tiny",
     {"max_new_tokens": 500}, r"line 2: max_new_tokens \(the job's default\): 500 after a"),
    ([{"prompt": "ok"}, {"prompt": LONG[:400]}], "tiny", {},  # nobody set it: specq did
     r"line 2: max_new_tokens \(specq's default, 256; set it on the line or for the job\): "
     r"256 after a"),
    ([{"messages": [{"role": "user", "content": "a\u0000b"}]}], "tiny", {},
     r"line 1: prompt: contains a NUL character"),
    ([{"prompt": "a", "messages": [{"role": "user", "content": "b"}]}], "tiny", {},
     r"line 1: a line gives a prompt or messages, exactly one of them \(both given\)"),
    ([{"custom_id": "x", "max_new_tokens": 3}], "tiny", {},
     r"line 1: a line gives a prompt or messages, exactly one of them \(neither given\)"),
])
def test_bad_input_names_where_and_stores_nothing(db_client, tmp_path, lines, pair, sampling,
                                                   expected):
    path = write_jsonl(tmp_path / "bad.jsonl", lines)
    before = counts(db_client)
    with pytest.raises(InputError, match=expected):
        db_client.submit(path, pair=pair, enqueue=False, **sampling)
    assert counts(db_client) == before


def test_a_missing_file_stores_nothing(db_client, tmp_path):
    before = counts(db_client)
    with pytest.raises(InputError, match=r"missing\.jsonl: file not found"):
        db_client.submit(tmp_path / "missing.jsonl", pair="tiny", enqueue=False)
    assert counts(db_client) == before


def test_every_problem_is_reported_at_once(db_client, tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": ""}, {"prompt": "ok"}, "{oops"])
    with pytest.raises(InputError) as err:
        db_client.submit(path, pair="tiny", enqueue=False)
    assert [p.split(":")[0] for p in err.value.problems] == ["line 1", "line 3"]


def test_a_custom_id_on_a_bad_line_is_taken_all_the_same(db_client, tmp_path):
    """A later line reusing the id of a bad line is named in the same pass, not once the
    bad line is mended."""
    path = write_jsonl(tmp_path / "bad.jsonl", [
        {"custom_id": "a", "prompt": "x", "max_new_tokens": "8"},
        {"custom_id": "a", "prompt": "y"}])
    with pytest.raises(InputError) as err:
        db_client.submit(path, pair="tiny", enqueue=False)
    assert [p.split(": ")[:2] for p in err.value.problems] == [
        ["line 1", "max_new_tokens"], ["line 2", "custom_id"]]
    assert "'a' is already used at line 1" in err.value.problems[1]


def test_a_jobs_times_are_utc_with_their_offset_on_every_database(db_client):
    """status and jobs (and so `specq status --json`, `specq jobs --json`) give the same
    times on SQLite, which keeps no zone, as on PostgreSQL."""
    job = db_client.submit(["one"], pair="tiny", enqueue=False)
    job.cancel()
    state, (summary,) = job.status(check_workers=False), db_client.jobs(limit=1)
    times = [state.as_dict()[k] for k in ("created_at", "finished_at")] + [
        summary.as_dict()[k] for k in ("created_at", "finished_at")]
    assert all(t.endswith("+00:00") for t in times), times


def test_an_empty_file_is_refused(db_client, tmp_path):
    path = write_jsonl(tmp_path / "empty.jsonl", [""])
    with pytest.raises(InputError, match="no prompts"):
        db_client.submit(path, pair="tiny", enqueue=False)


def test_wait_draws_a_bar_only_when_asked(db_client, capsys):
    """Job.wait() prints nothing unasked (a library call in someone's program);
    progress=True draws the bar on stderr."""
    job = db_client.submit(["one", "two"], pair="tiny", enqueue=False)
    with db_client.sessions.begin() as s:
        s.execute(update(Item).where(Item.job_id == job.id)
                  .values(status="completed", output="x", finish_reason="stop"))
        repo.settle_job(s, job_id=job.id)
    assert job.wait(timeout=60).finished
    assert capsys.readouterr() == ("", "")
    assert job.wait(progress=True, timeout=60).finished
    assert f"job {job.id}" in capsys.readouterr().err
