"""The HTTP door tried as an attacker and an operator would: floods before and after the
key, forms that never end, kills in the middle of a create or an upload, ids no database
stores. A real `specq serve` (uvicorn in a subprocess) on PostgreSQL and Redis."""

from __future__ import annotations

import json
import select as io
import socket
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from urllib.parse import quote

import httpx2 as httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import func, select, update

from specq.api.client import Client
from specq.db.batches import storable
from specq.db.models import Batch, File, Job, Tenant, utcnow
from tests.conftest import wait_until
from tests.pipeline.conftest import own_deployment
from tests.pipeline.test_http import CHAT, Server, jsonl, line, new_key

MiB = 1 << 20


@pytest.fixture(scope="module")
def abuse_settings(settings, tmp_path_factory):
    return own_deployment(settings, "abuse", api_files_dir=tmp_path_factory.mktemp("files"),
                          api_max_file_bytes=4 * MiB, api_max_file_lines=30_000)


@pytest.fixture(scope="module")
def door(abuse_settings, tmp_path_factory):
    s = Server(abuse_settings, tmp_path_factory.mktemp("door") / "serve.log")
    s.start()
    yield s
    s.stop()


def rss(pid: int) -> int:
    """The process's resident memory, in bytes."""
    for row in Path(f"/proc/{pid}/status").read_text().splitlines():
        if row.startswith("VmRSS:"):
            return int(row.split()[1]) * 1024
    raise AssertionError("no VmRSS")


class Peak:
    """The highest RSS of a process while the block runs (sampled every few ms)."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak, self._stop = pid, 0, threading.Event()

    def __enter__(self) -> Peak:
        self.base = rss(self.pid)
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()
        return self

    def _watch(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss(self.pid))
            time.sleep(0.005)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss(self.pid))

    @property
    def growth(self) -> int:
        return self.peak - self.base


def flood(port: int, path: str, total: int, *, key: str | None = None,
          chunked: bool = False, content_type: str = "application/json",
          block: bytes | None = None, listen: bool = True) -> tuple[int, int, bytes]:
    """POST ``total`` bytes (a block repeated: made lazily, never whole) as fast as the
    server takes them, by Content-Length or chunked; (bytes sent, status, response body).
    It stops sending once the server closed, or answered if ``listen``."""
    block = block or (b"[" + b"1," * (MiB // 2 - 1) + b"1")
    head = [f"POST {path} HTTP/1.1", "Host: door", f"Content-Type: {content_type}"]
    if key:
        head.append(f"Authorization: Bearer {key}")
    head.append("Transfer-Encoding: chunked" if chunked else f"Content-Length: {total}")
    sent = 0
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        s.sendall(("\r\n".join(head) + "\r\n\r\n").encode())
        try:
            while sent < total:
                piece = block[:total - sent]
                s.sendall(b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece)
                sent += len(piece)
                if listen and io.select([s], [], [], 0)[0]:
                    break  # answered (or closed)
            else:
                if chunked:
                    s.sendall(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass
        answer = b""
        try:
            while b"\r\n\r\n" not in answer or not _whole(answer):
                got = s.recv(65536)
                if not got:
                    break
                answer += got
        except ConnectionResetError:
            pass
    head_, _, body = answer.partition(b"\r\n\r\n")
    assert head_, f"no answer after {sent} bytes"
    return sent, int(head_.split()[1]), body


def _whole(answer: bytes) -> bool:
    head, _, body = answer.partition(b"\r\n\r\n")
    for row in head.split(b"\r\n"):
        if row.lower().startswith(b"content-length:"):
            return len(body) >= int(row.split(b":")[1])
    return False


def error_of(body: bytes) -> dict:
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


# -- 1. limits before anything is parsed ---------------------------------------------------

@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_a_300_mb_body_is_refused_with_bounded_memory_with_and_without_a_key(
        door, abuse_settings, chunked):
    key = new_key(abuse_settings)
    pid = door.proc.pid
    for who, status, code in ((None, 401, "missing_api_key"),
                              ("sk-specq-unknown", 401, "invalid_api_key"),
                              (key, 413, "request_too_large")):
        with Peak(pid) as peak:
            sent, got, body = flood(door.port, "/v1/batches", 300 * MiB, key=who,
                                    chunked=chunked)
        assert got == status and error_of(body)["code"] == code, (who, body[:300])
        assert peak.growth < 64 * MiB, f"{who}: the server grew {peak.growth / MiB:.0f} MiB"
    # an upload past its limit (4 MiB here, and its form) too, chunked or not
    with Peak(pid) as peak:
        sent, got, body = flood(door.port, "/v1/files", 300 * MiB, key=key, chunked=chunked,
                                content_type="multipart/form-data; boundary=xyz",
                                block=b"--xyz\r\nContent-Disposition: form-data; "
                                b'name="file"; filename="a.jsonl"\r\n\r\n' + b"{}\n" * MiB)
    assert got == 413 and error_of(body)["code"] in ("request_too_large", "file_too_large")
    assert peak.growth < 64 * MiB
    assert sent < 300 * MiB or not chunked  # answered before the end
    # the server still serves
    assert httpx.get(f"{door.url}/batches", headers={"Authorization": f"Bearer {key}"},
                     timeout=30).status_code == 200
    assert list((abuse_settings.files_dir / ".incoming").iterdir()) == []



def form(*parts: tuple[str, str | None, bytes], boundary: str = "b0undary") -> bytes:
    out = b""
    for name, filename, data in parts:
        disposition = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename
                                                     else "")
        out += f"--{boundary}\r\nContent-Disposition: {disposition}\r\n\r\n".encode()
        out += data + b"\r\n"
    return out + f"--{boundary}--\r\n".encode()


FILE = b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": ' \
    b'{"model": "tiny-fixed", "messages": [{"role": "user", "content": "hi"}]}}\n'


def test_an_upload_form_is_bounded_as_a_whole(door, abuse_settings):
    """Fields past the form's count, a field or part headers too long: 400 as they arrive,
    with memory bounded; unknown fields are dropped, and a form with a few still uploads."""
    key = new_key(abuse_settings)
    headers = {"Authorization": f"Bearer {key}",
               "Content-Type": "multipart/form-data; boundary=b0undary"}
    one_field = form(("x", None, b"y"))[:-len("--b0undary--\r\n")]
    many = one_field * 200_000  # 200,000 extra fields (about 12 MB, chunked: no length)
    with Peak(door.proc.pid) as peak:
        sent, status, body = flood(door.port, "/v1/files", len(many), key=key, chunked=True,
                                   content_type=headers["Content-Type"], block=many)
    assert status == 400 and "more than 16 parts" in error_of(body)["message"]
    assert peak.growth < 64 * MiB
    long_field = form(("purpose", None, b"b" * 10_000), ("file", "a.jsonl", FILE))
    long_head = (b"--b0undary\r\nContent-Disposition: form-data; name=\"file\"; "
                 b"filename=\"a.jsonl\"\r\n" + (b"X-Pad: " + b"p" * 3000 + b"\r\n") * 4
                 + b"\r\n" + FILE + b"\r\n--b0undary--\r\n")
    for data, says, param in ((long_field, "longer than 4096", "purpose"),
                              (long_head, "headers are longer", "file")):
        got = httpx.post(f"{door.url}/files", content=data, headers=headers, timeout=30)
        assert got.status_code == 400 and says in error_of(got.content)["message"], got.text
        assert error_of(got.content)["param"] == param
    # RFC 5987's filename* (curl and browsers send it for names past ASCII) is the name
    star = (b"--b0undary\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n"
            b"--b0undary\r\nContent-Disposition: form-data; name=\"file\"; "
            b"filename*=UTF-8''%E2%82%AC%20rates.jsonl\r\n\r\n" + FILE + b"\r\n--b0undary--\r\n")
    got = httpx.post(f"{door.url}/files", content=star, headers=headers, timeout=30)
    assert got.status_code == 200 and got.json()["filename"] == "\u20ac rates.jsonl", got.text
    extra = form(("purpose", None, b"batch"), ("note", None, b"n" * 4000),
                 ("file", "a.jsonl", FILE), ("user", None, b"ignored"))
    got = httpx.post(f"{door.url}/files", content=extra, headers=headers, timeout=30)
    assert got.status_code == 200 and got.json()["bytes"] == len(FILE), got.text
    assert list((abuse_settings.files_dir / ".incoming").iterdir()) == []


def test_a_cut_upload_is_refused_and_nothing_is_stored(door, abuse_settings):
    """A body that ends before the form's closing boundary (a client or proxy that cut it)
    is refused, not stored as a shorter file: after a whole line of the file part, inside
    a line, or only the closing boundary missing."""
    key = new_key(abuse_settings)
    headers = {"Authorization": f"Bearer {key}",
               "Content-Type": "multipart/form-data; boundary=b0undary"}
    whole = form(("purpose", None, b"batch"), ("file", "a.jsonl", FILE * 3))
    ends = whole.index(FILE) + len(FILE)
    for cut in (whole[:ends], whole[:ends + 10], whole[: -len(b"--b0undary--\r\n")]):
        got = httpx.post(f"{door.url}/files", content=cut, headers=headers, timeout=30)
        assert got.status_code == 400, got.text
        assert "closing boundary" in error_of(got.content)["message"]
    listed = httpx.get(f"{door.url}/files", headers={"Authorization": f"Bearer {key}"},
                       timeout=30).json()["data"]
    assert listed == []
    got = httpx.post(f"{door.url}/files", content=whole, headers=headers, timeout=30)
    assert got.status_code == 200 and got.json()["bytes"] == 3 * len(FILE), got.text
    assert list((abuse_settings.files_dir / ".incoming").iterdir()) == []


def test_a_client_gone_mid_upload_is_no_server_error(door, abuse_settings):
    """A client that disconnects half-way through an upload's body leaves nothing staged
    and no error in the server's log (it is the client's doing, logged as such)."""
    key = new_key(abuse_settings)
    body = form(("purpose", None, b"batch"), ("file", "a.jsonl", FILE * 100))
    head = ["POST /v1/files HTTP/1.1", "Host: door", f"Authorization: Bearer {key}",
            "Content-Type: multipart/form-data; boundary=b0undary",
            f"Content-Length: {len(body)}"]
    before = door.log.read_text()
    with socket.create_connection(("127.0.0.1", door.port), timeout=30) as s:
        s.sendall(("\r\n".join(head) + "\r\n\r\n").encode() + body[: len(body) // 2])
    wait_until(lambda: "disconnected before its body ended" in door.log.read_text()[len(before):],
               timeout=30, what="the server's note of the disconnect")
    logged = door.log.read_text()[len(before):]
    assert "Traceback" not in logged and " failed" not in logged, logged
    assert list((abuse_settings.files_dir / ".incoming").iterdir()) == []


# -- 2, 3. a create or an upload killed at any point ----------------------------------------

def batches_and_orphans(settings, tenant_key_batches: list[str]) -> tuple[dict, int]:
    """{batch id: (status, job id, its files)} of these batches, and the jobs of this
    deployment (its queue prefix) that no batch points at."""
    with Client(settings).sessions() as s:
        rows = {b.openai_id: (b.status, b.job_id, s.scalar(
                    select(func.count()).select_from(File).where(File.batch_id == b.id)))
                for b in s.scalars(select(Batch).where(Batch.openai_id.in_(tenant_key_batches)))}
        linked = select(Batch.job_id).where(Batch.job_id.is_not(None))
        orphans = s.scalar(select(func.count()).select_from(Job).where(
            Job.queue.like(f"{settings.queue_prefix}.%"), Job.id.not_in(linked)))
    return rows, orphans


def test_kill_9_during_a_create_or_an_upload_leaves_nothing_stuck(abuse_settings, tmp_path):
    """The server is killed (SIGKILL) after the batch row is stored, inside the job's
    transaction, and after the job is sent; and in the middle of an upload. After a restart:
    no batch stays validating, no job without its batch, no staging file left; a retry with
    the same Idempotency-Key makes a new batch where the first had no job."""
    settings = abuse_settings.model_copy(update={
        "queue_prefix": f"{abuse_settings.queue_prefix}-kill", "api_validating_timeout": 2.0,
        "api_expire_every": 0.5})
    key = new_key(settings)
    auth = {"Authorization": f"Bearer {key}"}
    incoming = settings.files_dir / ".incoming"
    server = Server(settings, tmp_path / "serve.log")
    server.start()
    f = httpx.post(f"{server.url}/files", headers=auth, data={"purpose": "batch"}, timeout=60,
                   files={"file": ("in.jsonl", jsonl([line(f"r{i}", "hello") for i in range(
                       200)]))}).json()
    # an upload killed half way: its staging file is left behind by the dead server
    big = 4 * MiB  # the upload limit here (50 MB is past it: refused unread)
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(f"POST /v1/files HTTP/1.1\r\nHost: d\r\nAuthorization: Bearer {key}\r\n"
                  f"Content-Type: multipart/form-data; boundary=xyz\r\n"
                  f"Content-Length: {big}\r\n\r\n".encode())
        s.sendall(b'--xyz\r\nContent-Disposition: form-data; name="file"; '
                  b'filename="a.jsonl"\r\n\r\n' + FILE * 15_000)
        wait_until(lambda: any(p.stat().st_size for p in incoming.glob("*.part")), 60,
                   "the upload staged")
        server.proc.kill()
        server.proc.wait(30)
    assert list(incoming.iterdir())

    made = {point: uuid.uuid4().hex for point in ("batch", "job", "sent")}  # -> its key
    dying = {point: Server(settings, tmp_path / f"serve-{point}.log") for point in made}
    for point, d in dying.items():
        d.env = {"SPECQ_API_FAULT": point}
    with ThreadPoolExecutor(len(dying)) as pool:  # (started side by side: faster)
        list(pool.map(Server.start, dying.values()))
    for point, d in dying.items():
        with pytest.raises(httpx.TransportError):
            httpx.post(f"{d.url}/batches", timeout=120, json={
                "input_file_id": f["id"], "endpoint": CHAT, "completion_window": "24h"},
                headers={**auth, "Idempotency-Key": made[point]})
        assert d.proc.wait(30) == -9

    server.start()  # a restart: the staging directory swept, the dead creates failed
    try:
        assert list(incoming.iterdir()) == []
        listed = httpx.get(f"{server.url}/batches", headers=auth, timeout=30).json()["data"]
        assert len(listed) == 3  # "job" made a batch row, then died before its job
        ids = [b["id"] for b in listed]

        def settled():
            rows, orphans = batches_and_orphans(settings, ids)
            return (rows, orphans) if all(r[0] != "validating" for r in rows.values()) else None

        rows, orphans = wait_until(settled, 60, "the dead creates failed")
        assert orphans == 0
        assert sorted((status, job is not None, files) for status, job, files in rows.values()
                      ) == [("failed", False, 0), ("failed", False, 0), ("submitted", True, 2)]
        for point, idem in made.items():
            again = httpx.post(f"{server.url}/batches", timeout=120, json={
                "input_file_id": f["id"], "endpoint": CHAT, "completion_window": "24h"},
                headers={**auth, "Idempotency-Key": idem})
            assert again.status_code == 200 and again.json()["status"] == "in_progress"
            first = [b for b in listed if rows[b["id"]][1] is not None]
            if point == "sent":  # it was whole: the same batch
                assert again.json()["id"] == first[0]["id"]
            else:
                assert again.json()["id"] not in ids
        stuck = [b for b in httpx.get(f"{server.url}/batches", headers=auth,
                                      timeout=30).json()["data"] if b["status"] == "failed"]
        assert {b["errors"]["data"][0]["code"] for b in stuck} == {"batch_not_created"}
        assert batches_and_orphans(settings, [])[1] == 0
    finally:
        server.stop()


# -- 4. ids and bodies no database stores --------------------------------------------------

NASTY = st.sampled_from(["\x00", "\ud800", "\udfff", "a\x00b", "\ufffd", "%00", "'", "\"",
                         "\\", "../", "file-\x00", "batch_\ud83d", "\u202e", " ", "é" * 70])
TEXT = st.one_of(NASTY, st.text(max_size=80), st.builds(lambda a, b: a + b, st.text(max_size=20),
                                                        NASTY))


def in_path(text: str) -> str:
    """``text`` percent-encoded as a path segment (a lone surrogate as its 3 bytes)."""
    return quote(text.encode("utf-8", "surrogatepass"), safe="")


def refused_well(got: httpx.Response) -> None:
    assert got.status_code < 500, got.text
    if got.status_code >= 400:
        error_of(got.content)


@pytest.fixture(scope="module")
def fuzzed(door, abuse_settings):
    """An HTTP client of a new tenant, with one batch file of its own."""
    key = new_key(abuse_settings)
    with httpx.Client(base_url=door.url, timeout=60,
                      headers={"Authorization": f"Bearer {key}"}) as http:
        f = http.post("/files", data={"purpose": "batch"},
                      files={"file": ("in.jsonl", jsonl([line("a", "hi")]))}).json()
        yield http, f["id"]


FUZZ = settings(max_examples=15, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture])


@FUZZ
@given(ident=TEXT, query=TEXT)
def test_fuzzed_ids_are_a_404_or_a_400_never_a_500(fuzzed, ident, query):
    http, _ = fuzzed
    segment = in_path(ident) or "x"
    for method, path in (("GET", f"/files/{segment}"), ("GET", f"/files/{segment}/content"),
                         ("DELETE", f"/files/{segment}"), ("GET", f"/batches/{segment}"),
                         ("POST", f"/batches/{segment}/cancel")):
        got = http.request(method, path)
        assert got.status_code in (400, 404), (method, ident, got.text)
        error_of(got.content)
    q = in_path(query)
    for path in (f"/files?after={q}", f"/files?purpose={q}", f"/batches?after={q}",
                 f"/files?order={q}", f"/batches?limit={q}"):
        refused_well(http.get(path))


@FUZZ
@given(input_file_id=TEXT, endpoint=st.one_of(st.just(CHAT), TEXT),
       window=st.one_of(st.just("24h"), TEXT),
       metadata=st.dictionaries(TEXT, TEXT, max_size=3), key=st.text(
           st.characters(min_codepoint=0x20, max_codepoint=0xFF), max_size=40))
def test_fuzzed_create_bodies_are_refused_cleanly(fuzzed, input_file_id, endpoint, window,
                                                  metadata, key):
    http, file_id = fuzzed
    for fid in (input_file_id, file_id):
        body = json.dumps({"input_file_id": fid, "endpoint": endpoint,
                           "completion_window": window, "metadata": metadata})  # \u escapes
        got = http.post("/batches", content=body, headers={
            "Content-Type": "application/json",
            **({"Idempotency-Key": key.encode("latin-1")} if key.strip() else {})})
        refused_well(got)
        if got.status_code == 200:
            assert http.post(f"/batches/{got.json()['id']}/cancel").status_code == 200


@FUZZ
@given(custom_id=TEXT, content=TEXT, extra=st.dictionaries(TEXT, TEXT, max_size=2),
       filename=TEXT)
def test_fuzzed_request_lines_are_refused_naming_the_line(fuzzed, custom_id, content, extra,
                                                          filename):
    http, _ = fuzzed
    request = {**line("ok", "fine"), "custom_id": custom_id}
    request["body"]["messages"][0]["content"] = content
    request["body"].update({f"x_{k}": v for k, v in extra.items()})
    data = (json.dumps(line("first", "hello")) + "\n" + json.dumps(request) + "\n").encode()
    up = http.post("/files", data={"purpose": "batch"}, files={
        "file": (filename.encode("utf-8", "surrogatepass").decode("latin-1"), data)})
    refused_well(up)
    if up.status_code != 200:
        return
    got = http.post("/batches", json={"input_file_id": up.json()["id"], "endpoint": CHAT,
                                      "completion_window": "24h"})
    refused_well(got)
    texts = [custom_id, content, *extra, *extra.values()]
    if not all(storable(t) for t in texts):  # the batch fails, naming the line
        assert got.status_code == 200 and got.json()["status"] == "failed", got.text
        error = got.json()["errors"]["data"][0]
        assert (error["line"], error["code"]) == (2, "invalid_value"), error
        assert error["param"] and error["message"].startswith(error["param"]), error
        assert got.json()["specq"] is None  # no job was stored
    elif got.status_code == 200:
        http.post(f"/batches/{got.json()['id']}/cancel")


# -- 5. a batch that waits says why ---------------------------------------------------------

def test_a_batch_whose_pair_no_worker_serves_says_so_while_it_waits(fuzzed):
    """No worker serves this deployment's queues: the batch stays in progress (a worker may
    still come up) and its `specq.waiting` says why."""
    http, file_id = fuzzed
    made = http.post("/batches", json={"input_file_id": file_id, "endpoint": CHAT,
                                       "completion_window": "24h"}).json()
    got = http.get(f"/batches/{made['id']}").json()
    assert got["status"] == "in_progress" and got["errors"] is None
    assert "no worker is consuming" in got["specq"]["waiting"]
    assert "specq worker --pair tiny-fixed" in got["specq"]["waiting"]
    listed = http.get("/batches").json()["data"]
    assert [b["specq"]["waiting"] for b in listed if b["id"] == made["id"]] == [
        got["specq"]["waiting"]]
    cancelled = http.post(f"/batches/{made['id']}/cancel").json()
    assert cancelled["status"] == "cancelled" and cancelled["specq"]["waiting"] is None


# -- 5. connections that hold the door without finishing anything ------------------------

@pytest.fixture(scope="module")
def guarded(settings, tmp_path_factory):
    """A server with deadlines and a cap small enough to reach in a test."""
    own = own_deployment(settings, "guard", api_files_dir=tmp_path_factory.mktemp("files"),
                         api_header_timeout=2.0, api_body_timeout=3.0,
                         api_max_client_connections=6)
    s = Server(own, tmp_path_factory.mktemp("guard") / "serve.log")
    s.start()
    yield s, own
    s.stop()


def closed_by_server(sock: socket.socket, within: float) -> bool:
    """True if the server closes ``sock`` within ``within`` seconds without answering."""
    sock.settimeout(within)
    try:
        return sock.recv(65536) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_heads_and_bodies_that_never_end_are_cut_and_a_client_is_capped(guarded):
    """Slowloris: a head left unfinished, or dripped a byte at a time, is cut at its
    deadline; a body that stops is cut; one that arrives slowly but steadily is served; a
    client past its connection cap is closed as it connects, and served again once under."""
    server, own = guarded
    key = new_key(own)
    ok = (f"GET /v1/batches HTTP/1.1\r\nHost: door\r\nAuthorization: Bearer {key}\r\n"
          "Connection: close\r\n\r\n").encode()
    address = ("127.0.0.1", server.port)
    with socket.create_connection(address) as idle, socket.create_connection(address) as drip:
        idle.sendall(b"GET /v1/batches HTTP/1.1\r\nHost: door\r\n")
        head, sent = b"GET /v1/batches HTTP/1.1\r\nHost: door\r\nX-Pad: " + b"a" * 300, 0
        try:  # a byte every 0.1 s: 30 s for the whole head, were it never cut
            for sent in range(len(head)):
                drip.sendall(head[sent:sent + 1])
                time.sleep(0.1)
        except (BrokenPipeError, ConnectionResetError):
            pass
        assert sent < len(head) - 1, "a head dripped for 30 s was never cut"
        assert closed_by_server(idle, 30), "an unfinished head was never cut"
    body = json.dumps({"input_file_id": "file-x", "endpoint": "/v1/chat/completions",
                       "completion_window": "24h"}).encode()
    post = (f"POST /v1/batches HTTP/1.1\r\nHost: door\r\nAuthorization: Bearer {key}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n").encode()
    with socket.create_connection(address) as stalled:
        stalled.sendall(post + body[:10])
        assert closed_by_server(stalled, 30), "a body that stopped was never cut"
    with socket.create_connection(address) as steady:  # 0.3 s apart, 5 s in all: served
        steady.sendall(post)
        for i in range(0, len(body), max(1, len(body) // 16)):
            steady.sendall(body[i:i + max(1, len(body) // 16)])
            time.sleep(0.3)
        steady.settimeout(30)
        assert steady.recv(65536).split(b"\r\n")[0] == b"HTTP/1.1 404 Not Found"  # no file
    held = [socket.create_connection(address) for _ in range(6)]
    try:
        with socket.create_connection(address) as extra:
            extra.sendall(ok)
            assert closed_by_server(extra, 30), "a client past its cap was served"
    finally:
        for s in held:
            s.close()
    assert wait_until(lambda: httpx.get(f"{server.url}/batches", timeout=10, headers={
        "Authorization": f"Bearer {key}"}).status_code == 200, 30, "not served again")
    assert wait_until(lambda: "connections closed:" in server.log.read_text(), 30,
                      "the refusals were not logged")


def test_a_batch_left_validating_by_a_dead_create_can_be_cancelled(door, abuse_settings):
    """OpenAI cancels a validating batch; so does specq, at once, even where the server
    that was creating it died (it would otherwise wait out SPECQ_API_VALIDATING_TIMEOUT),
    and the batch stays cancelled with no job."""
    tenant = f"t-{uuid.uuid4().hex[:8]}"
    key = new_key(abuse_settings, tenant)
    client = Client(abuse_settings)
    with client.sessions.begin() as s:
        tenant_id = s.scalar(select(Tenant.id).where(Tenant.name == tenant))
        now = utcnow()
        s.add(Batch(openai_id=f"batch_{uuid.uuid4().hex[:24]}", tenant_id=tenant_id,
                    status="validating", input_file_id="file-x", endpoint=CHAT,
                    completion_window="24h", created_at=now, expires_at=now + timedelta(days=1)))
    http = httpx.Client(base_url=door.url, headers={"Authorization": f"Bearer {key}"},
                        timeout=30)
    (stuck,) = http.get("/batches").json()["data"]
    assert stuck["status"] == "validating"
    got = http.post(f"/batches/{stuck['id']}/cancel")
    assert got.status_code == 200 and got.json()["status"] == "cancelled", got.text
    assert got.json()["cancelled_at"] and got.json()["specq"] is None
    assert http.get(f"/batches/{stuck['id']}").json()["status"] == "cancelled"
    again = http.post(f"/batches/{stuck['id']}/cancel")
    assert again.status_code == 400 and error_of(again.content)["code"] == "batch_not_cancellable"


def send_then_read(port: int, head: list[str], body_pieces, *, wait_continue: float = 1.0
                   ) -> tuple[BaseException | None, bytes]:
    """A client that sends its whole body before it reads a word of the answer (curl with
    ``Expect: 100-continue`` once its second of waiting for the 100 is up): (what sending
    raised, everything read after it, up to the server's close)."""
    raised: BaseException | None = None
    answer = b""
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        s.sendall(("\r\n".join(head) + "\r\n\r\n").encode())
        if io.select([s], [], [], wait_continue)[0]:
            answer = s.recv(65536)  # a 100 Continue (or an answer already)
        try:
            for piece in body_pieces:
                s.sendall(piece)
        except OSError as exc:  # a reset, or a broken pipe: the server closed on it
            raised = exc
        try:
            while got := s.recv(65536):
                answer += got
        except ConnectionResetError as exc:
            raised = raised or exc
    return raised, answer


def test_an_answer_given_mid_body_reaches_a_client_that_sends_before_it_reads(
        door, abuse_settings):
    """A body past its cap is answered 413 while it still arrives. Closed at once, the
    connection's unread bytes turned into a reset and a client that sends before it reads
    (curl) saw "connection reset" instead: the connection now lingers, reading and dropping
    what still comes, so the whole body goes out and the 413 is read after it."""
    key = new_key(abuse_settings)
    block = b"{}\n" * (MiB // 3)
    part = (b"--xyz\r\nContent-Disposition: form-data; name=\"file\"; "
            b"filename=\"a.jsonl\"\r\n\r\n")
    pieces = [b"%x\r\n%s\r\n" % (len(part), part)]
    pieces += [b"%x\r\n%s\r\n" % (len(block), block)] * 64  # 64 MiB past a 4 MiB cap
    pieces.append(b"0\r\n\r\n")
    for expect in (True, False):
        head = ["POST /v1/files HTTP/1.1", "Host: door", f"Authorization: Bearer {key}",
                "Content-Type: multipart/form-data; boundary=xyz",
                "Transfer-Encoding: chunked"] + (["Expect: 100-continue"] if expect else [])
        raised, answer = send_then_read(door.port, head, pieces)
        assert raised is None, f"expect={expect}: the client's sending failed: {raised!r}"
        final = answer.split(b"HTTP/1.1 ")[-1]
        assert final.startswith(b"413 "), (expect, answer[:300])
        assert error_of(final.partition(b"\r\n\r\n")[2])["code"] in (
            "request_too_large", "file_too_large")


def test_a_cancel_sent_again_while_cancelling_gets_the_batch(door, abuse_settings):
    """A client that retries its cancel (its first answer lost to a timeout) gets the
    cancelling batch again, not a 400; a batch that has ended is still not cancellable."""
    tenant = f"t-{uuid.uuid4().hex[:8]}"
    key = new_key(abuse_settings, tenant)
    client = Client(abuse_settings)
    job = client.submit(["Say hi"], pair="tiny", enqueue=False)  # stored; no worker runs it
    with client.sessions.begin() as s:
        tenant_id = s.scalar(select(Tenant.id).where(Tenant.name == tenant))
        s.execute(update(Job).where(Job.id == job.id).values(status="cancelling"))
        now = utcnow()  # what a cancel of a running job leaves while its chunk finishes
        s.add(Batch(openai_id=f"batch_{uuid.uuid4().hex[:24]}", tenant_id=tenant_id,
                    job_id=job.id, status="submitted", input_file_id="file-x", endpoint=CHAT,
                    completion_window="24h", created_at=now, in_progress_at=now,
                    cancelling_at=now, expires_at=now + timedelta(days=1)))
    http = httpx.Client(base_url=door.url, headers={"Authorization": f"Bearer {key}"},
                        timeout=30)
    (batch,) = http.get("/batches").json()["data"]
    assert batch["status"] == "cancelling"
    for _ in range(2):
        again = http.post(f"/batches/{batch['id']}/cancel")
        assert again.status_code == 200, again.text
        assert again.json()["status"] == "cancelling"
        assert again.json()["cancelling_at"] == batch["cancelling_at"]
    with client.sessions.begin() as s:
        s.execute(update(Job).where(Job.id == job.id).values(status="cancelled"))
    ended = http.post(f"/batches/{batch['id']}/cancel")
    assert ended.status_code == 400 and error_of(ended.content)["code"] == "batch_not_cancellable"
