"""`specq serve`: the OpenAI Files and Batches API over HTTP (FastAPI on uvicorn).

The server keeps no job state of its own: files live in the file store (a directory or the
database), batches and their jobs in the database, so a restart loses nothing and any
number of servers can serve the same database. Each request names its tenant by its key
(`Authorization: Bearer KEY`, db/tenants.py); every read is the tenant's own.

    limits.py    the gate: the key checked and the body capped before a route reads it
    files.py     /v1/files: upload (streamed, checked line by line), list, get, content, delete
    batches.py   /v1/batches: create, get, list, cancel; the Batch object; expiry
    outputs.py   a batch's output and error files, made from its items as they are read
    webhooks.py  /v1/webhook_endpoints: a tenant's endpoints, told when its batches end
    objects.py   the answers' shapes (pydantic models of OpenAI's), and the OpenAPI schema
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from starlette.concurrency import run_in_threadpool

from specq.api.client import Client
from specq.api.server import batches, errors, files, webhooks
from specq.api.server.limits import Gate
from specq.api.server.uploads import sweep_staging
from specq.configs.presets import load_presets
from specq.configs.settings import Settings, get_settings

log = logging.getLogger(__name__)


async def _expire_now_and_then(app: FastAPI) -> None:
    """Expire the batches past their completion window, every api_expire_every seconds
    (every server does it; expiring twice changes nothing)."""
    every = app.state.settings.api_expire_every
    while True:
        await asyncio.sleep(every)
        try:
            await run_in_threadpool(batches.expire_overdue, app.state.client)
        except Exception:  # noqa: BLE001 (the database may be away for a while)
            log.exception("expiring overdue batches failed; trying again in %.0f s", every)


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or get_settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        swept = sweep_staging(settings.files_dir / ".incoming")
        if swept:
            log.info("%d staging files of dead uploads deleted", swept)
        task = asyncio.create_task(_expire_now_and_then(app))
        yield
        task.cancel()

    app = FastAPI(title="specq", description="The OpenAI Batch API, served by specq",
                  lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.settings = settings
    app.state.client = Client(settings)
    app.state.presets = load_presets(settings.presets_file)
    errors.install(app)
    app.include_router(files.router)
    app.include_router(batches.router)
    app.include_router(webhooks.router)
    _mount_metrics(app, settings)
    app.add_middleware(Gate, settings=settings, client=app.state.client)
    app.add_middleware(errors.HeaderLimit, limit=settings.api_max_header_bytes)
    return app


def _mount_metrics(app: FastAPI, settings: Settings) -> None:
    """GET /metrics: the control plane's Prometheus metrics (api/exporter.py), as `specq
    exporter` serves them; no key asked (counts by pair and status, no tenant's data).
    Absent without prometheus-client."""
    try:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
    except ImportError:
        log.info("no /metrics: prometheus-client is not installed")
        return
    from fastapi import Response

    from specq.api.exporter import registry

    reg = registry(settings, app.state.client.sessions)

    @app.get("/metrics", include_in_schema=False)
    def metrics() -> Response:  # a plain def: FastAPI runs it in its thread pool
        return Response(generate_latest(reg), media_type=CONTENT_TYPE_LATEST)


def serve(host: str, port: int, workers: int = 1, log_level: str = "info") -> None:
    """Run the server (``workers`` processes, each with its own connections)."""
    import uvicorn

    settings = get_settings()
    uvicorn.run("specq.api.server.app:create_app", factory=True, host=host, port=port,
                workers=workers, log_level=log_level, proxy_headers=False,
                timeout_keep_alive=30,  # pollers keep their connection between polls
                # h11 (never httptools, which bounds no header) refuses, in plain text,
                # headers beyond this; ours answer 431 before. Guarded: a head and a body
                # have deadlines, a client a connection cap (protocol.py)
                http="specq.api.server.protocol:GuardedH11Protocol",
                h11_max_incomplete_event_size=max(4 * settings.api_max_header_bytes, 1 << 20))
