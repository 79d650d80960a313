"""The shapes the server answers with, as OpenAI documents them (the `openai` SDK's
FileObject, Batch and ErrorObject; tests/api/test_objects.py holds them side by side), and
the OpenAPI schema FastAPI serves from them at /openapi.json. Routes build plain dicts;
these models check and serialise them (only the fields a route set are sent)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """Every refusal: {"error": {"message", "type", "param", "code"}}."""

    error: ErrorDetail


ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse} for status in (400, 401, 404, 409, 413, 429)}


class FileObject(BaseModel):
    id: str
    object: Literal["file"]
    bytes: int
    created_at: int
    filename: str
    purpose: Literal["batch", "batch_output"]
    status: Literal["uploaded", "processed", "error"]
    expires_at: int | None = None
    status_details: str | None = None


class FileList(BaseModel):
    object: Literal["list"]
    data: list[FileObject]
    has_more: bool
    first_id: str | None
    last_id: str | None


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"]
    deleted: bool


class BatchError(BaseModel):
    """One bad line of a failed batch (``line`` None: the whole file)."""

    code: str | None
    line: int | None
    message: str | None
    param: str | None


class BatchErrors(BaseModel):
    object: Literal["list"]
    data: list[BatchError]


class RequestCounts(BaseModel):
    total: int
    completed: int
    failed: int


class InputDetails(BaseModel):
    cached_tokens: int


class OutputDetails(BaseModel):
    reasoning_tokens: int


class BatchUsage(BaseModel):
    """Tokens of the batch's requests so far, in OpenAI's shape (nothing is cached or
    reasoned apart: those details are 0)."""

    input_tokens: int
    input_tokens_details: InputDetails
    output_tokens: int
    output_tokens_details: OutputDetails
    total_tokens: int


class SpecqFigures(BaseModel):
    """specq's own figures of a batch with a job (an extra field every SDK keeps)."""

    job_id: int
    pair: str
    drafter: str | None
    cancelled: int
    pending: int
    new_tokens: int
    acceptance_rate: float | None
    mean_acceptance_length: float | None
    tokens_per_second: float | None
    engine_tokens_per_second: float | None
    estimated_speedup: float | None
    waiting: str | None  # why its requests wait (no live worker), else None


class BatchObject(BaseModel):
    id: str
    object: Literal["batch"]
    endpoint: str
    model: str | None = None
    errors: BatchErrors | None = None
    input_file_id: str
    completion_window: str
    status: Literal["validating", "failed", "in_progress", "finalizing", "completed",
                    "expired", "cancelling", "cancelled"]
    output_file_id: str | None = None
    error_file_id: str | None = None
    created_at: int
    in_progress_at: int | None = None
    expires_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: RequestCounts | None = None
    metadata: dict[str, str] | None = None
    usage: BatchUsage | None = None
    specq: SpecqFigures | None = None


class BatchList(BaseModel):
    object: Literal["list"]
    data: list[BatchObject]
    has_more: bool
    first_id: str | None
    last_id: str | None
