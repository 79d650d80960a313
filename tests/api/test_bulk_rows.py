"""Items stored and read in bulk: PostgreSQL's COPY stores what an INSERT stores, and the
plain columns exports read are what the ORM's items hold, so every format writes what it
wrote when it read Item objects."""

from __future__ import annotations

import json
from datetime import datetime, timezone

from sqlalchemy import Text, cast, insert, select

from specq.api.client import ItemResult, item_id
from specq.api.formats import OPENAI_COLUMNS, export, json_line, openai_line
from specq.db import repository as repo
from specq.db.models import Item, ItemStatus
from specq.db.session import migrate, session_factory
from specq.schema.counters import ARRAYS, SCALARS

ODD = "tab\there, new\nline, back\\slash, NUL-free \u2028 é 😀 \\N \"quoted\""


def input_rows(n: int = 12) -> list[dict]:
    """Item rows as submit stores them: prompts and message lists, params or none."""
    rows = []
    for i in range(n):
        rows.append({
            "index": i, "custom_id": None if i % 3 == 0 else f"c{i} {ODD}",
            "prompt": None if i % 2 else f"{ODD} {i}",
            "messages": [{"role": "user", "content": f"{ODD} {i}", "name": "é"}] if i % 2
            else None,
            "params": {"stop": [ODD], "temperature": 0.1 * i, "seed": 2**62}
            if i % 4 == 1 else None,
        })
    return rows


def stored(sessions, job_id: int) -> list[tuple]:
    """Every column of the job's items as PostgreSQL's text (JSON as stored, not reparsed)."""
    table = Item.__table__
    cols = [cast(c, Text) for c in table.columns if c.name != "job_id"]
    with sessions() as s:
        return [tuple(r) for r in s.execute(
            select(*cols).where(table.c.job_id == job_id).order_by(table.c.index))]


def test_copy_stores_what_insert_stores(pg_url):
    migrate(pg_url)
    sessions = session_factory(pg_url)
    with sessions.begin() as s:
        copied = repo.create_job(s, pair="tiny", params={}, chunk_size=4, source=None).id
        assert repo.insert_items(s, job_id=copied, rows=iter(input_rows())) == 12
        inserted = repo.create_job(s, pair="tiny", params={}, chunk_size=4, source=None).id
        s.execute(insert(Item.__table__), [{"job_id": inserted, "status": "pending",
                                            "writes": 0, **r} for r in input_rows()])
    assert stored(sessions, copied) == stored(sessions, inserted)
    # rows with more columns than an input's, as tests and tools store finished items
    done = [{**r, "status": "completed", "output": ODD, "new_tokens": 3,
             "accepted_by_position": [1, 0], "finished_at": datetime(2026, 1, 2,
                                                                     tzinfo=timezone.utc)}
            for r in input_rows(3)]
    with sessions.begin() as s:
        copied = repo.create_job(s, pair="tiny", params={}, chunk_size=4, source=None).id
        repo.insert_items(s, job_id=copied, rows=done)
        inserted = repo.create_job(s, pair="tiny", params={}, chunk_size=4, source=None).id
        s.execute(insert(Item.__table__), [{"job_id": inserted, "status": "pending",
                                            "writes": 0, **r} for r in done])
    assert stored(sessions, copied) == stored(sessions, inserted)
    with sessions.begin() as s:
        assert repo.insert_items(s, job_id=copied, rows=[]) == 0


def finished_job(client) -> int:
    """A job whose items are completed (chat and text), failed, cancelled and pending."""
    statuses = [ItemStatus.completed, ItemStatus.failed, ItemStatus.cancelled,
                ItemStatus.pending]
    rows = []
    for r in input_rows():
        status = statuses[r["index"] // 2 % 4]
        done = status == ItemStatus.completed
        rows.append({**r, "status": status.value,
                     "output": f"out {ODD}" if done else None,
                     "finish_reason": "length" if done else None,
                     "error": "engine said no" if status == ItemStatus.failed else None,
                     "prompt_tokens": 7 if done else None, "worker": "w" if done else None,
                     "finished_at": datetime(2026, 1, 2, 3, 4, 5, tzinfo=timezone.utc)
                     if done else None,
                     **({"draft_steps": 2, "proposed": 8, "accepted": 3,
                         "accepted_by_position": [2, 1], "target_passes": 3, "new_tokens": 6,
                         "steps_by_draft_length": [1, 0, 2], "draft_time": 0.125,
                         "verify_time": 1 / 3} if done else
                        dict.fromkeys(SCALARS + ARRAYS))})
    with client.sessions.begin() as s:
        job = repo.create_job(s, pair="tiny", params={}, chunk_size=4, source=None)
        job.total = repo.insert_items(s, job_id=job.id, rows=rows)
        return job.id


def test_exports_read_what_the_items_hold(db_client, tmp_path):
    job = db_client.job(finished_job(db_client))
    with db_client.sessions() as s:
        items = list(repo.iter_items(s, job_id=job.id))
        model = repo.get_job(s, job_id=job.id).pair
    # Job.results as it read Item objects
    want = [ItemResult(index=it.index, custom_id=item_id(it.custom_id, it.index),
                       status=it.status, output=it.output, finish_reason=it.finish_reason,
                       error=it.error, prompt_tokens=it.prompt_tokens,
                       counters={c: getattr(it, c) for c in SCALARS + ARRAYS}, worker=it.worker,
                       prompt=it.prompt, messages=it.messages, params=it.params)
            for it in items]
    assert list(job.results(batch=5)) == want
    assert export(job, tmp_path / "r.jsonl", "jsonl") == 12
    assert (tmp_path / "r.jsonl").read_text(encoding="utf-8") == "".join(
        json_line(r.as_dict()) + "\n" for r in want)  # (U+2028 escaped)
    assert export(job, tmp_path / "o.jsonl", "openai") == 12
    assert (tmp_path / "o.jsonl").read_text(encoding="utf-8") == "".join(
        json_line(openai_line({c: getattr(it, c) for c in OPENAI_COLUMNS}, job.id, model))
        + "\n" for it in items)
    lines = [json.loads(x) for x in (tmp_path / "o.jsonl").read_text().split("\n")[:-1]]
    assert lines[0]["response"]["body"]["object"] == "text_completion"
    assert lines[1]["response"]["body"]["object"] == "chat.completion"
    assert lines[2]["error"]["message"] == "engine said no"
    assert lines[4]["error"]["code"] == "batch_cancelled"
