"""A batch's output file (its completed requests) and error file (failed, cancelled and
expired ones): OpenAI Batch output lines made from the items as they are read, in input
order, streamed a thousand lines at a time (api/formats.py writes each line).

A batch still running can be read too: what has finished so far, marked by the response
header ``specq-partial: true`` (``false`` once the batch is finished and the file whole).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from fastapi.responses import StreamingResponse

from specq.api.formats import json_line, openai_line
from specq.api.retention import output_expiry
from specq.db import batches as store
from specq.db import repository as repo
from specq.db import retention
from specq.db.models import Batch, File, ItemStatus, JobStatus

BATCH = 1000
COLUMNS = ("index", "custom_id", "status", "error", "finished_at", "new_tokens",
           "prompt_tokens", "finish_reason", "output")
STATUSES = {"output": (ItemStatus.completed.value,),
            "error": (ItemStatus.failed.value, ItemStatus.cancelled.value)}


def response(client: Any, row: File) -> StreamingResponse:
    with client.sessions() as s:
        batch = s.get(Batch, row.batch_id)
        job = repo.get_job(s, job_id=batch.job_id) if batch and batch.job_id else None
    finished = job is not None and JobStatus(job.status).finished
    lines = _lines(client, row, batch, job) if job is not None else iter(())
    return StreamingResponse(lines, media_type="application/jsonl",
                             headers={"specq-partial": "false" if finished else "true"})


def settle_size(client: Any, row: File) -> File:
    """An output or error file whose batch finished, with its size known: made once from
    the items (the file is rendered and counted, not kept) the first time it is asked
    for after the batch finished, then read from its row."""
    if row.kind == "input" or row.bytes is not None or row.batch_id is None:
        return row
    with client.sessions() as s:
        batch = s.get(Batch, row.batch_id)
        job = repo.get_job(s, job_id=batch.job_id) if batch and batch.job_id else None
    if job is None or not JobStatus(job.status).finished:
        return row  # still growing: its size is not known yet
    for _ in _lines(client, row, batch, job):
        pass  # (which stores the size once the whole file was made)
    if batch.output_expires_after is not None and row.expires_at is None \
            and job.finished_at is not None:  # the sweep would set it too
        with client.sessions.begin() as s:
            retention.set_expiry(s, file_id=row.id, expires_at=output_expiry(
                job.finished_at, batch.output_expires_after))
    with client.sessions() as s:
        return s.get(File, row.id) or row


def _lines(client: Any, row: File, batch: Batch, job: Any) -> Iterator[bytes]:
    chat = () if batch.endpoint == "/v1/chat/completions" else None  # openai_line: chat?
    expired = batch.expired_at is not None
    finished = JobStatus(job.status).finished
    size = 0
    with client.sessions() as s:
        out: list[str] = []
        for values in store.iter_outcomes(s, job_id=job.id, statuses=STATUSES[row.kind],
                                          columns=COLUMNS, batch=BATCH):
            item = dict(zip(COLUMNS, values))
            item["messages"] = chat
            line = openai_line(item, job.id, batch.model or job.pair)
            if expired and item["status"] == ItemStatus.cancelled.value:
                line["error"] = {"code": "batch_expired",
                                 "message": "the batch's completion window ended before "
                                            "this request was run"}
            out.append(json_line(line))
            if len(out) >= BATCH:
                data = ("\n".join(out) + "\n").encode()
                size += len(data)
                yield data
                out = []
        if out:
            data = ("\n".join(out) + "\n").encode()
            size += len(data)
            yield data
    if finished and row.bytes != size:  # the whole file: its size is known from now on
        with client.sessions.begin() as s:
            store.set_file_bytes(s, file_id=row.id, size=size, created_at=job.finished_at)
