"""The OpenAI Batch API over HTTP, through the official `openai` SDK: a real uvicorn server
(`specq serve`, a subprocess on a free port) on PostgreSQL and Redis, and a real worker.
Every response is parsed by the SDK's own types (FileObject, Batch, the cursor pages)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx2 as httpx  # the HTTP client the openai SDK itself uses
import openai
import pytest
from sqlalchemy import create_engine, func, select, text

from specq.api.client import Client
from specq.configs.settings import subprocess_env
from specq.db import tenants
from specq.db.models import Batch, File, Item, Job
from tests.conftest import wait_until
from tests.pipeline.conftest import own_deployment

ROOT = Path(__file__).resolve().parents[2]
CHAT = "/v1/chat/completions"
MODEL = "tiny-fixed"  # a preset name (the tiny target is shared by four presets)


def line(cid: str, content: str, max_tokens: int = 8, model: str = MODEL, **body) -> dict:
    """A request line; greedy unless ``body`` says otherwise (OpenAI's default is 1)."""
    return {"custom_id": cid, "method": "POST", "url": CHAT,
            "body": {"model": model, "messages": [{"role": "user", "content": content}],
                     "max_tokens": max_tokens, "temperature": 0, **body}}


def jsonl(lines: list[dict]) -> bytes:
    return "".join(json.dumps(x) + "\n" for x in lines).encode()


class Server:
    """`specq serve` in a subprocess, on a free port; its log in a file."""

    def __init__(self, settings, log: Path) -> None:
        self.settings, self.log = settings, log
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self.proc: subprocess.Popen | None = None
        self.env: dict[str, str] = {}  # more environment (SPECQ_API_FAULT)

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "specq.api.cli", "serve", "--port", str(self.port)],
            cwd=ROOT, env={**subprocess_env(self.settings), **self.env},
            stdout=self.log.open("a"),
            stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log.read_text()[-3000:]
            try:
                if httpx.get(f"{self.url}/files", timeout=2).status_code == 401:
                    return
            except httpx.TransportError:
                time.sleep(0.2)
        raise TimeoutError(self.log.read_text()[-3000:])

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(20)


@pytest.fixture(scope="module")
def http_settings(settings, tmp_path_factory):
    """Its own queue prefix and file directory; limits small enough to reach in a test."""
    return own_deployment(
        settings, "http", api_files_dir=tmp_path_factory.mktemp("files"),
        api_max_file_bytes=2_000_000, api_max_file_lines=3000, api_quota_items=2500,
        api_expire_every=0.5, api_max_header_bytes=8192, chunk_size=25)


@pytest.fixture(scope="module")
def server(http_settings, tmp_path_factory):
    s = Server(http_settings, tmp_path_factory.mktemp("server") / "serve.log")
    s.start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def worker(http_settings, start_worker):
    return start_worker(http_settings, MODEL, "http")


def new_key(settings, tenant: str | None = None) -> str:
    with Client(settings).sessions.begin() as s:
        return tenants.create_key(s, tenant=tenant or f"t-{uuid.uuid4().hex[:8]}")


@pytest.fixture
def sdk(server, http_settings):
    """An SDK client of a new tenant (no retries: each refusal is seen as it is)."""
    return openai.OpenAI(base_url=server.url, api_key=new_key(http_settings), max_retries=0)


def wait_for(sdk, batch_id: str, statuses: tuple[str, ...], timeout: float = 240):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        batch = sdk.batches.retrieve(batch_id)
        if batch.status in statuses:
            return batch
        time.sleep(0.2)
    raise TimeoutError(f"{batch_id}: still {batch.status} ({batch.request_counts})")


def upload(sdk, lines: list[dict] | bytes, name: str = "in.jsonl"):
    data = lines if isinstance(lines, bytes) else jsonl(lines)
    return sdk.files.create(file=(name, data), purpose="batch")


def create(sdk, file_id: str, **kw):
    kw.setdefault("completion_window", "24h")
    return sdk.batches.create(input_file_id=file_id, endpoint=CHAT, **kw)


def outputs(sdk, file_id: str | None) -> list[dict]:
    return [json.loads(x) for x in sdk.files.content(file_id).text.splitlines()] if file_id else []


# -- the whole path -------------------------------------------------------------------------

def test_upload_create_poll_download_and_a_restart_loses_nothing(
        sdk, server, worker, http_settings, tmp_path):
    prompts = [f"Rewrite sentence {i}: the quick brown fox jumps over the lazy dog"
               for i in range(40)]
    lines = [line(f"req-{i}", p, max_tokens=12) for i, p in enumerate(prompts)]
    f = upload(sdk, lines)
    assert (f.object, f.purpose, f.bytes, f.filename) == ("file", "batch", len(jsonl(lines)),
                                                          "in.jsonl")
    assert sdk.files.retrieve(f.id) == f
    assert sdk.files.content(f.id).content == jsonl(lines)

    batch = create(sdk, f.id, metadata={"priority": "high", "team": "a"},
                   output_expires_after={"anchor": "created_at", "seconds": 7200})
    assert batch.status == "in_progress" and batch.request_counts.total == 40
    assert batch.model == MODEL and batch.metadata == {"priority": "high", "team": "a"}
    done = wait_for(sdk, batch.id, ("completed", "failed", "expired", "cancelled"))
    assert done.status == "completed", worker.output()
    assert (done.request_counts.completed, done.request_counts.failed) == (40, 0)
    assert done.completed_at and done.in_progress_at and done.finalizing_at
    assert done.error_file_id is None and done.output_file_id
    assert [x.filename for x in sdk.files.list()] == [f"{batch.id}_output.jsonl", "in.jsonl"]
    output = sdk.files.retrieve(done.output_file_id)
    assert output.expires_at == done.completed_at + 7200  # output_expires_after, from its end
    assert output.created_at == done.completed_at  # made whole there, as OpenAI makes it
    size = output.bytes  # known before any download
    assert size > 0 and size == len(sdk.files.content(done.output_file_id).content)

    got = outputs(sdk, done.output_file_id)
    assert [x["custom_id"] for x in got] == [f"req-{i}" for i in range(40)]  # input order
    for x in got:
        body = x["response"]["body"]
        assert x["response"]["status_code"] == 200 and x["error"] is None
        assert body["object"] == "chat.completion" and body["model"] == MODEL
        assert body["usage"]["completion_tokens"] >= 1
    tokens_out = sum(x["response"]["body"]["usage"]["completion_tokens"] for x in got)
    tokens_in = sum(x["response"]["body"]["usage"]["prompt_tokens"] for x in got)
    assert (done.usage.input_tokens, done.usage.output_tokens, done.usage.total_tokens) == (
        tokens_in, tokens_out, tokens_in + tokens_out)  # the SDK's BatchUsage
    # its output is no batch's input: a 400 saying so, not a file unknown
    with pytest.raises(openai.BadRequestError) as err:
        create(sdk, done.output_file_id)
    assert err.value.code == "invalid_input_file" and "purpose batch_output" in err.value.message
    figures = done.model_extra["specq"]  # specq's figures, kept by the SDK as an extra field
    assert figures["pair"] == MODEL and figures["acceptance_rate"] is not None
    assert figures["mean_acceptance_length"] >= 1 and figures["tokens_per_second"] > 0
    with Client(http_settings).sessions() as s:
        assert s.get(Job, figures["job_id"]).priority == "high"  # metadata.priority

    # greedy outputs through HTTP are `specq run`'s for the same lines, token for token
    path = tmp_path / "in.jsonl"
    path.write_bytes(jsonl(lines))
    db = tmp_path / "run.db"
    env = {**subprocess_env(http_settings), "SPECQ_DATABASE_URL": f"sqlite:///{db}"}
    run = subprocess.run([sys.executable, "-m", "specq.api.cli", "run", str(path), "--pair",
                          MODEL, "-o", str(tmp_path / "out.jsonl")], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    embedded = {r["custom_id"]: r["output"] for r in map(json.loads,
                                                         (tmp_path / "out.jsonl").open())}
    assert {x["custom_id"]: x["response"]["body"]["choices"][0]["message"]["content"]
            for x in got} == embedded
    with create_engine(f"sqlite:///{db}").connect() as conn:
        run_tokens = dict(conn.execute(text("SELECT custom_id, token_ids FROM items")).all())
    with Client(http_settings).sessions() as s:
        http_tokens = dict(s.execute(select(Item.custom_id, Item.token_ids)
                                     .where(Item.job_id == figures["job_id"])).all())
    assert {k: json.loads(v) for k, v in run_tokens.items()} == http_tokens

    # a restart of the server loses nothing: the database holds every batch and file
    server.stop()
    server.start()
    again = sdk.batches.retrieve(batch.id)
    assert again.status == "completed" and again.request_counts == done.request_counts
    assert outputs(sdk, again.output_file_id) == got
    assert sdk.files.content(f.id).content == jsonl(lines)


def test_a_response_format_shapes_the_answers(sdk, worker):
    """OpenAI's json_schema response_format and vLLM's guided_choice, through the SDK: an
    answer that finished parses and validates."""
    schema = {"type": "object", "required": ["label", "note"], "additionalProperties": False,
              "properties": {"label": {"enum": ["good", "bad"]},
                             "note": {"type": "string", "maxLength": 6}}}
    shape = {"type": "json_schema", "json_schema": {"name": "label", "schema": schema,
                                                    "strict": True}}
    lines = [line(f"s{i}", f"Label item {i}", max_tokens=40, response_format=shape)
             for i in range(4)] + [line("pick", "Pick one", guided_choice=["yes", "no"])]
    done = wait_for(sdk, create(sdk, upload(sdk, lines).id).id,
                    ("completed", "failed", "expired", "cancelled"))
    assert done.status == "completed", worker.output()
    got = {x["custom_id"]: x["response"]["body"]["choices"][0]
           for x in outputs(sdk, done.output_file_id)}
    finished = [c for cid, c in got.items() if cid != "pick" and c["finish_reason"] == "stop"]
    assert finished
    for choice in finished:
        answer = json.loads(choice["message"]["content"])
        assert set(answer) == {"label", "note"} and answer["label"] in ("good", "bad")
        assert isinstance(answer["note"], str) and len(answer["note"]) <= 6
    assert got["pick"]["message"]["content"] in ("yes", "no")

    # a response_format the library refuses fails the batch, naming the line and field
    bad = line("b", "y", response_format={"type": "regex", "regex": "(a"})
    failed = create(sdk, upload(sdk, [line("a", "x"), bad]).id)
    assert failed.status == "failed"
    (error,) = failed.errors.data
    assert error.line == 2 and error.param == "body.response_format"
    assert "regex: the grammar library refused it" in error.message


def test_cancel_mid_run_keeps_what_finished_and_a_running_batch_downloads_partial(
        sdk, worker):
    lines = [line(f"c{i}", f"Count the words of line {i}: a b c d e f g", max_tokens=40)
             for i in range(400)]
    batch = create(sdk, upload(sdk, lines).id)
    deadline = time.monotonic() + 120
    while sdk.batches.retrieve(batch.id).request_counts.completed == 0:
        assert time.monotonic() < deadline, worker.output()
        time.sleep(0.05)
    running = sdk.batches.retrieve(batch.id)
    raw = sdk.files.with_raw_response.content(running.output_file_id)
    partial = [json.loads(x) for x in raw.text.splitlines()]
    if raw.headers["specq-partial"] == "true":  # what has finished so far, in input order
        # (the status read before may be older than the content: the batch may end between)
        indices = [int(x["custom_id"][1:]) for x in partial]
        assert indices == sorted(indices) and 0 < len(indices) < 400

    cancelling = sdk.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled") and cancelling.cancelling_at
    done = wait_for(sdk, batch.id, ("cancelled", "completed"))
    assert done.status == "cancelled" and done.cancelled_at
    counts = done.request_counts
    kept = outputs(sdk, done.output_file_id)
    errors = outputs(sdk, done.error_file_id)
    assert len(kept) == counts.completed and 0 < counts.completed < 400
    assert len(kept) + len(errors) == 400
    assert {x["custom_id"] for x in kept} | {x["custom_id"] for x in errors} == {
        f"c{i}" for i in range(400)}
    assert all(x["error"]["code"] == "batch_cancelled" for x in errors)
    assert sdk.files.with_raw_response.content(done.output_file_id).headers[
        "specq-partial"] == "false"
    with pytest.raises(openai.BadRequestError) as err:  # a finished batch is not cancelled
        sdk.batches.cancel(batch.id)
    assert err.value.code == "batch_not_cancellable"


def test_a_batch_past_its_window_expires_with_its_requests_in_the_error_file(sdk, server):
    # a pair no worker serves: nothing runs before the window ends, whatever the timing
    lines = [line(f"e{i}", "never run", model="tiny-lookup") for i in range(5)]
    batch = create(sdk, upload(sdk, lines).id, completion_window="1s")
    assert batch.expires_at - batch.created_at == 1
    done = wait_for(sdk, batch.id, ("expired",), timeout=60)
    assert done.expired_at and done.request_counts.completed == 0
    errors = outputs(sdk, done.error_file_id)
    assert [x["custom_id"] for x in errors] == [f"e{i}" for i in range(5)]
    assert {x["error"]["code"] for x in errors} == {"batch_expired"}
    assert done.output_file_id is None  # no request completed: no output file, as OpenAI's


# -- tenants --------------------------------------------------------------------------------

def test_another_tenants_files_and_batches_are_not_found(sdk, server, http_settings):
    other = openai.OpenAI(base_url=server.url, api_key=new_key(http_settings), max_retries=0)
    f = upload(sdk, [line("x", "hello", model="tiny-lookup")])
    batch = create(sdk, f.id)
    for call in (lambda: other.files.retrieve(f.id), lambda: other.files.content(f.id),
                 lambda: other.files.delete(f.id), lambda: other.batches.retrieve(batch.id),
                 lambda: other.batches.cancel(batch.id),
                 lambda: other.files.content(batch.output_file_id),
                 lambda: create(other, f.id)):
        with pytest.raises(openai.NotFoundError) as err:
            call()
        assert err.value.body["type"] == "invalid_request_error"
    assert [b.id for b in other.batches.list()] == []
    assert [x.id for x in other.files.list()] == []
    assert sdk.batches.cancel(batch.id).status == "cancelled"  # its own tenant still can


def test_a_revoked_or_missing_key_is_refused(server, http_settings):
    name = f"revoked-{uuid.uuid4().hex[:6]}"
    made = subprocess.run([sys.executable, "-m", "specq.api.cli", "keys", "create", name],
                          env=subprocess_env(http_settings), capture_output=True, text=True,
                          timeout=60, cwd=ROOT)
    key = made.stdout.strip().splitlines()[-1]  # the last line is the key itself
    assert made.returncode == 0 and key.startswith("sk-specq-") and key not in made.stderr
    sdk = openai.OpenAI(base_url=server.url, api_key=key, max_retries=0)
    assert sdk.files.list().data == []
    with Client(http_settings).sessions() as s:  # stored hashed
        assert key not in str(s.execute(text("SELECT key_hash, prefix FROM api_keys")).all())
    listed = subprocess.run([sys.executable, "-m", "specq.api.cli", "keys", "list"],
                            env=subprocess_env(http_settings), capture_output=True, text=True,
                            timeout=60, cwd=ROOT)
    assert name in listed.stdout and key not in listed.stdout
    revoked = subprocess.run([sys.executable, "-m", "specq.api.cli", "keys", "revoke", name],
                             env=subprocess_env(http_settings), capture_output=True, text=True,
                             timeout=60, cwd=ROOT)
    assert revoked.returncode == 0

    def refused() -> openai.AuthenticationError | None:
        try:
            sdk.files.list()
        except openai.AuthenticationError as exc:
            return exc
        return None

    # a server trusts a key it found live for KEY_TTL (2 s): refused within that bound
    err = wait_until(refused, timeout=60, what="the revoked key refused")
    assert err.code == "invalid_api_key" and key not in str(err)
    missing = httpx.get(f"{server.url}/batches")
    assert missing.status_code == 401 and missing.json()["error"]["code"] == "missing_api_key"


def test_a_quota_on_unfinished_requests_answers_429(sdk):
    lines = [line(f"q{i}", "x", model="tiny-lookup") for i in range(2501)]  # quota 2500
    f = upload(sdk, lines)
    with pytest.raises(openai.RateLimitError) as err:
        create(sdk, f.id)
    assert "2500" in err.value.message and err.value.code == "quota_exceeded"
    assert err.value.response.headers["x-should-retry"] == "false"  # the SDK asked once
    assert sdk.batches.list().data == []


def test_the_quota_is_the_tenants_whatever_key_it_uses(server, http_settings):
    """Two keys of one tenant share its quota: 1500 requests through each is past 2500."""
    tenant = f"t-{uuid.uuid4().hex[:8]}"
    first, second = (openai.OpenAI(base_url=server.url, api_key=new_key(http_settings, tenant),
                                   max_retries=0) for _ in range(2))
    lines = [line(f"k{i}", "x", model="tiny-lookup") for i in range(1500)]
    made = create(first, upload(first, lines).id)
    with pytest.raises(openai.RateLimitError) as err:
        create(second, upload(second, lines).id)
    assert "1500 unfinished" in err.value.message
    assert [b.id for b in second.batches.list()] == [made.id]  # one tenant: one list
    first.batches.cancel(made.id)


def test_creates_at_the_same_moment_cannot_pass_the_quota_together(sdk):
    """Each create counts the tenant's unfinished requests, its batches still validating
    included, with the tenant's row held: of four creates of 1000 requests sent at once
    under a quota of 2500, two are made and two answered 429, whichever they are."""
    from concurrent.futures import ThreadPoolExecutor

    f = upload(sdk, [line(f"c{i}", "x", model="tiny-lookup") for i in range(1000)])

    def attempt(_):
        try:
            return create(sdk, f.id).id
        except openai.RateLimitError as err:
            assert err.code == "quota_exceeded"
            return None

    with ThreadPoolExecutor(4) as pool:
        made = [b for b in pool.map(attempt, range(4)) if b is not None]
    assert len(made) == 2
    assert sorted(b.id for b in sdk.batches.list()) == sorted(made)
    for b in made:
        sdk.batches.cancel(b)


# -- paging and idempotency -----------------------------------------------------------------

def test_lists_page_newest_first(sdk):
    f = upload(sdk, [line("p", "hello", model="tiny-lookup")])
    made = [create(sdk, f.id).id for _ in range(5)]
    page = sdk.batches.list(limit=2)
    assert [b.id for b in page.data] == made[::-1][:2] and page.has_more
    assert [b.id for b in sdk.batches.list(limit=2, after=page.data[-1].id).data] == \
        made[::-1][2:4]
    assert [b.id for b in sdk.batches.list(limit=2)] == made[::-1]  # the SDK pages by after
    files = sdk.files.list(limit=1)
    assert len(files.data) == 1 and files.has_more
    # the input and 5 outputs; no error file while no request failed or was cancelled
    assert len(list(sdk.files.list(limit=3))) == 1 + 5
    for b in made:
        sdk.batches.cancel(b)
    assert len(list(sdk.files.list(limit=3))) == 1 + 2 * 5  # now 5 error files too


def test_a_loop_deleting_what_it_lists_pages_to_the_end(sdk):
    """The SDK pages with the last id of a page; deleted as they are listed, that file is
    gone when the next page is asked for: the listing goes on past it, newest first or
    oldest first."""
    for order in ("desc", "asc"):
        made = [upload(sdk, [line(f"d{i}", "x")], name=f"{i}.jsonl").id for i in range(7)]
        deleted = []
        for f in sdk.files.list(limit=3, order=order):
            assert sdk.files.delete(f.id).deleted
            deleted.append(f.id)
        assert deleted == (made if order == "asc" else made[::-1])
        assert sdk.files.list().data == []


def test_an_upload_whose_bytes_are_gone_is_a_404_not_a_cut_body(sdk, http_settings):
    """A row whose bytes went from under it (a sweep or a delete racing the download) is
    answered 404 before any byte, not 200 with a body cut short."""
    from specq.api.server.uploads import store_path

    f = upload(sdk, [line("g", "gone")])
    store_path(http_settings.files_dir, f.id).unlink()
    with pytest.raises(openai.NotFoundError):
        sdk.files.content(f.id)


def test_the_same_idempotency_key_gives_the_same_batch(sdk):
    f = upload(sdk, [line("i", "hello", model="tiny-lookup")])
    key = {"Idempotency-Key": uuid.uuid4().hex}
    first = create(sdk, f.id, extra_headers=key)
    again = create(sdk, f.id, extra_headers=key)
    assert again.id == first.id and len(sdk.batches.list().data) == 1
    with pytest.raises(openai.ConflictError) as err:
        create(sdk, f.id, extra_headers=key, metadata={"other": "body"})
    assert err.value.code == "idempotency_key_reused"
    assert err.value.response.headers["x-should-retry"] == "false"
    sdk.batches.cancel(first.id)


# -- bad input: a clear OpenAI error, and nothing stored or started -------------------------

def counts(settings) -> tuple[int, int, int]:
    with Client(settings).sessions() as s:
        return tuple(s.scalar(select(func.count()).select_from(m)) for m in (File, Batch, Job))


# (file, code, what the message says); the first ones are refused by the upload, at the
# speed of the bytes (each line parsed as JSON), the rest when a batch is made of the file
BAD_UPLOADS = {
    "not JSONL": (b"custom_id,prompt\nx,hello\n", "invalid_json_line", "line 1"),
    "not UTF-8": (jsonl([line("a", "ok")]) + b'{"custom_id": "\xff"}\n', "invalid_utf8",
                  "line 2"),
    "empty": (b"\n\n", "empty_file", "no requests"),
    "too many lines": (jsonl([line(f"n{i}", "x") for i in range(3001)]), "too_many_lines",
                       "3000"),
    "not JSON": (jsonl([line("a", "x")]) + b"{custom_id: b}\n", "invalid_json_line",
                 "line 2"),
    "two objects on a line": (jsonl([line("a", "x")]).rstrip(b"\n") * 2 + b"\n",
                              "invalid_json_line", "Extra data"),
    "lines ended by a lone CR": (jsonl([line("a", "x"), line("b", "y")]).replace(b"\n", b"\r"),
                                 "invalid_json_line", "line 1"),
}
BAD_REQUESTS = {
    "mixed models": (jsonl([line("a", "x"), line("b", "y", model="tiny")]), "mixed_models",
                     "line 2"),
    "unknown model": (jsonl([line("a", "x", model="gpt-4o")]), "model_not_found",
                      "not served here"),
    "a model id several presets share": (jsonl([line("a", "x", model="tiny:target")]),
                                         "model_not_found", "several pairs"),
    "duplicate custom_id": (jsonl([line("a", "x"), line("a", "y")]), "duplicate_custom_id",
                            "line 2"),
    "stream": (jsonl([line("a", "x", stream=True)]), "stream_not_supported", "body.stream"),
    "no url": (jsonl([{k: v for k, v in line("a", "x").items() if k != "url"}]),
               "missing_url", "url: required"),
    "unsupported url": (jsonl([{**line("a", "x"), "url": "/v1/embeddings"}]),
                        "unsupported_url", "/v1/embeddings"),
}


@pytest.mark.parametrize("case", list(BAD_UPLOADS))
def test_a_bad_file_is_refused_whole(sdk, http_settings, case):
    data, code, says = BAD_UPLOADS[case]
    before = counts(http_settings)
    with pytest.raises(openai.BadRequestError) as err:
        upload(sdk, data)
    assert err.value.code == code and says in err.value.message
    assert err.value.body["type"] == "invalid_request_error"
    assert counts(http_settings) == before
    assert list((http_settings.files_dir / ".incoming").iterdir()) == []


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_a_file_of_bad_requests_makes_a_failed_batch_naming_the_line(sdk, http_settings,
                                                                      case):
    """OpenAI's split: a problem of the request is a 400 at create; a problem of a line
    fails the batch, its `errors` naming the line, and no job is stored."""
    data, code, says = BAD_REQUESTS[case]
    f = upload(sdk, data)
    before = counts(http_settings)
    failed = create(sdk, f.id)
    assert failed.status == "failed" and failed.failed_at and failed.output_file_id is None
    # no request of a batch that failed validation counts (as OpenAI counts them)
    assert (failed.request_counts.total, failed.request_counts.failed) == (0, 0)
    error = failed.errors.data[0]
    assert error.code == code and says in f"line {error.line}: {error.message}", error
    assert counts(http_settings) == (before[0], before[1] + 1, before[2])  # no job
    assert sdk.batches.retrieve(failed.id).errors == failed.errors


def test_a_line_the_scan_refuses_hides_no_other_bad_line(sdk, http_settings):
    """A custom_id used again (found by the scan of the lines) and parameters out of range
    (found by the full check) each have their error, one per line, in line order."""
    f = upload(sdk, [line("a", "x", max_tokens="8"), line("b", "y", n=2),
                     line("c", "z", temperature=True), line("a", "w")])
    before = counts(http_settings)
    failed = create(sdk, f.id)
    assert failed.status == "failed"
    assert [(e.line, e.param) for e in failed.errors.data] == [
        (1, "body.max_tokens"), (2, "body.n"), (3, "body.temperature"), (4, "custom_id")]
    assert failed.errors.data[3].code == "duplicate_custom_id"
    assert counts(http_settings)[2] == before[2]  # no job


def test_refusals_of_uploads_and_creates(sdk, server, http_settings):
    before = counts(http_settings)
    with pytest.raises(openai.BadRequestError) as err:
        sdk.files.create(file=("a.jsonl", jsonl([line("a", "x")])), purpose="fine-tune")
    assert err.value.param == "purpose"
    with pytest.raises(openai.APIStatusError) as err:  # over SPECQ_API_MAX_FILE_BYTES
        upload(sdk, jsonl([line(f"b{i}", "y" * 2000) for i in range(1100)]))
    assert err.value.status_code == 413 and err.value.code == "file_too_large"
    with pytest.raises(openai.NotFoundError):
        create(sdk, "file-nope")
    assert counts(http_settings) == before

    f = upload(sdk, [line("a", "x"), line("b", "y", temperature=-1)])
    before = counts(http_settings)
    for kw, param in ((dict(endpoint="/v1/embeddings"), "endpoint"),
                      (dict(endpoint="/v1/completions"), "endpoint"),
                      (dict(endpoint=CHAT, completion_window="forever"), "completion_window"),
                      (dict(endpoint=CHAT, metadata={"priority": "urgent"}),
                       "metadata.priority"),
                      # an argument OpenAI does not know (misspelt), and one not served
                      (dict(endpoint=CHAT, extra_body={"completion_windw": "1h"}),
                       "completion_windw"),
                      (dict(endpoint=CHAT, output_expires_after={
                          "anchor": "created_at", "seconds": 60}),
                       "output_expires_after.seconds")):
        with pytest.raises(openai.BadRequestError) as err:
            sdk.batches.create(input_file_id=f.id, **{"completion_window": "24h", **kw})
        assert err.value.param == param, kw
    assert counts(http_settings) == before

    # a line that fails the full check fails the batch, naming the line; no job is stored
    failed = create(sdk, f.id)
    assert failed.status == "failed" and failed.failed_at
    (error,) = failed.errors.data
    assert error.line == 2 and error.param == "body.temperature"
    assert error.message.startswith("body.temperature: ")
    f = upload(sdk, [line("a", "x"), line("b", "y", max_tokens=10**8)])
    (error,) = create(sdk, f.id).errors.data  # specq's max_new_tokens is OpenAI's max_tokens
    assert (error.line, error.param) == (2, "body.max_tokens"), error
    f = upload(sdk, [line("a", "x"), line("b", "y", max_tokens=None,
                                          max_completion_tokens=10**8)])
    failed = create(sdk, f.id)
    (error,) = failed.errors.data  # the line's own name of it
    assert (error.line, error.param) == (2, "body.max_completion_tokens"), error
    assert failed.usage is None and failed.model_extra["specq"] is None  # no job: null
    assert error.message.startswith("body.max_completion_tokens: 100000000 after a ")
    assert counts(http_settings)[2] == before[2]

    headers = {"Authorization": f"Bearer {sdk.api_key}", "Content-Type": "application/json"}
    bad = httpx.post(f"{server.url}/batches", content=b'{"input_file_id": ', headers=headers)
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_json"
    missing = httpx.post(f"{server.url}/batches", json={"endpoint": CHAT}, headers=headers)
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "input_file_id"
    for body, said in ((b"", "none was sent"), (b"[]", "got an array"), (b"null", "none was"),
                       (b"7", "got a number"), (b'"x"', "got a string")):
        odd = httpx.post(f"{server.url}/batches", content=body, headers=headers)
        assert odd.status_code == 400 and said in odd.json()["error"]["message"], (body, odd.text)
    plain = httpx.post(f"{server.url}/batches", content=b'{"input_file_id": "file-x"}',
                       headers={**headers, "Content-Type": "text/plain"})
    assert plain.status_code == 400 and plain.json()["error"]["code"] == "invalid_content_type"
    assert "text/plain" in plain.json()["error"]["message"]
    huge = httpx.get(f"{server.url}/batches", headers={**headers, "X-Big": "x" * 10_000})
    assert huge.status_code == 431 and huge.json()["error"]["code"] == "headers_too_large"
    nowhere = httpx.get(f"{server.url}/nothing", headers=headers)
    assert nowhere.status_code == 404 and set(nowhere.json()["error"]) == {
        "message", "type", "param", "code"}
    assert counts(http_settings)[1:] == (before[1] + 3, before[2])  # the failed batches alone
    assert os.listdir(http_settings.files_dir / ".incoming") == []


def test_files_kept_in_the_database_serve_as_those_in_a_directory(http_settings, tmp_path):
    """SPECQ_API_FILE_STORE=database (servers on several machines): an upload lands in
    file_parts, a mebibyte a row, and reads back, and a batch is made from it."""
    kept = Server(http_settings.model_copy(update={"api_file_store": "database"}),
                  tmp_path / "serve.log")
    kept.start()
    try:
        sdk = openai.OpenAI(base_url=kept.url, api_key=new_key(http_settings), max_retries=0)
        lines = [line(f"d{i}", "z" * 400, model="tiny-lookup") for i in range(2400)]
        f = upload(sdk, lines)
        assert sdk.files.content(f.id).content == jsonl(lines)
        with Client(http_settings).sessions() as s:
            parts = s.execute(text("SELECT COUNT(*) FROM file_parts p JOIN files f ON "
                                   "f.id = p.file_id WHERE f.openai_id = :f"),
                              {"f": f.id}).scalar()
        assert parts == 2  # 1.3 MB, in parts of 1 MiB
        batch = create(sdk, f.id)
        assert batch.status == "in_progress" and batch.request_counts.total == 2400
        assert sdk.batches.cancel(batch.id).status == "cancelled"
        sdk.files.delete(f.id)
        with pytest.raises(openai.NotFoundError):
            sdk.files.retrieve(f.id)
    finally:
        kept.stop()


def test_serve_mounts_the_control_planes_metrics(server):
    """GET /metrics (no key: counts by pair and status, no tenant's data) is the exporter's
    collector (api/exporter.py)."""
    base = server.url.removesuffix("/v1")
    got = httpx.get(f"{base}/metrics", timeout=30)
    assert got.status_code == 200 and got.headers["content-type"].startswith("text/plain")
    assert "specq_jobs{" in got.text and "specq_database_up 1.0" in got.text
