"""The HTTP door's targets, measured through the openai SDK against `specq serve`:

    SPECQ_DATABASE_URL=postgresql+psycopg://...scratch specq bench-serve --lines 100000

starts a server (`specq serve`, a subprocess on a free port) and a stand-in worker
(bench/standin.py: answers each request at once, so the batch runs at the control plane's
rate), then measures: the upload of a ``--lines``-line batch file (MB/s) and its batch's
create (lines validated and stored per second); GET /v1/batches/ID latency while
``--pollers`` clients poll it every ``--poll-every`` s during the running batch (p50, p95,
p99); the output file's download (lines/s, streamed); a server restart (the batch and its
output served the same after it); and the server's peak memory while it takes a
``--big-mb`` upload (a fresh server process, so its peak is the upload's).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, Final

from specq.api.client import Client
from specq.configs.settings import Settings, get_settings, subprocess_env
from specq.db import tenants
from specq.db.session import migrate

CHAT: Final = "/v1/chat/completions"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lines", type=int, default=100_000, help="requests in the batch file")
    p.add_argument("--line-bytes", type=int, default=400, help="about this long each (the "
                   "tiny pairs' context is 512 tokens of one byte)")
    p.add_argument("--pair", default="tiny-lookup", help="the stand-in worker's pair")
    p.add_argument("--pollers", type=int, default=100, help="clients polling the batch")
    p.add_argument("--poll-every", type=float, default=1.0, help="seconds between a "
                   "client's polls")
    p.add_argument("--poll-seconds", type=float, default=15.0, help="how long they poll")
    p.add_argument("--big-mb", type=int, default=1024, help="the upload whose server memory "
                   "is measured (0: skip)")
    p.add_argument("--server-workers", type=int, default=1)
    p.add_argument("--output-dir", default="bench-out")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _peak_mb(pid: int) -> float | None:
    try:
        for row in Path(f"/proc/{pid}/status").read_text().splitlines():
            if row.startswith("VmHWM:"):
                return int(row.split()[1]) / 1024
    except OSError:
        return None
    return None


def _cpu_seconds(pid: int) -> float:
    """CPU seconds (user + system) used so far by process ``pid`` and its children (the
    server's uvicorn workers): a cost the machine's other load barely changes, where a
    latency on a shared machine is mostly the wait for a core."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if stat.parent.name == str(pid) or fields[1] == str(pid):  # itself, or a child
            total += (int(fields[11]) + int(fields[12])) / tick
    return total


class Process:
    def __init__(self, argv: list[str], env: dict[str, str], log: Path) -> None:
        self.argv, self.env, self.log = argv, env, log
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", *self.argv], env=self.env,
                                     stdout=self.log.open("a"), stderr=subprocess.STDOUT)

    def exited(self) -> bool:
        """Whether the started process has ended."""
        assert self.proc is not None, "not started"
        return self.proc.poll() is not None

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def _wait_http(url: str, server: Process, timeout: float = 60) -> None:
    import httpx2

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.exited():
            raise RuntimeError(f"the server exited; see {server.log}")
        try:
            httpx2.get(f"{url}/files", timeout=2)
            return
        except httpx2.TransportError:
            time.sleep(0.2)
    raise TimeoutError(f"the server did not answer in {timeout} s; see {server.log}")


def write_file(path: Path, lines: int, line_bytes: int, model: str, tag: str) -> int:
    """A batch file of ``lines`` chat requests of about ``line_bytes`` each; its size."""
    words = "the quick brown fox jumps over the lazy dog and then rests by the river".split()
    rng = random.Random(lines)
    with path.open("w") as f:
        for i in range(lines):
            text = " ".join(rng.choice(words) for _ in range(max(1, line_bytes // 6 - 30)))
            f.write(json.dumps({"custom_id": f"{tag}-{i}", "method": "POST", "url": CHAT,
                                "body": {"model": model, "max_tokens": 8,
                                         "temperature": 0, "messages": [
                                    {"role": "user", "content": f"Rewrite: {text}"}]}}) + "\n")
    return path.stat().st_size


async def _poll(url: str, key: str, batch_id: str, clients: int, every: float,
                seconds: float) -> tuple[list[float], int, int]:
    """``clients`` pollers, each GET every ``every`` s for ``seconds``: latencies (s), how
    many answers said in_progress, and how many requests failed (a dropped connection)."""
    import httpx2

    latencies: list[float] = []
    failures: list[float] = []
    running = 0
    limits = httpx2.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx2.AsyncClient(limits=limits, timeout=30,
                                  headers={"Authorization": f"Bearer {key}"}) as http:
        end = time.monotonic() + seconds

        async def one() -> None:
            nonlocal running
            await asyncio.sleep(random.random() * every)
            while time.monotonic() < end:
                t0 = time.perf_counter()
                try:
                    r = await http.get(f"{url}/batches/{batch_id}")
                except httpx2.TransportError:  # counted, and the poll goes on
                    failures.append(time.perf_counter() - t0)
                    continue
                latencies.append(time.perf_counter() - t0)
                r.raise_for_status()
                running += r.json()["status"] == "in_progress"
                await asyncio.sleep(max(0.0, every - (time.perf_counter() - t0)))

        await asyncio.gather(*(one() for _ in range(clients)))
    return latencies, running, len(failures)


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def bench_serve(args: argparse.Namespace) -> dict[str, Any]:
    import openai

    base = get_settings()
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="specq-bench-serve-"))
    settings: Settings = base.model_copy(update={
        "queue_prefix": f"specq-bench-serve-{uuid.uuid4().hex[:6]}", "api_files_dir": work,
        "api_max_file_bytes": max(2 * 2**30, args.big_mb * 2**20 * 2),
        "api_max_file_lines": max(args.lines, 2_000_000), "api_quota_items": 0,
        "chunk_size": 500})
    migrate(settings.sqlalchemy_url)
    env = subprocess_env(settings)
    port = _free_port()
    url = f"http://127.0.0.1:{port}/v1"
    server = Process(["specq.api.cli", "serve", "--port", str(port), "--workers",
                      str(args.server_workers), "--loglevel", "warning"], env,
                     out / "bench-serve-server.log")
    worker = Process(["specq.bench.standin", "--pair", args.pair, "-n",
                      f"serve-bench@{os.uname().nodename}"], env, out / "bench-serve-worker.log")
    client = Client(settings)
    with client.sessions.begin() as s:
        key = tenants.create_key(s, tenant=f"bench-{uuid.uuid4().hex[:6]}")
    r: dict[str, Any] = {"lines": args.lines, "cores": os.cpu_count(),
                         "database": settings.sqlalchemy_url.split(":")[0],
                         "server_workers": args.server_workers}
    try:
        server.start()
        worker.start()
        _wait_http(url, server)
        deadline = time.monotonic() + 300
        while not client.workers_for(args.pair):
            if time.monotonic() > deadline or worker.exited():
                raise RuntimeError(f"the stand-in worker did not start; see {worker.log}")
            time.sleep(0.5)
        sdk = openai.OpenAI(base_url=url, api_key=key, max_retries=0, timeout=3600)

        path = work / "batch.jsonl"
        size = write_file(path, args.lines, args.line_bytes, args.pair, "b")
        t0 = time.perf_counter()
        with path.open("rb") as f:
            uploaded = sdk.files.create(file=f, purpose="batch")
        r["upload_s"] = time.perf_counter() - t0
        r["upload_mb"] = size / 1e6
        r["upload_mb_per_s"] = size / 1e6 / r["upload_s"]

        assert server.proc is not None  # started above
        t0, cpu = time.perf_counter(), _cpu_seconds(server.proc.pid)
        batch = sdk.batches.create(input_file_id=uploaded.id, endpoint=CHAT,
                                   completion_window="24h")
        r["create_s"] = time.perf_counter() - t0
        r["create_server_cpu_s"] = _cpu_seconds(server.proc.pid) - cpu
        r["create_lines_per_s"] = args.lines / r["create_s"]
        if batch.status == "failed":
            errors = batch.errors.data if batch.errors else None
            raise RuntimeError(f"the batch failed its check: "
                               f"{errors[0].message if errors else batch}")

        cpu = _cpu_seconds(server.proc.pid)
        latencies, running, r["poll_failures"] = asyncio.run(_poll(url, key, batch.id, args.pollers,
                                               args.poll_every, args.poll_seconds))
        r["polls"], r["polls_in_progress"] = len(latencies), running
        r["poll_server_cpu_ms"] = 1000 * (_cpu_seconds(server.proc.pid) - cpu) / max(1, r["polls"])
        r["poll_ms"] = {q: 1000 * _pct(latencies, p) for q, p in
                        (("p50", 0.5), ("p95", 0.95), ("p99", 0.99))}

        while (b := sdk.batches.retrieve(batch.id)).status not in (
                "completed", "failed", "cancelled", "expired"):
            time.sleep(1)
        r["batch_status"] = b.status
        if b.output_file_id is None:
            raise RuntimeError(f"the batch ended {b.status} with no output file")
        t0 = time.perf_counter()
        n = 0
        with sdk.files.with_streaming_response.content(b.output_file_id) as resp:
            for chunk in resp.iter_bytes():
                n += chunk.count(b"\n")
        r["download_s"] = time.perf_counter() - t0
        r["download_lines"] = n
        r["download_lines_per_s"] = n / r["download_s"]

        server.stop()  # a restart: the batch and its output, served the same after it
        server.start()
        _wait_http(url, server)
        again = sdk.batches.retrieve(b.id)
        lines_after = sdk.files.content(again.output_file_id or b.output_file_id).text.count("\n")
        r["restart_same"] = (again.status == b.status and again.request_counts ==
                             b.request_counts and lines_after == n)

        if args.big_mb:
            big = work / "big.jsonl"
            lines = args.big_mb * 2**20 // 1000
            big_size = write_file(big, lines, 1000, args.pair, "g")
            server.stop()  # a fresh process: its peak memory is this upload's
            server.start()
            _wait_http(url, server)
            t0 = time.perf_counter()
            with big.open("rb") as f:
                sdk.files.create(file=f, purpose="batch")
            r["big_upload_mb"] = big_size / 1e6
            r["big_upload_mb_per_s"] = big_size / 1e6 / (time.perf_counter() - t0)
            assert server.proc is not None  # started above
            r["big_upload_server_peak_mb"] = _peak_mb(server.proc.pid)
            big.unlink()
    finally:
        server.stop()
        worker.stop()
    (out / "bench-serve.json").write_text(json.dumps(r, indent=2))
    return r


def run(args: argparse.Namespace) -> int:
    r = bench_serve(args)
    print(f"{r['lines']} lines, {r['database']}, {r['cores']} cores, "
          f"{r['server_workers']} server process(es)")
    print(f"upload      {r['upload_mb']:8.1f} MB in {r['upload_s']:6.2f} s  "
          f"{r['upload_mb_per_s']:8.1f} MB/s        (target >= 50)")
    print(f"create      {r['lines']:8d} lines in {r['create_s']:6.2f} s  "
          f"{r['create_lines_per_s']:8.0f} lines/s     (target >= 10,000; validated, stored, "
          f"sent); server CPU {r['create_server_cpu_s']:.2f} s")
    p = r["poll_ms"]
    print(f"poll        {r['polls']} GETs ({r['polls_in_progress']} while in progress): "
          f"p50 {p['p50']:.1f} ms, p95 {p['p95']:.1f} ms, p99 {p['p99']:.1f} ms, "
          f"{r['poll_failures']} failed  (target p95 < 50); server CPU "
          f"{r['poll_server_cpu_ms']:.2f} ms per GET")
    print(f"download    {r['download_lines']:8d} lines in {r['download_s']:6.2f} s  "
          f"{r['download_lines_per_s']:8.0f} lines/s     (target >= 20,000)")
    print(f"restart     batch and output the same after it: {r['restart_same']}")
    if "big_upload_mb" in r:
        print(f"big upload  {r['big_upload_mb']:8.1f} MB at {r['big_upload_mb_per_s']:.1f} MB/s;"
              f" server peak memory {r['big_upload_server_peak_mb']:.0f} MB  (target < 300)")
    return 0 if r["restart_same"] and r["batch_status"] == "completed" else 1


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    add_arguments(p)
    sys.exit(run(p.parse_args()))


if __name__ == "__main__":
    main()
