"""/v1/webhook_endpoints: a tenant's webhook endpoints, as the openai SDK's
``client.webhooks`` manages them (create, retrieve, update, list, delete, rotate_secret).
An endpoint is told of the tenant's batches ending (batch.completed | failed | expired |
cancelled, db/webhooks.py). Its signing secret is in the answers of create and
rotate_secret only; a rotation may keep the old secret signing for 24 hours (both
signatures are sent). A URL that is not https or that reaches a private or loopback
address is refused (400) unless the operator allows it (SPECQ_WEBHOOK_ALLOW_HTTP,
SPECQ_WEBHOOK_ALLOW_PRIVATE).
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from specq.api.server.auth import caller
from specq.api.server.errors import ApiError, not_found
from specq.db import webhooks
from specq.db.tenants import Caller
from specq.schema.addresses import MAX_URL, TargetError

router = APIRouter()
Who = Annotated[Caller, Depends(caller)]


class EndpointCreate(BaseModel):
    model_config = ConfigDict(extra="allow")

    url: str = Field(max_length=MAX_URL)
    name: str = Field("", max_length=200)
    event_types: list[Annotated[str, Field(max_length=64)]] | None = Field(None, max_length=16)


@router.post("/v1/webhook_endpoints")
async def create_endpoint(request: Request, body: EndpointCreate, who: Who) -> dict[str, Any]:
    settings = request.app.state.settings

    def add() -> dict[str, Any]:
        with request.app.state.client.sessions.begin() as s:
            try:
                info, secret = webhooks.add_endpoint(
                    s, url=body.url, tenant_id=who.tenant_id, name=body.name,
                    event_types=body.event_types,
                    allow_private=settings.webhook_allow_private,
                    allow_http=settings.webhook_allow_http)
            except ValueError as exc:
                raise _refused(exc) from None
        return {**info.as_object(), "signing_secret": secret}

    return await run_in_threadpool(add)  # (a name is resolved: never on the event loop)


class EndpointUpdate(BaseModel):
    model_config = ConfigDict(extra="allow")

    url: str | None = Field(None, max_length=MAX_URL)
    name: str | None = Field(None, max_length=200)
    event_types: list[Annotated[str, Field(max_length=64)]] | None = Field(None, max_length=16)


class Rotate(BaseModel):
    model_config = ConfigDict(extra="allow")

    keep_old_secret_active_for_24_hours: bool = False


def _refused(exc: ValueError) -> ApiError:
    if isinstance(exc, TargetError):
        return ApiError(400, str(exc), param="url", code="invalid_url")
    return ApiError(400, str(exc), param="event_types", code="invalid_event_type")


@router.post("/v1/webhook_endpoints/{endpoint_id}")
async def update_endpoint(request: Request, endpoint_id: str, body: EndpointUpdate,
                          who: Who) -> dict[str, Any]:
    settings = request.app.state.settings

    def update() -> dict[str, Any]:
        with request.app.state.client.sessions.begin() as s:
            try:
                found = webhooks.update_endpoint(
                    s, openai_id=endpoint_id, tenant_id=who.tenant_id, name=body.name,
                    url=body.url, event_types=body.event_types,
                    allow_private=settings.webhook_allow_private,
                    allow_http=settings.webhook_allow_http)
            except ValueError as exc:
                raise _refused(exc) from None
        if found is None:
            raise not_found("Webhook endpoint", endpoint_id, param="webhook_endpoint_id")
        return found.as_object()

    return await run_in_threadpool(update)


@router.post("/v1/webhook_endpoints/{endpoint_id}/rotate_secret")
def rotate_secret(request: Request, endpoint_id: str, who: Who,
                  body: Rotate | None = None) -> dict[str, Any]:
    keep = 86400.0 if body is not None and body.keep_old_secret_active_for_24_hours else 0.0
    with request.app.state.client.sessions.begin() as s:
        found = webhooks.rotate_secret(s, openai_id=endpoint_id, tenant_id=who.tenant_id,
                                       keep_old_for=keep)
    if found is None:
        raise not_found("Webhook endpoint", endpoint_id, param="webhook_endpoint_id")
    info, secret = found
    return {**info.as_object(), "signing_secret": secret}


@router.get("/v1/webhook_endpoints")
def list_endpoints(request: Request, who: Who,
                   after: Annotated[str | None, Query(max_length=64)] = None,
                   limit: Annotated[int, Query(ge=1, le=100)] = 20) -> dict[str, Any]:
    with request.app.state.client.sessions() as s:
        try:
            rows, more = webhooks.list_endpoints(s, tenant_id=who.tenant_id, after=after,
                                                 limit=limit)
        except KeyError:
            raise not_found("Webhook endpoint", after or "", param="after") from None
    data = [r.as_object() for r in rows]
    return {"object": "list", "data": data, "has_more": more,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None}


@router.get("/v1/webhook_endpoints/{endpoint_id}")
def get_endpoint(request: Request, endpoint_id: str, who: Who) -> dict[str, Any]:
    with request.app.state.client.sessions() as s:
        found = webhooks.get_endpoint(s, openai_id=endpoint_id, tenant_id=who.tenant_id)
    if found is None:
        raise not_found("Webhook endpoint", endpoint_id, param="webhook_endpoint_id")
    return found.as_object()


@router.delete("/v1/webhook_endpoints/{endpoint_id}")
def delete_endpoint(request: Request, endpoint_id: str, who: Who) -> dict[str, Any]:
    with request.app.state.client.sessions.begin() as s:
        gone = webhooks.remove_endpoint(s, openai_id=endpoint_id, tenant_id=who.tenant_id)
    if not gone:
        raise not_found("Webhook endpoint", endpoint_id, param="webhook_endpoint_id")
    return {"id": endpoint_id, "object": "webhook_endpoint.deleted", "deleted": True}
