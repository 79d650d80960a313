"""The `specq` command: submit, follow and read jobs; run workers; the embedded `run`."""

from __future__ import annotations

import argparse
import contextlib
import difflib
import json
import logging
import math
import os
import re
import signal
import sys
import time
from collections.abc import Callable, Iterator
from importlib import import_module
from typing import Any, NoReturn

from pydantic import ValidationError
from sqlalchemy.exc import ArgumentError, OperationalError, ProgrammingError

from specq.api import formats
from specq.api.client import Client
from specq.api.figures import counted, drafted, drafting, item_counts, shown
from specq.api.formats import FORMATS
from specq.api.inputs import InputError, check_count, check_job_id, describe, show
from specq.api.outputs import OutputError, check_output, same_file
from specq.broker.names import PRIORITIES
from specq.configs.presets import PairError, PresetError
from specq.configs.settings import describe_settings, get_settings, mask_url, unknown_settings

log = logging.getLogger(__name__)

SAMPLING_FLAGS = ("max_new_tokens", "temperature", "top_p", "top_k", "stop", "seed")


# Commands whose modules load the model stack (torch, transformers): imported only when
# one of them runs, so that every other command starts in a fraction of a second.
HEAVY = {
    "bench": ("specq.bench", "when does speculation pay? methods side by side"),
    "bench-pipeline": ("specq.bench.pipeline",
                       "the job path's overhead over the engine alone"),
    "bench-startup": ("specq.bench.startup",
                      "a worker's start, phase by phase: import, load, warm-up, calibration"),
    "bench-chaos": ("specq.bench.chaos", "one job through kills, a broker flush, outages and "
                    "engine faults: lost, duplicated, wrongly failed"),
    "bench-fleet": ("specq.bench.fleet", "the control plane at scale: a big job, many "
                    "workers, a stand-in engine; rates, waits, memory, a small job behind it"),
    "bench-metrics": ("specq.bench.scrape", "what a Prometheus scrape costs: a worker's "
                      "against its step, the exporter's with a million-item job stored"),
    "bench-gpu": ("specq.bench.gpu", "the engine proved and measured on one device from "
                  "models built here: lossless, throughput, pass costs, device paths"),
    "bench-serve": ("specq.bench.serve", "the HTTP door: upload and create rates, polling "
                    "latency, download rate, a restart, memory during a big upload"),
}


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args, rest = p.parse_known_args(argv)
    if rest and not getattr(args, "heavy", None):
        _unrecognized(p, sys.argv[1:] if argv is None else argv, rest)
    args.rest = rest
    _log_to_stderr(args.verbose)
    for line in unknown_settings():
        log.warning("%s", line)
    try:
        code = args.func(args) or 0
        sys.stdout.flush()  # here, where a reader that went away is caught, not at exit
        return code
    except BrokenPipeError:
        return _reader_gone()
    except (InputError, OutputError, PresetError) as exc:
        return _fail([str(exc)], 2)
    except PairError as exc:  # a model that cannot be found, fetched or read
        return _fail([str(exc)], 1)
    except ValidationError as exc:  # SPECQ_* settings, read when first needed
        return _fail(describe_settings(exc) if exc.title == "Settings" else describe(exc), 2)
    except (KeyError, TimeoutError, RuntimeError) as exc:
        return _fail([str(exc.args[0] if exc.args else exc)], 1)
    except OSError as exc:  # a file that cannot be read or written, a full disk
        where = f"{exc.filename}: " if exc.filename else ""
        return _fail([f"{where}{exc.strerror or exc}"], 1)
    except (OperationalError, ProgrammingError, ArgumentError) as exc:  # down, no schema
        first = (str(getattr(exc, "orig", None) or exc).strip().splitlines() or [""])[0]
        return _fail([f"database: {type(exc).__name__}: {first}{database_hint(first)}"], 1)


# What a database error means for the person who reads it: the next true step.
_DATABASE_HINTS = (
    (r'database "([^"]+)" does not exist',
     "; create it first (`createdb {0}`, or CREATE DATABASE {0} in psql), then run "
     "`specq migrate`"),
    (r'role "([^"]+)" does not exist',
     "; no such user on the server: check the user in SPECQ_DATABASE_URL (`specq config`)"),
    (r"password authentication failed|no password supplied",
     "; check the user and password in SPECQ_DATABASE_URL (`specq config`; characters such "
     "as @ : / ? # % + in a password must be percent-encoded)"),
    (r"permission denied",
     "; the user lacks the right: connect as the database's owner, or GRANT it"),
    (r'no such table|relation "[^"]+" does not exist|UndefinedTable',
     "; the schema is missing or old: run `specq migrate`"),
    (r"Connection refused|could not translate host name|timeout expired|Name or service",
     "; is the server running, and are the host and port in SPECQ_DATABASE_URL right? "
     "(`specq config`)"),
    (r"unable to open database file",
     "; the SQLite file's directory cannot be written (SPECQ_DATA_DIR or the file in "
     "SPECQ_DATABASE_URL; `specq config`)"),
)


def database_hint(message: str) -> str:
    """'; what to do next' for a database error's first line ('' when there is nothing
    better to say than the error itself)."""
    for pattern, hint in _DATABASE_HINTS:
        found = re.search(pattern, message)
        if found:
            return hint.format(*found.groups())
    return ""


def _reader_gone() -> int:
    """stdout's reader closed it (`specq jobs --json | head`): stop quietly with the status
    of a process ended by SIGPIPE (128 + 13), as Unix tools do. What is still buffered goes
    to /dev/null, so the interpreter's last flush raises nothing either."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 141


class _Plain(logging.Formatter):
    """'warning: MESSAGE', as the CLI's own errors read."""

    def format(self, record: logging.LogRecord) -> str:
        return f"{record.levelname.lower()}: {record.getMessage()}"


def _log_to_stderr(verbose: bool) -> None:
    """Warnings and errors as 'warning: ...' lines, each said once: a command leaves the
    warnings the client logs (a broker that cannot be reached) to this handler instead of
    printing them again. -v: INFO records too, with time and logger."""
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
                         if verbose else _Plain())
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, handlers=[handler])


@contextlib.contextmanager
def _term_is_exit() -> Iterator[None]:
    """SIGTERM (`kill`, `timeout`) ends the block as Ctrl-C does, by an exception, so an
    output being written is taken back (api/outputs.py: no part file left behind); the
    process then ends with 143, as one killed by SIGTERM."""
    def _exit(signum: int, frame: object) -> NoReturn:
        raise SystemExit(128 + signum)

    before = signal.signal(signal.SIGTERM, _exit)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


def _fail(lines: list[str], code: int) -> int:
    """Print 'error: LINE' for each line (printable text only); return the exit code."""
    for line in lines:
        print(f"error: {line}".encode("utf-8", "backslashreplace").decode("utf-8"),
              file=sys.stderr)
    return code


def _unrecognized(p: argparse.ArgumentParser, argv: list[str], rest: list[str]) -> NoReturn:
    """An argument no parser took: refused by the command's own parser (its -h named), with
    the flag it may mean."""
    name = next((a for a in argv if not a.startswith("-")), "")
    command: argparse.ArgumentParser = next((a.choices.get(name) for a in p._actions
                                             if isinstance(a, argparse._SubParsersAction)),
                                            None) or p
    flags = [f for action in command._actions for f in action.option_strings]
    close = [f for f in difflib.get_close_matches(rest[0].split("=")[0], flags, n=1)
             if f != rest[0]]  # after "--" a flag is an argument: no flag to suggest
    command.error(f"unrecognized arguments: {' '.join(rest)}"
                  + (f"; did you mean {close[0]}?" if close else ""))


class _Parser(argparse.ArgumentParser):
    """argparse with errors on one line: 'specq status: error: argument job: ...'."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {show(message, 300)} (see {self.prog} -h)\n")


def _converter(name: str, check: Callable[[str], Any]) -> Callable[[str], Any]:
    """An argparse type from ``check`` (text → value, ValueError when bad); argparse names
    the flag in its message."""
    def convert(text: str) -> Any:
        try:
            return check(text)
        except InputError as exc:  # 'field: message': argparse names the flag instead
            raise argparse.ArgumentTypeError(exc.problems[0].split(": ", 1)[-1]) from None
        except ValueError as exc:  # OutputError included
            raise argparse.ArgumentTypeError(str(exc).removeprefix("output: ")) from None
    convert.__name__ = name  # argparse's 'invalid NAME value' when it is not our error
    return convert


def _to_int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"must be an integer, got {show(text)}") from None


def _count(low: int = 1) -> Callable[[str], int]:
    """A 32-bit integer of at least ``low`` (ids, counts, chunk sizes, token counts)."""
    return _converter("count", lambda t: check_count("value", _to_int(t), low=low))


def _number(low: float = 0.0, inclusive: bool = True) -> Callable[[str], float]:
    """A finite float of at least ``low`` (more than ``low`` unless ``inclusive``)."""
    def check(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise ValueError(f"must be a number, got {show(text)}") from None
        if not math.isfinite(value):
            raise ValueError(f"must be a finite number, got {show(text)}")
        if value < low or (value == low and not inclusive):
            raise ValueError(f"must be {'at least' if inclusive else 'more than'} {low:g}, "
                             f"got {show(text)}")
        return value
    return _converter("number", check)


def _seed(text: str) -> int:
    value = _to_int(text)
    if not 0 <= value < 2**63:
        raise ValueError(f"must be from 0 to {2**63 - 1}, got {show(text)}")
    return value


IMAGE_SUFFIXES = ("", ".png", ".pdf", ".svg", ".svgz", ".jpg", ".jpeg", ".webp", ".gif",
                  ".tif", ".tiff", ".eps", ".ps")  # what matplotlib's savefig writes


def _image(text: str) -> str:
    if text == "-":
        raise OutputError("output: an image needs a file, not stdout")
    suffix = os.path.splitext(text)[1].lower()
    if suffix not in IMAGE_SUFFIXES:
        raise OutputError(f"output: {show(text)}: not an image file name "
                          f"({', '.join(s for s in IMAGE_SUFFIXES if s)})")
    from specq.api.report import image_path

    drawn = str(image_path(text))  # the file drawn: NAME.png for a NAME
    check_output(drawn)
    return check_output(text) if drawn != text else text  # a directory NAME: a slip


_job_id = _converter("job id", lambda t: check_job_id(_to_int(t)))
_output = _converter("output", check_output)
_image_output = _converter("output", _image)
_log_level = _converter("log level", lambda t: _choice(
    t.upper(), ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")).lower())


def _choice(value: str, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise ValueError(f"must be one of {', '.join(choices)}, got {show(value)}")
    return value


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="specq", description=__doc__)
    p.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = p.add_subparsers(required=True, metavar="COMMAND")

    s = sub.add_parser("submit", help="validate and store a JSONL file, send it to workers")
    s.add_argument("file", help="a JSONL file, or - for standard input")
    s.add_argument("--pair", required=True)
    _job_flags(s)
    s.add_argument("--priority", choices=list(PRIORITIES), default="normal",
                   help="the job's waiting chunks go before those of lower-priority jobs on "
                        "the pair's queue; jobs of one priority take turns")
    s.add_argument("--wait", action="store_true", help="wait with a progress bar")
    s.set_defaults(func=cmd_submit)

    s = sub.add_parser("run", help="the embedded default: the whole flow in this process")
    s.add_argument("file", help="a JSONL file, or - for standard input")
    s.add_argument("--pair", default="smollm2-135m")
    s.add_argument("--output", "-o", default="results.jsonl", type=_output,
                   help="file, or - for stdout (the metrics then go to stderr)")
    s.add_argument("--format", "-f", default=None, choices=FORMATS,
                   help="as specq results: jsonl, openai, parquet (default: parquet for a "
                        ".parquet file, else jsonl)")
    s.add_argument("--json", action="store_true",
                   help="print the job's metrics as JSON (default: the table of specq metrics)")
    _job_flags(s)
    s.set_defaults(func=cmd_run)

    s = sub.add_parser("status", help="a job's status and counts")
    s.add_argument("job", type=_job_id)
    s.add_argument("--watch", action="store_true",
                   help="refresh progress and acceptance rate until the job finishes")
    s.add_argument("--interval", type=_number(0.0, inclusive=False), default=2.0,
                   help="seconds between refreshes")
    s.set_defaults(func=cmd_status)

    s = sub.add_parser("cancel", help="cancel a job at its next chunk")
    s.add_argument("job", type=_job_id)
    s.set_defaults(func=cmd_cancel)

    s = sub.add_parser("retry", help="send a job's failed items back to the workers")
    s.add_argument("job", type=_job_id)
    s.set_defaults(func=cmd_retry)

    s = sub.add_parser("reconcile", help="re-send every chunk the broker lost (all jobs or one)")
    s.add_argument("job", type=_job_id, nargs="?", help="only this job")
    s.add_argument("--json", action="store_true",
                   help="the pass as JSON: candidates (chunks not done, not leased, not sent "
                        "recently), on_broker, resent, resent_by_job, fed, settled")
    s.set_defaults(func=cmd_reconcile)

    s = sub.add_parser("metrics", help="a job's acceptance metrics, draft lengths, tokens/s")
    s.add_argument("job", type=_job_id)
    s.add_argument("--json", action="store_true", help="every figure as JSON")
    s.set_defaults(func=cmd_metrics)

    s = sub.add_parser("report", help="draw a job's metrics to a PNG")
    s.add_argument("job", type=_job_id)
    s.add_argument("--output", "-o", default="report.png", type=_image_output)
    s.set_defaults(func=cmd_report)

    s = sub.add_parser("results", help="export a job's items (streamed): jsonl, openai, parquet")
    s.add_argument("job", type=_job_id)
    s.add_argument("--output", "-o", default="-", type=_output, help="file, or - for stdout")
    s.add_argument("--format", "-f", default=None, choices=FORMATS,
                   help="jsonl (stored outcomes), openai (Batch API output lines), parquet "
                        "(default: parquet for a .parquet file, else jsonl)")
    s.add_argument("--no-input", dest="input", action="store_false",
                   help="leave out each item's prompt, messages and parameters (jsonl, "
                        "parquet): smaller files, joined back by index or custom_id")
    s.set_defaults(func=cmd_results)

    s = sub.add_parser("jobs", help="the latest jobs")
    s.add_argument("--limit", type=_count(), default=20)
    s.add_argument("--schedule", help="only the runs of this beat schedule")
    s.add_argument("--json", action="store_true",
                   help="a JSON array, an object per job: state, drafting and figures "
                        "(job_metrics)")
    s.set_defaults(func=cmd_jobs)

    synth = sub.add_parser("synth", help="dataset synthesis from a spec (configs/synth/*.yaml)")
    ssub = synth.add_subparsers(required=True, metavar="ACTION")
    s = ssub.add_parser("run", help="check the spec, submit it; with --wait write its data set")
    s.add_argument("spec")
    s.add_argument("--wait", action="store_true", help="wait, then write the output data set")
    s.add_argument("--timeout", type=_number(0.0, inclusive=False),
                   help="seconds to wait at most")
    s.set_defaults(func=cmd_synth_run)
    s = ssub.add_parser("check", help="validate a spec (every row rendered); submits nothing")
    s.add_argument("spec")
    s.set_defaults(func=cmd_synth_check)
    s = ssub.add_parser("write", help="write a finished synthesis job's data set")
    s.add_argument("job", type=_job_id)
    s.set_defaults(func=cmd_synth_write)
    s = ssub.add_parser("runs", help="the runs of one beat schedule and their metrics")
    s.add_argument("schedule")
    s.add_argument("--limit", type=_count(), default=20)
    s.add_argument("--json", action="store_true", help="JSON, as specq jobs --json")
    s.set_defaults(func=cmd_jobs)

    s = sub.add_parser("beat", help="Celery beat for configs/schedules.yaml (one, anywhere)")
    s.add_argument("--loglevel", default="info", type=_log_level)
    s.set_defaults(func=cmd_beat)

    s = sub.add_parser("worker", help="run a Celery worker for one pair (one per GPU)")
    s.add_argument("--pair", required=True)
    s.add_argument("--loglevel", default="info", type=_log_level)
    s.add_argument("--hostname", "-n", default=None, help="worker name (default PAIR@HOST)")
    s.set_defaults(func=cmd_worker)

    s = sub.add_parser("serve", help="the OpenAI Files and Batches API over HTTP (each tenant "
                       "behind its own key: specq keys)")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on")
    s.add_argument("--port", type=_count(), default=8000)
    s.add_argument("--workers", type=_count(), default=1, help="server processes")
    s.add_argument("--loglevel", default="info", type=_log_level)
    s.set_defaults(func=cmd_serve)

    s = sub.add_parser("exporter", help="serve the control plane's Prometheus metrics (queue "
                                        "depth per pair, jobs by status, reconciler actions)")
    s.add_argument("--port", type=_count(), default=9500, help="port of /metrics")
    s.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (0.0.0.0 for a Prometheus on another host)")
    s.set_defaults(func=cmd_exporter)

    keys = sub.add_parser("keys", help="API keys of the HTTP server's tenants")
    ksub = keys.add_subparsers(required=True, metavar="ACTION")
    s = ksub.add_parser("create", help="a new key for tenant NAME (made if new); the last "
                        "line printed is the key, shown this once")
    s.add_argument("name")
    s.set_defaults(func=cmd_keys_create)
    s = ksub.add_parser("list", help="every key: tenant, first characters, created, revoked")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_keys_list)
    s = ksub.add_parser("revoke", help="revoke tenant NAME's keys (or the one shown as --key)")
    s.add_argument("name")
    s.add_argument("--key", help="only the key whose first characters `keys list` shows")
    s.set_defaults(func=cmd_keys_revoke)

    hooks = sub.add_parser("webhooks", help="endpoints told when a batch or a job ends "
                           "(signed, at least once), and their sender")
    hsub = hooks.add_subparsers(required=True, metavar="ACTION")
    s = hsub.add_parser("add", help="a new endpoint: tenant NAME's batches (--tenant), or "
                        "every job (none); the last line printed is its secret, shown once")
    s.add_argument("url")
    s.add_argument("--tenant", help="the tenant whose batch.* events it gets (default: the "
                   "operator's endpoint, which gets job.* events of every job)")
    s.add_argument("--name", default="", help="a name to tell endpoints apart")
    s.add_argument("--event", action="append", dest="events", metavar="TYPE",
                   help="an event type it wants (repeatable; default: all of its kind)")
    s.set_defaults(func=cmd_webhooks_add)
    s = hsub.add_parser("list", help="every endpoint: id, tenant, url, events, deliveries")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_webhooks_list)
    s = hsub.add_parser("remove", help="delete endpoint ID (we_...) and its deliveries")
    s.add_argument("id")
    s.set_defaults(func=cmd_webhooks_remove)
    s = hsub.add_parser("rotate", help="a new signing secret for endpoint ID, printed once")
    s.add_argument("id")
    s.add_argument("--keep-old", type=_number(0.0), default=0.0, metavar="SECONDS",
                   help="the old secret signs too for SECONDS (receivers switch meanwhile)")
    s.set_defaults(func=cmd_webhooks_rotate)
    s = hsub.add_parser("send", help="the sender: post due events with retries until stopped")
    s.add_argument("--once", action="store_true", help="post what is due now, then exit")
    s.set_defaults(func=cmd_webhooks_send)

    s = sub.add_parser("sweep", help="delete what expired: uploads past expires_after, and "
                       "old outputs and results per SPECQ_RETENTION_*")
    s.add_argument("--every", type=_number(0.0, inclusive=False), metavar="SECONDS",
                   help="sweep again every SECONDS until stopped (default: one pass)")
    s.set_defaults(func=cmd_sweep)

    s = sub.add_parser("migrate", help="create or upgrade the database schema (alembic)")
    s.set_defaults(func=cmd_migrate)

    s = sub.add_parser("config", help="the settings in effect and where each came from "
                       "(env, .env, default); passwords hidden")
    s.add_argument("--json", action="store_true", help="a JSON object: name -> value, source")
    s.set_defaults(func=cmd_config)

    s = sub.add_parser("cache-tokenizer",
                       help="fetch a pair's tokenizer and context length into the data "
                            "directory, where submit reads them to check prompt lengths")
    s.add_argument("--pair", required=True)
    s.set_defaults(func=cmd_cache_tokenizer)

    for name, (_, text) in HEAVY.items():
        s = sub.add_parser(name, help=text, add_help=False)  # `specq NAME -h`: its own help
        s.set_defaults(func=cmd_heavy, heavy=name)
    return p


def cmd_heavy(args: argparse.Namespace) -> int:
    """A HEAVY command: its module's own parser reads the rest of the command line.
    `specq bench gpu ...` is `specq bench-gpu ...` (and so for every bench-NAME)."""
    if args.rest[:1] and f"{args.heavy}-{args.rest[0]}" in HEAVY:
        args.heavy, args.rest = f"{args.heavy}-{args.rest[0]}", args.rest[1:]
    module = import_module(HEAVY[args.heavy][0])
    p = _Parser(prog=f"specq {args.heavy}", description=module.__doc__,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    module.add_arguments(p)
    return module.run(p.parse_args(args.rest))


def _job_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=_count())
    p.add_argument("--temperature", type=_number())
    p.add_argument("--top-p", type=_number(0.0))
    p.add_argument("--top-k", type=_count(low=0))
    p.add_argument("--stop", action="append", help="a stop string (repeatable)")
    p.add_argument("--seed", type=_converter("seed", _seed))
    p.add_argument("--chunk-size", type=_count(), help="items per task (default SPECQ_CHUNK_SIZE)")


def _sampling(args: argparse.Namespace) -> dict[str, Any]:
    return {k: getattr(args, k) for k in SAMPLING_FLAGS if getattr(args, k) is not None}


def _print_state(state) -> None:
    print(json.dumps(state.as_dict(), indent=2))


def cmd_submit(args: argparse.Namespace) -> int:
    client = Client()
    job = client.submit(args.file, pair=args.pair, chunk_size=args.chunk_size,
                        priority=args.priority, **_sampling(args))
    state = job.status(check_workers=job.enqueue_error is None)
    print(f"job {job.id}: {counted(state.total, 'item')} on pair {state.pair}, {state.status}")
    # (a broker that cannot be reached was logged as a warning by Job.enqueue)
    for note in (job.unchecked, state.note):
        if note:
            print(f"note: {note}")
    if args.wait:
        _print_state(job.wait(progress=True))
    return 0


def _need_model_stack(what: str) -> None:
    """RuntimeError naming the extra when torch or transformers is not installed."""
    from importlib.util import find_spec

    missing = [m for m in ("torch", "transformers") if find_spec(m) is None]
    if missing:
        raise RuntimeError(f"{what} needs the model stack ({', '.join(missing)} not installed):"
                           f" install torch first, then pip install 'specq[worker]'")


def cmd_run(args: argparse.Namespace) -> int:
    _need_model_stack("specq run")
    from specq.worker.tasks import run_inline, start_up, worker_engine

    if args.file != "-" and same_file(args.file, args.output):
        return _fail([f"output: {args.output} is the input file {args.file}: its prompts "
                      f"would be overwritten (-o names where the results go)"], 2)
    settings = get_settings()
    t0 = time.perf_counter()
    client = Client(settings, auto_migrate=True)
    job = client.submit(args.file, pair=args.pair, chunk_size=args.chunk_size, enqueue=False,
                        **_sampling(args))
    total = job.status(check_workers=False).total
    print(f"job {job.id}: {counted(total, 'item')} stored in "
          f"{mask_url(settings.sqlalchemy_url)}; loading pair {args.pair}", file=sys.stderr)
    phases = start_up(settings, args.pair)  # as a worker starts: threads, load, warm-up, costs
    print(f"pair {args.pair} ready in {sum(phases.values()):.1f} s (" + ", ".join(
        f"{k} {v:.1f} s" for k, v in phases.items()) + ")", file=sys.stderr)
    run_inline(sessions=client.sessions, engine=worker_engine(args.pair), pair=args.pair,
               job_id=job.id, progress=True)
    with _term_is_exit():
        n = formats.export(job, args.output, output_format(args.output, args.format))
    m = job.metrics()
    print(f"job {job.id}: {m.completed} completed, {m.failed} failed; {n} results in "
          f"{args.output}; {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    table = sys.stderr if args.output == "-" else sys.stdout  # results own stdout
    if args.json:
        print(json.dumps(_summary(m.as_dict()), indent=2), file=table)
    else:
        from specq.api.report import format_metrics

        print(format_metrics(m), file=table)
    return 0 if m.pending == 0 else 1


def output_format(path: str, given: formats.Format | None) -> formats.Format:
    """The export format asked for, else parquet for a .parquet file and jsonl otherwise."""
    return given or ("parquet" if str(path).lower().endswith(".parquet") else "jsonl")


def _summary(d: dict[str, Any]) -> dict[str, Any]:
    def r(v: Any) -> Any:
        if isinstance(v, list):
            return [r(x) for x in v]
        return round(v, 4) if isinstance(v, float) else v

    return {k: r(v) for k, v in d.items()}


def cmd_status(args: argparse.Namespace) -> int:
    job = Client().job(args.job)
    if not args.watch:
        _print_state(job.status())
        return 0
    while True:
        state = job.status(check_workers=False)
        print(_progress_line(state, job.metrics()), flush=True)
        if state.finished:
            return 0
        time.sleep(args.interval)


def _progress_line(state: Any, m: Any) -> str:
    """One line: status, items by status, acceptance rate and tokens/s so far (api/figures.py
    writes each figure as `specq metrics` and `specq jobs` do), and the faults met if any."""
    faults = (f"  engine faults {state.engine_faults}, {state.items_isolated} items run alone"
              if state.engine_faults else "")
    return (f"{time.strftime('%H:%M:%S')} job {state.id} {state.status}: {item_counts(state)}  "
            f"acceptance {shown('acceptance_rate', m.acceptance_rate)}  "
            f"mean acceptance length {shown('mean_acceptance_length', m.mean_acceptance_length)}"
            f"  tokens/s {shown('tokens_per_second', m.tokens_per_second)}{faults}")


def cmd_metrics(args: argparse.Namespace) -> int:
    from specq.api.report import format_metrics

    metrics = Client().job(args.job).metrics()
    if args.json:
        print(json.dumps(_summary(metrics.as_dict()), indent=2))
    else:
        print(format_metrics(metrics))
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from specq.api.report import draw_report

    with _term_is_exit():
        path = draw_report(Client().job(args.job).metrics(), args.output)
    print(f"report written to {path}", file=sys.stderr)
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    _print_state(Client().job(args.job).cancel())
    return 0


def cmd_retry(args: argparse.Namespace) -> int:
    client = Client()
    try:
        indices = client.job(args.job).retry()
    except ValueError as exc:
        raise RuntimeError(str(exc)) from None
    print(f"job {args.job}: {len(indices)} failed items back to pending", file=sys.stderr)
    _print_state(client.job(args.job).status(check_workers=False))
    return 0


def cmd_reconcile(args: argparse.Namespace) -> int:
    """Re-send lost chunks now (workers and the beat do it every SPECQ_RECONCILE_EVERY s)."""
    from specq.broker.reconciler import reconcile

    settings = get_settings()
    if args.job is not None:
        Client(settings).job(args.job)  # an unknown job fails here, clearly
    try:
        report = reconcile(settings, job_id=args.job)
    except Exception as exc:  # noqa: BLE001 (the broker's and the database's errors vary)
        import redis
        from kombu.exceptions import OperationalError as BrokerError

        where = (f"the broker at {mask_url(settings.broker_url)} cannot be reached: "
                 if isinstance(exc, (redis.RedisError, BrokerError)) else "")
        raise RuntimeError(f"reconcile: {where}{type(exc).__name__}: "
                           f"{str(exc).splitlines()[0] if str(exc) else ''}") from None
    if args.json:
        print(json.dumps(report.as_dict(), indent=2))
    else:
        print("\n".join(reconcile_summary(report.as_dict(), settings.reconcile_grace)))
    return 0


def reconcile_summary(report: dict[str, Any], grace: float) -> list[str]:
    """What a reconciler pass did, in words (ReconcileReport.as_dict(): --json prints it)."""
    lines = [f"checked {report['candidates']} chunks that are not done, not leased and not "
             f"sent in the last {grace:g} s"]
    if report["candidates"]:
        lines.append(f"{report['on_broker']} of them still wait on the broker (left alone)")
    by_job = ", ".join(f"job {j}: {n}" for j, n in sorted(report["resent_by_job"].items()))
    lines.append(f"re-sent {report['resent']} lost chunks ({by_job})" if report["resent"]
                 else "nothing lost: no chunk re-sent")
    if report.get("cancelled"):
        lines.append(f"cancelled {report['cancelled']} items of cancelled jobs' chunks that "
                     f"no worker holds")
    if report["fed"]:
        lines.append(f"sent {report['fed']} more chunks to fill their jobs' turns on the queue")
    if report["settled"]:
        lines.append("settled: " + ", ".join(f"job {j} {status}" for j, status
                                             in sorted(report["settled"].items())))
    return lines


def cmd_results(args: argparse.Namespace) -> int:
    with _term_is_exit():
        n = formats.export(Client().job(args.job), args.output,
                           output_format(args.output, args.format), input=args.input)
    if args.output != "-":
        print(f"{n} results written to {args.output}", file=sys.stderr)
    return 0


def _schedule_names() -> set[str] | None:
    """The schedules the schedules file names; None where it cannot be read."""
    from specq.configs.schedules import ScheduleError, load_schedules

    try:
        return set(load_schedules(get_settings().schedules_file))
    except (ScheduleError, OSError):
        return None


def cmd_jobs(args: argparse.Namespace) -> int:
    """The latest jobs (or one schedule's runs) with their figures, from the view
    job_metrics in one query."""
    schedule = getattr(args, "schedule", None)
    jobs = Client().jobs(limit=args.limit, schedule=schedule)
    if schedule is not None and not jobs:  # no runs: a schedule not yet fired, or a typo
        known = _schedule_names()
        if known is not None and schedule not in known:
            return _fail([f"schedule: no runs of {schedule!r}, and the schedules file names "
                          f"no such schedule (known: {', '.join(sorted(known)) or 'none'})"],
                         2)
    if getattr(args, "json", False):
        print(json.dumps([_summary(j.as_dict()) for j in jobs], indent=2))
        return 0
    print(f"{'id':>6}  {'status':<11} {'pair':<16} {'drafting':<24} {'completed':>15} "
          f"{'failed':>7} {'cancel':>7}  {'accept':>6}  {'len':>5}  {'g':>5}  {'tok/s':>7}  "
          f"{'speedup':>7}  {'worker-s':>9}  {'cost':>9}  {'created':<19}  tenant")
    for j in jobs:
        print(f"{j.id:>6}  {j.status:<11} {j.pair:<16} {drafting(j):<24} "
              f"{f'{j.completed}/{j.total}':>15} {j.failed:>7} {j.cancelled:>7}  "
              f"{shown('acceptance_rate', j.acceptance_rate):>6}  "
              f"{shown('mean_acceptance_length', j.mean_acceptance_length):>5}  "
              f"{shown('mean_draft_length', j.mean_draft_length):>5}  "
              f"{shown('tokens_per_second', j.tokens_per_second):>7}  "
              f"{shown('estimated_speedup', j.estimated_speedup, drafted=drafted(j)):>7}  "
              f"{j.worker_seconds:>9.1f}  "
              f"{shown('estimated_cost', j.estimated_cost):>9}  "
              f"{j.created_at.strftime('%Y-%m-%d %H:%M:%S') if j.created_at else '':<19}  "
              f"{j.tenant or '-'}")
    return 0


def cmd_synth_run(args: argparse.Namespace) -> int:
    from specq.api import synthesis

    spec = synthesis.load_spec(args.spec)
    client = Client()
    job = synthesis.submit(client, spec)
    state = job.status()
    print(f"job {job.id}: {counted(state.total, 'sample')} of {spec.name} on pair {state.pair}, "
          f"{state.status}", file=sys.stderr)
    for note in (job.unchecked, state.note):
        if note:
            print(f"note: {note}", file=sys.stderr)
    if not args.wait:
        print(f"`specq synth write {job.id}` writes the data set once it completes (`specq "
              f"beat` does it by itself)", file=sys.stderr)
        return 0
    state = job.wait(progress=True, timeout=args.timeout)
    with _term_is_exit():
        path = synthesis.write_output(client, job.id)
    print(f"job {job.id} {state.status}: {state.completed} completed, {state.failed} failed; "
          f"data set in {path}", file=sys.stderr)
    print(path)
    return 0 if state.status == "completed" else 1


def cmd_synth_check(args: argparse.Namespace) -> int:
    from specq.api import synthesis

    settings = get_settings()
    spec, rows = synthesis.check_spec(args.spec, settings.presets_file, Client(settings))
    print(f"{args.spec}: valid; {rows} seed rows x n={spec.n} = {rows * spec.n} samples")
    return 0


def cmd_synth_write(args: argparse.Namespace) -> int:
    from specq.api import synthesis

    client = Client()
    state = client.job(args.job).status(check_workers=False)
    if not state.finished:
        raise RuntimeError(f"job {args.job}: still {state.status}; wait for it to finish")
    with _term_is_exit():
        print(synthesis.write_output(client, args.job))
    return 0


def cmd_beat(args: argparse.Namespace) -> int:
    """Replace this process with Celery beat (embedded in a worker on the synth queue, which
    runs the firings and writes the data sets: no GPU, no model)."""
    from specq.api import synthesis
    from specq.broker.names import synth_queue
    from specq.configs.schedules import load_schedules

    settings = get_settings()
    schedules = load_schedules(settings.schedules_file)  # a bad schedule fails here, clearly
    problems = []  # and so does its spec, as `specq synth check` finds it: not at 3 a.m.
    for name, schedule in schedules.items():
        try:
            synthesis.check_spec(schedule.spec, settings.presets_file)
        except synthesis.SpecError as exc:
            problems += [f"schedule {name}: {p}" for p in exc.problems]
    if problems:
        raise synthesis.SpecError(problems)
    print(f"beat: {len(schedules)} schedules from {settings.schedules_file}: "
          f"{', '.join(schedules) or 'none'}", file=sys.stderr)
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "celery", "-A", "specq.api.beat", "worker", "-B",
            "-s", str(settings.beat_schedule_file), "-P", "solo", "-c", "1",
            "-Q", synth_queue(settings), "--loglevel", args.loglevel, "-n", "beat@%h",
            "--without-gossip", "--without-mingle"]
    sys.stdout.flush()
    os.execv(sys.executable, argv)
    return 0  # not reached


def cmd_worker(args: argparse.Namespace) -> int:
    """Replace this process with a Celery worker consuming the pair's queue only."""
    _need_model_stack("specq worker")
    from specq.broker.names import WORKER_PAIR_ENV
    from specq.configs.presets import get_preset
    from specq.worker.launch import quiet_worker_env, worker_argv

    settings = get_settings()
    get_preset(args.pair, settings.presets_file)  # an unknown pair fails here, clearly
    os.environ[WORKER_PAIR_ENV] = args.pair
    quiet_worker_env()  # no model-loading progress bars as WARNING records in its log
    argv = worker_argv(args.pair, settings, args.loglevel, args.hostname)
    sys.stdout.flush()
    os.execv(sys.executable, [sys.executable, "-m", "celery", *argv])
    return 0  # not reached


def cmd_config(args: argparse.Namespace) -> int:
    """Print every setting as this process reads it (paths absolute, secrets as ***)."""
    from specq.configs.settings import settings_in_effect

    rows = settings_in_effect(get_settings())
    if args.json:
        print(json.dumps({name: {"value": value, "source": source}
                          for name, value, source in rows}, indent=2))
        return 0
    width = max(len(name) for name, _, _ in rows)
    for name, value, source in rows:
        print(f"{name:<{width}}  {value}  ({source})")
    return 0


def cmd_cache_tokenizer(args: argparse.Namespace) -> int:
    """The one command that asks the hub for a submitter: workers write the same folder
    when they start (configs/tokenizer_cache.py)."""
    from huggingface_hub.utils import logging as hub_logging  # (its handler, on import)

    from specq.api.tokenizer import cache_from_hub, target_context
    from specq.configs.presets import get_preset

    # the hub's retries are said once, as this command's warnings, not twice
    hub_logging.get_logger().handlers.clear()
    settings = get_settings()
    preset = get_preset(args.pair, settings.presets_file)
    folder = cache_from_hub(preset, settings)
    print(f"pair {preset.name}: tokenizer of {preset.target.label} (context "
          f"{target_context(preset, settings)} tokens) in {folder}", file=sys.stderr)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    """Run the HTTP server (uvicorn); an embedded SQLite database is migrated first."""
    from specq.api.server.app import serve
    from specq.db.session import migrate

    settings = get_settings()
    if settings.sqlalchemy_url.startswith("sqlite"):
        migrate(settings.sqlalchemy_url)
    serve(args.host, args.port, args.workers, args.loglevel)
    return 0


def cmd_exporter(args: argparse.Namespace) -> int:
    """Serve the control plane's metrics (api/exporter.py) until stopped."""
    from specq.api import exporter

    return exporter.run(args)


def _tenant_name(name: str) -> str:
    name = name.strip()
    if not name or len(name) > 200 or not name.isprintable():
        raise InputError(["name: 1 to 200 printable characters"])
    return name


def cmd_keys_create(args: argparse.Namespace) -> int:
    from specq.db import tenants

    name = _tenant_name(args.name)
    with Client().sessions.begin() as s:
        key = tenants.create_key(s, tenant=name)
    print(f"tenant {name}: a new API key (stored hashed: shown this once; keep it secret):",
          file=sys.stderr)
    print(key)
    return 0


def cmd_keys_list(args: argparse.Namespace) -> int:
    from specq.db import tenants

    with Client().sessions() as s:
        keys = tenants.list_keys(s)
    if args.json:
        print(json.dumps([{"tenant": k.tenant, "key": k.prefix + "...",
                           "created_at": k.created_at.isoformat(),
                           "revoked_at": k.revoked_at.isoformat() if k.revoked_at else None}
                          for k in keys], indent=2))
        return 0
    print(f"{'tenant':<24} {'key':<20} {'created':<19}  revoked")
    for k in keys:
        revoked = k.revoked_at.strftime("%Y-%m-%d %H:%M:%S") if k.revoked_at else "-"
        print(f"{k.tenant:<24} {k.prefix + '...':<20} "
              f"{k.created_at.strftime('%Y-%m-%d %H:%M:%S')}  {revoked}")
    return 0


def cmd_keys_revoke(args: argparse.Namespace) -> int:
    from specq.db import tenants

    prefix = args.key.removesuffix("...") if args.key else None
    with Client().sessions.begin() as s:
        n = tenants.revoke(s, tenant=_tenant_name(args.name), prefix=prefix)
    print(f"tenant {args.name}: {n} key{'s' * (n != 1)} revoked", file=sys.stderr)
    return 0 if n else 1


def cmd_webhooks_add(args: argparse.Namespace) -> int:
    from specq.db import webhooks
    from specq.schema.addresses import TargetError

    settings = get_settings()
    with Client().sessions.begin() as s:
        tenant_id = (None if args.tenant is None
                     else webhooks.tenant_id_of(s, tenant=_tenant_name(args.tenant)))
        try:
            info, secret = webhooks.add_endpoint(
                s, url=args.url, tenant_id=tenant_id, name=args.name, event_types=args.events,
                allow_private=settings.webhook_allow_private,
                allow_http=settings.webhook_allow_http)
        except (TargetError, ValueError) as exc:
            raise InputError([str(exc)]) from None
    whose = f"tenant {info.tenant}" if info.tenant else "the operator (every job)"
    print(f"endpoint {info.id} for {whose}: {', '.join(info.event_types)} -> {info.url}",
          file=sys.stderr)
    print("its signing secret (shown this once; receivers verify with it):", file=sys.stderr)
    print(secret)
    return 0


def cmd_webhooks_list(args: argparse.Namespace) -> int:
    from specq.db import webhooks

    with Client().sessions() as s:
        found, _ = webhooks.list_endpoints(s)
    if args.json:
        print(json.dumps([{"id": e.id, "tenant": e.tenant, "name": e.name, "url": e.url,
                           "event_types": e.event_types, "secret": e.secret_hint,
                           "created_at": e.created_at.isoformat(), "deliveries": e.deliveries}
                          for e in found], indent=2))
        return 0
    print(f"{'id':<28} {'tenant':<16} {'pending':>7} {'sent':>7} {'failed':>7}  url  events")
    for e in found:
        d = e.deliveries
        print(f"{e.id:<28} {e.tenant or '(operator)':<16} {d['pending']:>7} "
              f"{d['delivered']:>7} {d['failed']:>7}  {e.url}  {','.join(e.event_types)}")
    return 0


def cmd_webhooks_remove(args: argparse.Namespace) -> int:
    from specq.db import webhooks

    with Client().sessions.begin() as s:
        gone = webhooks.remove_endpoint(s, openai_id=args.id)
    if not gone:
        raise KeyError(f"webhook endpoint {args.id!r}: not found (specq webhooks list)")
    print(f"endpoint {args.id} removed, with its deliveries", file=sys.stderr)
    return 0


def cmd_webhooks_rotate(args: argparse.Namespace) -> int:
    from specq.db import webhooks

    with Client().sessions.begin() as s:
        found = webhooks.rotate_secret(s, openai_id=args.id, keep_old_for=args.keep_old)
    if found is None:
        raise KeyError(f"webhook endpoint {args.id!r}: not found (specq webhooks list)")
    kept = f"; the old one signs too for {args.keep_old:g} s" if args.keep_old else ""
    print(f"endpoint {args.id}: a new signing secret (shown this once{kept}):", file=sys.stderr)
    print(found[1])
    return 0


def cmd_webhooks_send(args: argparse.Namespace) -> int:
    """The sender (broker/webhooks.py), until SIGTERM or Ctrl-C; --once: one pass."""
    import threading

    from specq.broker.webhooks import Sender

    sender = Sender(get_settings())
    if args.once:
        n = sender.run_once()
        print(f"{n} webhook deliveries posted", file=sys.stderr)
        return 0
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        sender.run(stop)
    except KeyboardInterrupt:
        pass
    return 0


def cmd_sweep(args: argparse.Namespace) -> int:
    """One retention sweep (api/retention.py), or one every --every seconds; each pass's
    counts as a JSON line."""
    from specq.api.retention import sweep

    settings = get_settings()
    while True:
        print(json.dumps(sweep(settings).as_dict()), flush=True)
        if args.every is None:
            return 0
        time.sleep(args.every)


def cmd_migrate(args: argparse.Namespace) -> int:
    from specq.db.session import migrate

    url = get_settings().sqlalchemy_url
    migrate(url)
    print(f"{mask_url(url)}: schema at head", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
