"""/v1/files: batch input files uploaded, listed, read and deleted, and the output and
error files of batches (their content made from the items: outputs.py)."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from specq.api.inputs import MAX_PROBLEMS
from specq.api.retention import upload_expiry
from specq.api.server import outputs
from specq.api.server.auth import caller
from specq.api.server.errors import ApiError, not_found
from specq.api.server.objects import ERRORS, FileDeleted, FileList, FileObject
from specq.api.server.uploads import (
    FileCheck,
    MultipartError,
    Problem,
    Upload,
    boundary_of,
    keep,
    staging_path,
    store_path,
)
from specq.configs.settings import Settings
from specq.db import batches as store
from specq.db import retention
from specq.db.models import File, as_utc, utcnow
from specq.db.tenants import Caller

router = APIRouter(responses=ERRORS)
PART_BYTES = 1 << 20  # pieces of an upload handed to the scan, and parts kept in the database


Who = Annotated[Caller, Depends(caller)]


def unix(when: datetime | None) -> int | None:
    """Seconds since the epoch (SQLite hands times back without their zone: UTC)."""
    if when is None:
        return None
    return int(as_utc(when).timestamp())


def file_object(f: File) -> dict[str, Any]:
    return {"id": f.openai_id, "object": "file", "bytes": f.bytes or 0,
            "created_at": unix(f.created_at), "filename": f.filename,
            "purpose": f.purpose, "status": "processed", "expires_at": unix(f.expires_at),
            "status_details": None}


@router.post("/v1/files", response_model=FileObject,
             response_model_exclude_unset=True)
async def upload_file(request: Request, who: Who) -> dict[str, Any]:
    settings: Settings = request.app.state.settings
    limit = settings.api_max_file_bytes  # the gate caps the body at limit + its form
    try:
        boundary = boundary_of(request.headers.get("content-type"))
    except MultipartError as exc:
        raise ApiError(400, str(exc), code="invalid_multipart") from None
    scan = FileCheck(max_lines=settings.api_max_file_lines)
    up = Upload(boundary, settings.files_dir / ".incoming", scan, limit)
    kept = False
    try:
        pieces: list[bytes] = []
        size = 0
        async for chunk in request.stream():
            pieces.append(chunk)
            size += len(chunk)
            if size >= PART_BYTES:
                await run_in_threadpool(up.write, b"".join(pieces))
                pieces, size = [], 0
        await run_in_threadpool(up.write, b"".join(pieces))
        await run_in_threadpool(up.finish)
        purpose = up.fields.get("purpose")
        if purpose is None:
            raise ApiError(400, "Missing required parameter: 'purpose'.", param="purpose",
                           code="missing_required_parameter")
        if purpose != "batch":
            raise ApiError(400, f"purpose: {purpose[:100]!r} is not served here; upload batch "
                           "input files with purpose 'batch'", param="purpose",
                           code="invalid_purpose")
        if up.oversize:
            raise _too_large(limit)
        if scan.problems:
            raise refused(scan.problems)
        created = utcnow()
        try:
            expires = upload_expiry(up.fields, settings, created)
        except ValueError as exc:
            raise ApiError(400, str(exc), param="expires_after",
                           code="invalid_expires_after") from None
        row = await run_in_threadpool(_store, request.app.state.client, settings, who, up,
                                      created, expires)
        kept = True
        return file_object(row)
    except MultipartError as exc:
        raise ApiError(400, str(exc), param=exc.param, code="invalid_multipart") from None
    finally:
        if not kept:
            up.discard()


def _too_large(limit: int) -> ApiError:
    return ApiError(413, f"The file is larger than {limit} bytes (the limit, "
                    f"SPECQ_API_MAX_FILE_BYTES)", param="file", code="file_too_large")


def refused(problems: list[Problem], what: str = "nothing was stored") -> ApiError:
    """A 400 naming every problem found (up to MAX_PROBLEMS), coded as the first one."""
    first = problems[0]
    text = "; ".join(p.text() for p in problems)
    more = " (and maybe more)" if len(problems) >= MAX_PROBLEMS else ""
    return ApiError(400, f"The batch file is not valid, {what}: {text}{more}",
                    param=first.param or "file", code=first.code)


def _store(client: Any, settings: Settings, who: Caller, up: Upload,
           created: datetime | None = None, expires: datetime | None = None) -> File:
    openai_id = "file-" + secrets.token_hex(12)
    with client.sessions.begin() as s:
        row = store.add_file(
            s, openai_id=openai_id, tenant_id=who.tenant_id, kind="input", purpose="batch",
            filename=up.filename, bytes=up.size, lines=up.scan.lines,
            stored_in=settings.api_file_store, created_at=created or utcnow(),
            expires_at=expires)
        if settings.api_file_store == "database":
            with up.path.open("rb") as f:
                for part, data in enumerate(iter(lambda: f.read(PART_BYTES), b"")):
                    store.add_part(s, file_id=row.id, part=part, data=data)
        else:
            keep(up, settings.files_dir, openai_id)
    return row


@router.get("/v1/files", response_model=FileList,
            response_model_exclude_unset=True)
def list_files(request: Request, who: Who,
               after: Annotated[str | None, Query(max_length=64)] = None,
               limit: Annotated[int, Query(ge=1, le=10000)] = 10000,
               order: Literal["asc", "desc"] = "desc",
               purpose: Annotated[str | None, Query(max_length=32)] = None) -> dict[str, Any]:
    if purpose is not None and not store.storable(purpose):
        raise ApiError(400, "purpose: must not hold NUL characters or lone surrogates",
                       param="purpose", code="invalid_value")
    with request.app.state.client.sessions() as s:
        try:
            rows, more = store.list_files(s, tenant_id=who.tenant_id, after=after, limit=limit,
                                          ascending=order == "asc", purpose=purpose)
        except KeyError:
            raise not_found("File", after or "", param="after") from None
    client = request.app.state.client
    data = [file_object(outputs.settle_size(client, f)) for f in rows]
    return {"object": "list", "data": data, "has_more": more,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None}


def _file(request: Request, who: Caller, file_id: str) -> File:
    with request.app.state.client.sessions() as s:
        row = store.get_file(s, tenant_id=who.tenant_id, openai_id=file_id)
    if row is None:
        raise not_found("File", file_id, param="file_id")
    return row


@router.get("/v1/files/{file_id}", response_model=FileObject,
            response_model_exclude_unset=True)
def get_file(request: Request, file_id: str, who: Who) -> dict[str, Any]:
    return file_object(outputs.settle_size(request.app.state.client,
                                           _file(request, who, file_id)))


@router.delete("/v1/files/{file_id}", response_model=FileDeleted,
               response_model_exclude_unset=True)
def delete_file(request: Request, file_id: str, who: Who) -> dict[str, Any]:
    row = _file(request, who, file_id)
    with request.app.state.client.sessions.begin() as s:
        retention.delete_files(s, file_ids=[row.id])  # its id kept: a cursor on it pages
    if row.kind == "input" and row.stored_in == "directory":
        store_path(request.app.state.settings.files_dir, row.openai_id).unlink(missing_ok=True)
    return {"id": row.openai_id, "object": "file", "deleted": True}


@router.get("/v1/files/{file_id}/content")
def file_content(request: Request, file_id: str, who: Who
                 ) -> StreamingResponse:
    row = _file(request, who, file_id)
    if row.kind != "input":
        return outputs.response(request.app.state.client, row)
    return StreamingResponse(input_bytes(request.app.state.client, request.app.state.settings,
                                         row),
                             media_type="application/jsonl",
                             headers={"content-length": str(row.bytes or 0)})


def input_bytes(client: Any, settings: Settings, row: File) -> Iterator[bytes]:
    """An uploaded file's bytes, a part at a time, from the store it went to. A file of
    the directory store is opened now: bytes gone from under their row (a sweep or a
    delete between the two) are a 404 before any answer starts, not a body cut short."""
    if row.stored_in == "database":
        return _parts(client, row)
    path: Path = store_path(settings.files_dir, row.openai_id)
    try:
        f = path.open("rb")
    except FileNotFoundError:
        raise not_found("File", row.openai_id, param="file_id") from None
    return _chunks(f)


def _parts(client: Any, row: File) -> Iterator[bytes]:
    with client.sessions() as s:
        yield from store.iter_parts(s, file_id=row.id)


def _chunks(f: Any) -> Iterator[bytes]:
    with f:
        yield from iter(lambda: f.read(PART_BYTES), b"")


def upload_path(client: Any, row: File) -> tuple[Path, bool]:
    """A path to an uploaded file's bytes, and whether it is a temporary copy (a file kept
    in the database is copied out, a part at a time, for Client.submit to read twice)."""
    settings = client.settings
    if row.stored_in != "database":
        return store_path(settings.files_dir, row.openai_id), False
    path = staging_path(settings.files_dir / ".incoming", ".jsonl")
    with path.open("wb") as out, client.sessions() as s:
        for data in store.iter_parts(s, file_id=row.id):
            out.write(data)
    return path, True
