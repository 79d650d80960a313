"""Infrastructure settings, read from SPECQ_* environment variables (and a .env file).

Paths are anchored once, when the settings are read: a relative SPECQ_DATA_DIR,
SPECQ_PRESETS_FILE, SPECQ_SCHEDULES_FILE or SQLite file is taken from the working directory
of the process that reads them and kept absolute from then on, so a command started
elsewhere, or a worker a bench starts, finds the same files. With no SPECQ_DATA_DIR the data
directory is the user's data directory (platformdirs: ~/.local/share/specq on Linux, or
$XDG_DATA_HOME/specq), not the working directory: converted checkpoints, tiny models and the
embedded database are made once per user and host, wherever specq runs.
"""

from __future__ import annotations

import os
import re
from functools import lru_cache
from pathlib import Path
from typing import Any

from platformdirs import user_data_dir
from pydantic import Field, ValidationError, ValidationInfo, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError

INT32_MAX = 2**31 - 1  # counts and seconds that land in INTEGER columns or Redis options
DEVICES = re.compile(r"auto|cpu|mps|cuda(:\d+)?")
DTYPES = ("auto", "float32", "bfloat16", "float16")
QUEUE_PREFIX = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,99}")
URL_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://.*", re.DOTALL)
# settings whose whole value must match a pattern, and what they must be
_PATTERNS = {
    "broker_url": (URL_SCHEME, "must be a URL such as redis://host:6379/0"),
    "device": (DEVICES, "must be auto, cpu, mps, cuda or cuda:N"),
    "queue_prefix": (QUEUE_PREFIX, "must be 1 to 100 letters, digits or _.:- (starting with a "
                     "letter or digit)"),
}


class Settings(BaseSettings):
    """One source of truth for where things are and how big they are."""

    model_config = SettingsConfigDict(env_prefix="SPECQ_", env_file=".env", extra="ignore",
                                      allow_inf_nan=False)

    broker_url: str = "redis://127.0.0.1:6379/0"
    database_url: str | None = Field(
        None, description="SQLAlchemy URL; default: SQLite in data_dir (the embedded default)"
    )
    data_dir: Path = Field(
        default_factory=lambda: Path(user_data_dir("specq", appauthor=False)),
        description="the embedded SQLite database, tiny models, converted checkpoints and "
        "tokenizers, beat state, synthesis data sets ({data_dir} in a spec)")
    presets_file: Path | None = Field(None, description="extra model-pair presets (YAML)")
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "auto"  # auto (float32 on CPU, bfloat16 on GPU) | float32 | bfloat16 | float16
    chunk_size: int = Field(64, ge=1, le=INT32_MAX)
    max_batch_size: int = Field(16, ge=1, le=65536)
    # The job pipeline (broker/app.py, api/client.py).
    queue_prefix: str = Field("specq", description="prefix of every Celery queue name")
    visibility_timeout: int = Field(
        3600, ge=1, le=INT32_MAX,
        description="seconds before an unacknowledged chunk is redelivered; "
        "must exceed the longest chunk"
    )
    dispatch_window: int = Field(
        4, ge=1, le=100000, description="chunk messages of one job kept waiting on the "
        "broker; each chunk a worker starts sends the job's next one, so jobs on a queue "
        "take turns and a small job starts within a few chunks of a huge one")
    worker_pair: str | None = Field(None, min_length=1, max_length=200,
                                    description="the pair a worker serves (specq worker)")
    # Faults (worker/keeper.py, broker/reconciler.py; docs/operations.md, Failures and recovery).
    max_attempts: int = Field(
        3, ge=1, le=1000, description="engine failures an item survives before it fails")
    lease_seconds: float = Field(
        30.0, ge=1, le=86400, description="a running chunk's lease; renewed every third of "
        "it, given up after two thirds of it without a renewal; at least 3 x db_timeout")
    db_timeout: float = Field(
        10.0, ge=1, le=3600, description="seconds one PostgreSQL call may go unanswered "
        "before it fails (connect_timeout, tcp_user_timeout, keepalives): the bound of a "
        "lease renewal")
    reconcile_every: float = Field(
        15.0, ge=0, le=86400, description="seconds between reconciler runs in each worker and "
        "the beat (one at a time fleet-wide); 0 turns the workers' own runs off")
    consumer_stall: float = Field(
        60.0, ge=2, le=86400, description="seconds an idle worker may take no message while "
        "its pair's queue holds some before it restarts itself (a broker connection left "
        "wedged: worker/watch.py)")
    reconcile_grace: float = Field(
        10.0, ge=0, le=86400, description="a chunk sent less than this long ago is never "
        "re-sent (its message may be on its way to a worker)")
    flush_every: float = Field(
        1.0, gt=0, le=3600, description="seconds between writes of a chunk's finished items")
    flush_items: int = Field(32, ge=1, le=100000, description="...or after this many items")
    retry_backoff: float = Field(
        1.0, gt=0, le=3600, description="first pause after an engine or database failure; "
        "doubles up to retry_backoff_max")
    retry_backoff_max: float = Field(15.0, gt=0, le=3600)
    db_patience: float = Field(
        3600.0, gt=0, description="seconds a worker keeps retrying a database call "
        "(finished outcomes are kept in memory meanwhile)")
    max_chunk_runs: int = Field(
        20, ge=1, le=100000, description="leases a chunk may take (workers killed or crashed "
        "while running it) before its pending items fail")
    torch_threads: int = Field(
        0, ge=0, le=4096, description="CPU threads of a worker's torch; 0: its share of the "
        "host's cores (usable cores / specq workers on the host, less the cores other work "
        "keeps busy at start), 2 on a GPU")
    calibration_budget: float = Field(
        5.0, ge=0, le=3600, description="seconds a fresh calibration of a pair's step costs "
        "may take at start (the smallest batch size is always measured, then the largest "
        "and the others while they fit; the steps refine the rest); a calibration cached "
        "in data_dir for this pair, device, dtype, threads, torch and host is loaded "
        "instead")
    metrics_port: int = Field(
        0, ge=0, le=65535, description="a worker serves Prometheus metrics on this port "
        "(/metrics); 0: none (`specq run` never serves them)")
    metrics_host: str = Field(
        "127.0.0.1", min_length=1, description="the address a worker's metrics listen on "
        "(0.0.0.0 where Prometheus scrapes it from another host or container)")
    device_hour_price: float | None = Field(
        None, ge=0, description="what an hour of this worker's device costs (any currency): "
        "its chunks' worker-seconds are priced at it (job_metrics.estimated_cost); unset: "
        "the pair's preset's device_hour_price, if any")
    broker_timeout: float = Field(
        5.0, gt=0, le=600, description="seconds any broker call may take (connect, send, read)")
    # Scheduled synthesis (api/beat.py).
    schedules_file: Path = Field(
        Path(__file__).with_name("schedules.yaml"),
        description="beat schedules (YAML): cron expressions naming synthesis specs",
    )
    schedule_lock_ttl: int = Field(
        300, ge=1, le=INT32_MAX,
        description="seconds a schedule's firing lock lives if its holder dies"
    )

    # The OpenAI Batch API over HTTP (`specq serve`, api/server/).
    api_file_store: str = Field(
        "directory", description="where uploaded batch files are kept: directory (under "
        "api_files_dir) or database (the table file_parts: servers on several machines)")
    api_files_dir: Path | None = Field(
        None, description="uploaded batch files with api_file_store=directory; default "
        "DATA_DIR/files")
    api_max_file_bytes: int = Field(
        200 * 1024 * 1024, ge=1, le=2**40, description="largest upload, in bytes (OpenAI's 200 MB)")
    api_max_file_lines: int = Field(
        50_000, ge=1, le=100_000_000, description="most requests in one batch file (OpenAI's "
        "50,000; a million and more if set)")
    api_quota_items: int = Field(
        1_000_000, ge=0, le=2**40, description="unfinished requests a tenant may have in its "
        "batches at once; a create beyond it answers 429; 0: no quota")
    api_max_window: int = Field(
        7 * 86400, ge=1, le=365 * 86400, description="longest completion_window, seconds")
    api_expire_every: float = Field(
        5.0, gt=0, le=3600, description="seconds between a server's passes that expire "
        "batches past their completion_window")
    api_validating_timeout: float = Field(
        600.0, gt=0, le=86400, description="seconds after which a batch still validating "
        "with no job (its server died while creating it) is failed by the expiry pass, and "
        "its Idempotency-Key freed")
    api_max_header_bytes: int = Field(
        16384, ge=1024, le=1024 * 1024, description="request headers larger than this are "
        "refused (431)")
    api_header_timeout: float = Field(
        20.0, gt=0, le=3600, description="seconds a client has to send a request's line "
        "and headers, from their first byte (or the connection's opening); past it the "
        "connection is closed")
    api_body_timeout: float = Field(
        30.0, gt=0, le=3600, description="seconds a request body may pause between two "
        "arrivals; past it the connection is closed")
    api_max_client_connections: int = Field(
        256, ge=0, le=1_000_000, description="connections one client address may hold "
        "open to one server process; one past it is closed as it opens; 0: no cap (behind "
        "a proxy, whose address every connection has)")

    # Webhooks: signed events when a batch or a job ends (db/webhooks.py, broker/webhooks.py).
    webhook_allow_private: bool = Field(
        False, description="let webhook URLs reach loopback, private, link-local and other "
        "non-public addresses (off: no request forgery into the operator's network)")
    webhook_allow_http: bool = Field(
        False, description="let webhook URLs be plain http:// (off: https:// only)")
    webhook_timeout: float = Field(
        10.0, gt=0, le=300, description="seconds one webhook post may take (connect, send, "
        "answer)")
    webhook_backoff: float = Field(
        5.0, gt=0, le=86400, description="first pause before a failed webhook is posted "
        "again; doubles after each failure up to webhook_backoff_max")
    webhook_backoff_max: float = Field(600.0, gt=0, le=86400)
    webhook_retry_for: float = Field(
        3 * 86400.0, gt=0, le=365 * 86400, description="seconds an event is retried after it "
        "was made; then it is given up (status failed, every attempt kept)")
    webhook_poll: float = Field(
        1.0, gt=0, le=3600, description="seconds the sender waits when nothing is due")
    # Retention (db/retention.py, `specq sweep`): unset keeps everything for ever.
    retention_files: float | None = Field(
        None, gt=0, description="seconds an uploaded file is kept when its upload names no "
        "expires_after; unset: until deleted")
    retention_outputs: float | None = Field(
        None, gt=0, description="seconds a batch's output and error files (and its job's "
        "results) are kept after the batch ends; unset: for ever")
    retention_results: float | None = Field(
        None, gt=0, description="seconds a finished job's results are kept (texts, or the "
        "whole job: retention_keep_metrics); unset: for ever")
    retention_keep_metrics: bool = Field(
        True, description="a swept job keeps its rows and acceptance counters, its prompts "
        "and outputs emptied; off: the job and its items are deleted")
    retention_webhooks: float | None = Field(
        2_592_000, gt=0, description="seconds a delivered or given-up webhook delivery "
        "(and its attempts) is kept after it was made; unset: for ever")
    retention_sweep_rows: int = Field(
        1000, ge=1, le=1_000_000, description="rows one sweep statement changes (bounded "
        "batches, each its own transaction)")

    @field_validator("*", mode="before")
    @classmethod
    def _whole_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        """An integer setting is written as one ('1.0' is refused, not truncated)."""
        assert info.field_name is not None  # a field's validator
        if cls.model_fields[info.field_name].annotation is int and isinstance(value, str):
            try:
                int(value)
            except ValueError:
                raise ValueError("must be an integer") from None
        return value

    @field_validator("device_hour_price", "retention_files", "retention_outputs",
                     "retention_results", "retention_webhooks", mode="before")
    @classmethod
    def _unset(cls, value: Any) -> Any:
        """An empty value is no value (compose passes ${SPECQ_DEVICE_HOUR_PRICE:-} on)."""
        return None if isinstance(value, str) and not value.strip() else value

    @field_validator(*_PATTERNS)
    @classmethod
    def _matches(cls, value: str, info: ValidationInfo) -> str:
        pattern, must = _PATTERNS[str(info.field_name)]
        if not pattern.fullmatch(value):
            raise ValueError(must)
        return value

    @field_validator("database_url")
    @classmethod
    def _database_url(cls, value: str | None) -> str | None:
        """A sqlite or postgresql URL; postgres://, the scheme many hosts hand out, is taken
        as postgresql+psycopg:// (SQLAlchemy knows no 'postgres' dialect)."""
        if not value:
            return None
        if value.startswith("postgres://"):
            value = "postgresql+psycopg://" + value.removeprefix("postgres://")
        try:
            backend = make_url(value).get_backend_name()
        except (ArgumentError, ValueError):
            raise ValueError("not a database URL (sqlite:///FILE or "
                             "postgresql+psycopg://USER@HOST/DB)") from None
        if backend not in ("sqlite", "postgresql"):
            raise ValueError(f"must be a sqlite or postgresql URL, not {backend}")
        return value

    @field_validator("database_url", mode="after")
    @classmethod
    def _sqlite_file(cls, value: str | None) -> str | None:
        """A relative SQLite file is anchored to the working directory, once."""
        if not value:
            return value
        url = make_url(value)
        if url.get_backend_name() != "sqlite" or not url.database or \
                url.database == ":memory:" or url.database.startswith("file:"):
            return value
        anchored = anchor(Path(url.database))
        if str(anchored) == url.database:
            return value
        return url.set(database=str(anchored)).render_as_string(hide_password=False)

    @field_validator("data_dir")
    @classmethod
    def _data_dir(cls, value: Path) -> Path:
        value = anchor(value)
        if _stat(value) == "file":
            raise ValueError("not a directory")
        return value

    @field_validator("presets_file")
    @classmethod
    def _presets_file(cls, value: Path | None) -> Path | None:
        # (schedules_file is the beat's alone: load_schedules names it when it is missing)
        if value is not None and _stat(value) != "file":
            raise ValueError("file not found")
        return None if value is None else anchor(value)

    @field_validator("api_file_store")
    @classmethod
    def _api_file_store(cls, value: str) -> str:
        if value not in ("directory", "database"):
            raise ValueError("must be directory or database")
        return value

    @field_validator("api_files_dir")
    @classmethod
    def _api_files_dir(cls, value: Path | None) -> Path | None:
        return None if value is None else anchor(value)

    @field_validator("schedules_file")
    @classmethod
    def _schedules_file(cls, value: Path) -> Path:
        return anchor(value)

    @field_validator("dtype")
    @classmethod
    def _dtype(cls, value: str) -> str:
        if value not in DTYPES:
            raise ValueError(f"must be one of {', '.join(DTYPES)}")
        return value

    @model_validator(mode="after")
    def _lease_outlasts_database_calls(self) -> Settings:
        """A lease must outlast the calls that renew it: renewed every third of it and
        given up after two thirds, it holds only if one call ends within a third."""
        if self.lease_seconds < 3 * self.db_timeout * (1 - 1e-9):
            raise ValueError(
                f"lease_seconds ({self.lease_seconds:g}) must be at least 3 x db_timeout "
                f"({self.db_timeout:g}): a lease renewal may take db_timeout seconds to fail, "
                f"and a worker gives its lease up after two thirds of it without a renewal")
        return self

    @property
    def sqlalchemy_url(self) -> str:
        if self.database_url:
            return self.database_url
        return f"sqlite:///{(self.data_dir / 'specq.db').resolve()}"

    @property
    def files_dir(self) -> Path:
        """Where uploaded batch files are kept (api_file_store=directory)."""
        return self.api_files_dir or self.data_dir / "files"

    @property
    def beat_schedule_file(self) -> Path:
        """Celery beat's state (the last run of each schedule): `specq beat` keeps it here."""
        return self.data_dir / "celerybeat-schedule"


def anchor(path: Path) -> Path:
    """``path`` absolute: ~ expanded, a relative one taken from the working directory now."""
    try:
        return path.expanduser().absolute()
    except RuntimeError:  # ~ with no home directory: left for the checks to name
        return path.absolute()


def _stat(path: Path) -> str:
    """What ``path`` is: dir, file (anything else that exists), or missing (or unreadable)."""
    try:
        return "dir" if path.is_dir() else "file" if path.exists() else "missing"
    except (OSError, ValueError):  # a name too long, a NUL in the name
        return "missing"


@lru_cache
def get_settings() -> Settings:
    return Settings()


# What pydantic's error types mean for a value read from the environment.
_MEANINGS = {
    "greater_than_equal": "must be at least {ge}", "greater_than": "must be more than {gt}",
    "less_than_equal": "must be at most {le}", "less_than": "must be less than {lt}",
    "int_parsing": "must be an integer", "int_from_float": "must be an integer",
    "float_parsing": "must be a number", "finite_number": "must be a finite number",
    "string_too_short": "must not be empty", "bool_parsing": "must be true or false",
}


def describe_settings(exc: ValidationError) -> list[str]:
    """'SPECQ_NAME: what is wrong, got VALUE' for each error of Settings(); no value is shown
    for a URL (it may hold a password)."""
    out = []
    for err in exc.errors():
        name = str(err["loc"][0]) if err["loc"] else ""
        ctx: dict[str, Any] = err.get("ctx") or {}
        meaning = _MEANINGS.get(err["type"])
        msg = meaning.format(**ctx) if meaning else err["msg"].removeprefix("Value error, ")
        value = err.get("input")
        shown = "" if "url" in name or not isinstance(value, (str, int, float)) else \
            f", got {str(value)[:60]!r}"
        out.append(f"SPECQ_{name.upper()}: {msg}{shown}")
    return out


def subprocess_env(settings: Settings) -> dict[str, str]:
    """This process's environment with ``settings`` as the SPECQ_ variables a subprocess
    (a worker started by a bench) reads."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECQ_")}
    for name, value in settings.model_dump().items():
        if value is not None:
            env[f"SPECQ_{name.upper()}"] = str(value)
    return env


# -- the settings in effect, for people (`specq config`) ------------------------------------

SECRET_WORDS = ("password", "passwd", "secret", "token", "key")


def mask_url(url: str) -> str:
    """``url`` with its password, and any query value named like a secret, as ***: the one
    way a URL is shown, in `specq config`, logs and messages. The rest of the text is kept
    as written (urlunsplit would drop the // of sqlite:////abs/path)."""
    from urllib.parse import parse_qsl, urlencode, urlsplit

    try:
        parts = urlsplit(url)
        if parts.password is not None:
            user, _, host = parts.netloc.rpartition("@")
            url = url.replace(parts.netloc, f"{user.partition(':')[0]}:***@{host}", 1)
        if any(w in parts.query.lower() for w in SECRET_WORDS):
            query = urlencode([(k, "***" if any(w in k.lower() for w in SECRET_WORDS) else v)
                               for k, v in parse_qsl(parts.query, keep_blank_values=True)],
                              safe="*")
            fragment = f"#{parts.fragment}" if parts.fragment else ""
            url = f"{url.partition('?')[0]}?{query}{fragment}"  # the first ? opens the query
        return url
    except ValueError:  # not a URL that can be taken apart: show none of it
        return "***"


def shown_value(name: str, value: Any) -> str:
    """A setting's value as `specq config` prints it: URLs without passwords, secrets as ***."""
    if value is None:
        return "-"
    if any(w in name for w in SECRET_WORDS):
        return "***"
    text = str(value)
    return mask_url(text) if name.endswith("_url") or "://" in text else text


# SPECQ_ names read elsewhere than Settings: the engine's switches (worker/engine/packed.py),
# tests' hooks, and docker compose's own (docker-compose.yml reads the same .env)
OTHER_VARIABLES = frozenset({"SPECQ_PACKED_FORWARD", "SPECQ_PACKED_LINEAR", "SPECQ_API_FAULT",
                             "SPECQ_FUZZ_RANDOM", "SPECQ_BIND", "SPECQ_CPU_PAIR",
                             "SPECQ_DATA_VOLUME", "SPECQ_PAIR"})


def unknown_settings(env_file: str | os.PathLike = ".env") -> list[str]:
    """A line for each SPECQ_ name in the environment or the .env file that is no setting
    (a misspelt one is otherwise ignored without a word), with the setting it may mean."""
    import difflib

    from dotenv import dotenv_values

    known = {f"SPECQ_{name.upper()}" for name in Settings.model_fields} | OTHER_VARIABLES
    try:
        in_file = list(dotenv_values(env_file))
    except OSError:
        in_file = []
    out = []
    for where, names in (("in the environment", list(os.environ)), (f"in {env_file}", in_file)):
        for name in sorted(n for n in names if n.upper().startswith("SPECQ_")):
            if name.upper() not in known:
                close = difflib.get_close_matches(name.upper(), sorted(known), n=1)
                out.append(f"{name} ({where}) is no setting of specq's and is ignored"
                           + (f"; did you mean {close[0]}?" if close else ""))
    return out


def setting_sources(env_file: str | os.PathLike = ".env") -> dict[str, str]:
    """Where each setting came from: 'env' (a SPECQ_ variable), '.env' (the file the
    settings read, in the working directory) or 'default'."""
    from dotenv import dotenv_values

    environ = {k.lower() for k in os.environ}
    try:
        in_file = {k.lower() for k, v in dotenv_values(env_file).items() if v is not None}
    except OSError:
        in_file = set()
    out = {}
    for name in Settings.model_fields:
        key = f"specq_{name}"
        out[name] = "env" if key in environ else ".env" if key in in_file else "default"
    return out


def settings_in_effect(settings: Settings) -> list[tuple[str, str, str]]:
    """(SPECQ_NAME, value as shown, source) for every setting, then the values derived from
    them (the database in use, beat state), secrets hidden."""
    sources = setting_sources()
    rows = [(f"SPECQ_{name.upper()}", shown_value(name, getattr(settings, name)), sources[name])
            for name in Settings.model_fields]
    rows.append(("database in use", mask_url(settings.sqlalchemy_url),
                 "SPECQ_DATABASE_URL" if settings.database_url else "SPECQ_DATA_DIR"))
    rows.append(("beat state", str(settings.beat_schedule_file), "SPECQ_DATA_DIR"))
    for name in HUB_VARIABLES:  # read by the model stack (a worker, a hub tokenizer)
        value = os.environ.get(name)
        rows.append((name, "-" if value is None else shown_value(name.lower(), value),
                     "env" if value is not None else "unset"))
    return rows


HUB_VARIABLES = ("HF_TOKEN", "HF_HOME")  # the hub's token (hidden) and model cache
