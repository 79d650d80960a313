"""Dataset synthesis: a YAML spec → an ordinary job → an output data set.

A spec (configs/synth/*.yaml) names a seed data set (JSONL, CSV or Parquet file, or an
inline list of rows), a Jinja2 template rendered over each row in a sandbox with strict
undefined variables, ``n`` samples per row, the model pair, sampling parameters, a seed,
and where the finished data set goes:

    name: example
    pair: tiny
    seed_data: examples/seeds.jsonl     # or a list of objects
    template: "Write a short story about {{ topic }} for {{ audience }}."
    n: 3
    sampling: {max_new_tokens: 64, temperature: 0.8, top_p: 0.95}
    seed: 1234
    output: {path: "{data_dir}/synth/example-{job_id}.parquet"}   # .parquet or .jsonl
    limits: {max_chars: 100000, loop_turns: 1000000, seconds: 2}  # per row (the defaults)

Every path a spec names (seed_data, output.path) is relative to the spec file's directory
(to the working directory for a spec given as a dict), made absolute when the spec is
loaded: whoever submits or writes the data set, and from wherever, the files are the same.
``{data_dir}`` in output.path is the data directory of the settings that load the spec
(SPECQ_DATA_DIR). Sample k of row r asks for the seed derived from (spec seed, r, k), and
the engine's seeded sampling does not depend on the batch, so the same spec gives the same
data set every run.
Everything is checked (fields, seed file, output path, every row rendered within the
limits of api/templates.py) before anything is submitted.
"""

from __future__ import annotations

import csv
import hashlib
import json
import logging
import os
import re
import string
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal

import pyarrow as pa
import pyarrow.parquet as pq
import yaml
from jinja2 import Template, TemplateError
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from specq.api.client import Client, Job, NotFound
from specq.api.formats import (
    BATCH,
    counter_fields,
    infer_schema,
    open_sink,
    write_batches,
)
from specq.api.inputs import InputError, describe, show, storable, text_problem
from specq.api.outputs import OutputError, check_output
from specq.api.templates import BoundedSandbox, RenderLimits
from specq.db import repository as repo
from specq.db.models import as_utc
from specq.schema.counters import SCALARS, acceptance_rate
from specq.schema.generation import INT32_MAX, SamplingParams

log = logging.getLogger(__name__)

SEED_FORMATS = {".jsonl": "jsonl", ".json": "jsonl", ".csv": "csv", ".parquet": "parquet"}
OUTPUT_FORMATS = {".parquet": "parquet", ".jsonl": "jsonl"}
OUTPUT_PLACEHOLDERS = ("name", "job_id", "date")  # and {data_dir}, filled when loaded
MAX_SAMPLES_PER_ROW = 100_000
MAX_TEMPLATE_CHARS = 100_000
# The columns each output row has besides the seed row's own fields: the sample, its
# outcome, every scalar counter (schema/counters.py) and the acceptance rate.
SAMPLE_SCHEMA = [
    ("row_index", pa.int64()), ("sample_index", pa.int64()), ("seed", pa.int64()),
    ("custom_id", pa.string()), ("prompt", pa.string()), ("output", pa.string()),
    ("finish_reason", pa.string()), ("status", pa.string()), ("error", pa.string()),
    ("prompt_tokens", pa.int64()), *counter_fields(SCALARS),
    ("acceptance_rate", pa.float64()),
]
SAMPLE_COLUMNS = tuple(name for name, _ in SAMPLE_SCHEMA)


class SpecError(InputError):
    """The synthesis spec is invalid; each problem names its field ('where: field: ...')."""

    title = "invalid synthesis spec"


class OutputSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    path: str = Field(description="file to write; may use {name}, {job_id}, {date}")
    format: Literal["parquet", "jsonl"] | None = None  # default: from the path's suffix

    def resolved_format(self) -> str:
        return self.format or OUTPUT_FORMATS.get(Path(self.path).suffix.lower(), "")


class SynthSpec(BaseModel):
    """A synthesis spec, as validated; paths are absolute once loaded."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=200)
    pair: str = Field(min_length=1, max_length=200)
    seed_data: str | list[dict[str, Any]]
    seed_format: Literal["jsonl", "csv", "parquet"] | None = None
    template: str = Field(min_length=1, max_length=MAX_TEMPLATE_CHARS)
    chat: bool = Field(False, strict=True,
                       description="send the rendered text as one user message")
    n: int = Field(1, ge=1, le=MAX_SAMPLES_PER_ROW, strict=True)
    sampling: dict[str, Any] = Field(default_factory=dict)
    # the shape of every sample (schema/grammar.py): a run then writes only rows that
    # completed their shape (a JSON schema's rows parse and validate)
    response_format: dict[str, Any] | None = None
    seed: int = Field(0, ge=0, lt=2**63, strict=True)
    output: OutputSpec
    chunk_size: int | None = Field(None, ge=1, le=INT32_MAX, strict=True)
    priority: Literal["high", "normal", "low"] = "normal"  # broker/names.py: PRIORITIES
    limits: RenderLimits = Field(default_factory=RenderLimits)

    @model_validator(mode="before")
    @classmethod
    def _storable(cls, raw: Any) -> Any:
        """Every value is stored with the job (jobs.synthesis): plain JSON, valid text."""
        problem = storable(raw, "")
        if problem:
            raise ValueError(problem)
        return raw

    @field_validator("sampling")
    @classmethod
    def _sampling(cls, value: dict[str, Any]) -> dict[str, Any]:
        if "seed" in value:
            raise ValueError("seed: give the spec's seed; each sample's seed is derived from it")
        return SamplingParams.model_validate(value).model_dump(exclude_unset=True)

    @field_validator("response_format")
    @classmethod
    def _response_format(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is None:
            return None
        shaped = SamplingParams.model_validate({"response_format": value})
        return shaped.model_dump(exclude_unset=True)["response_format"]

    @model_validator(mode="after")
    def _one_response_format(self) -> SynthSpec:
        if self.response_format is not None and "response_format" in self.sampling:
            raise ValueError("response_format: given twice (also in sampling); give it once")
        return self

    def shape(self) -> dict[str, Any] | None:
        """The response_format every sample is generated under, or None."""
        return self.response_format or self.sampling.get("response_format")

    def resolved_seed_format(self) -> str:
        if isinstance(self.seed_data, list):
            return "inline"
        return self.seed_format or SEED_FORMATS.get(Path(self.seed_data).suffix.lower(), "")


def sample_seed(seed: int, row: int, sample: int) -> int:
    """The request seed of sample ``sample`` of row ``row``: fixed by (seed, row, sample)."""
    digest = hashlib.sha256(f"{seed}:{row}:{sample}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1  # < 2**63


# -- loading and checking ------------------------------------------------------------------


def load_spec(source: str | os.PathLike | dict[str, Any], where: str | None = None,
              data_dir: Path | None = None) -> SynthSpec:
    """Read and validate a spec (a YAML file, or its content as a dict); SpecError names
    every bad field. Checks the seed file, the output format and that every row renders.
    ``data_dir`` fills {data_dir} in output.path (default: the settings' data_dir)."""
    base = Path.cwd()
    if isinstance(source, dict):
        raw, where = dict(source), where or "spec"
    else:
        path = Path(source)
        where = where or str(path)
        if not path.is_file():
            raise SpecError([f"{where}: " + ("a directory, not a spec file" if path.is_dir()
                                             else "file not found")])
        try:
            raw = yaml.safe_load(path.read_text(encoding="utf-8"))
        except yaml.YAMLError as exc:
            raise SpecError([f"{where}: not valid YAML: {' '.join(str(exc).split())}"]) from None
        except UnicodeDecodeError as exc:
            raise SpecError([f"{where}: not valid UTF-8 (byte {exc.start + 1})"]) from None
        except RecursionError:
            raise SpecError([f"{where}: not valid YAML (nested too deeply)"]) from None
        except OSError as exc:
            raise SpecError([f"{where}: cannot read it ({exc.strerror or exc})"]) from None
        if isinstance(raw, dict):
            raw.setdefault("name", path.stem)
        base = path.resolve().parent
    if not isinstance(raw, dict):
        raise SpecError([f"{where}: expected a mapping of fields"])
    try:
        spec = SynthSpec.model_validate(raw)
    except ValidationError as exc:
        raise SpecError([f"{where}: {p}" for p in describe(exc)]) from None
    problems: list[str] = []
    if isinstance(spec.seed_data, str):
        seed_path = (base / Path(spec.seed_data).expanduser()).resolve()
        if not seed_path.is_file():
            problems.append(f"{where}: seed_data: file not found: {spec.seed_data}")
        elif not spec.resolved_seed_format():
            problems.append(f"{where}: seed_format: cannot tell the format of {seed_path.name}; "
                            f"give one of jsonl, csv, parquet")
        spec.seed_data = str(seed_path)
    if not spec.output.resolved_format():
        problems.append(f"{where}: output.format: cannot tell it from {spec.output.path!r}; "
                        f"give parquet or jsonl")
    try:
        spec.output.path = _anchored_output(spec.output.path, base, data_dir)
        check_output(output_path(spec, 0), spec.output.resolved_format())
    except OutputError as exc:
        problems.append(f"{where}: output.path: {str(exc).removeprefix('output: ')}")
    except SpecError as exc:
        problems += [f"{where}: {p}" for p in exc.problems]
    except RuntimeError as exc:  # expanduser without a home
        problems.append(f"{where}: output.path: {exc}")
    if problems:
        raise SpecError(problems)
    check_rows(spec, where)
    return spec


def _anchored_output(path: str, base: Path, data_dir: Path | None) -> str:
    """output.path with {data_dir} filled in (braces in the directory's name kept literal
    for the later {job_id} fill) and made absolute from ``base``, the spec's directory."""
    if "{data_dir}" in path:
        if data_dir is None:
            from specq.configs.settings import get_settings

            data_dir = get_settings().data_dir
        literal = str(data_dir).replace("{", "{{").replace("}", "}}")
        path = path.replace("{data_dir}", literal)
    return str(base / Path(path).expanduser())


def seed_rows(spec: SynthSpec) -> Iterator[dict[str, Any]]:
    """The seed data set's rows, streamed from its file (or the inline list)."""
    fmt, seed = spec.resolved_seed_format(), spec.seed_data
    if isinstance(seed, list):  # fmt "inline"
        yield from seed
    elif fmt == "jsonl":
        with open(seed, "rb") as f:
            for n, data in enumerate(f, 1):
                if data.strip():
                    yield _json_row(data, n)
    elif fmt == "csv":
        with open(seed, encoding="utf-8-sig", newline="") as f:
            missing: Any = object()  # the value of a column a short row lacks
            reader = csv.DictReader(f, restval=missing)
            header = reader.fieldnames or []
            twice = sorted({c for c in header if header.count(c) > 1})
            if twice:
                raise SpecError([f"seed_data: line 1: the header names {twice[0]!r} twice"])
            for row in reader:
                if None in row:
                    raise SpecError([f"seed_data: line {reader.line_num}: more fields than "
                                     f"the header has columns"])
                if missing in row.values():
                    raise SpecError([f"seed_data: line {reader.line_num}: fewer fields than "
                                     f"the header has columns"])
                yield row
    else:
        for batch in pq.ParquetFile(seed).iter_batches(batch_size=BATCH):
            yield from batch.to_pylist()


def _json_row(data: bytes, n: int) -> dict[str, Any]:
    """Line ``n`` of a JSONL seed file: an object, or SpecError naming the line."""
    try:
        row = json.loads(data.decode("utf-8-sig" if n == 1 else "utf-8"))
    except UnicodeDecodeError as exc:
        raise SpecError([f"seed_data: line {n}: not valid UTF-8 (byte {exc.start + 1})"]) from None
    except json.JSONDecodeError as exc:
        raise SpecError([f"seed_data: line {n}: not valid JSON ({exc.msg} at column "
                         f"{exc.colno})"]) from None
    except (ValueError, RecursionError) as exc:  # thousands of digits, deep nesting
        raise SpecError([f"seed_data: line {n}: not valid JSON ({type(exc).__name__})"]) from None
    if not isinstance(row, dict):
        raise SpecError([f"seed_data: line {n}: expected an object"])
    return row


class _Renderer:
    """The spec's template compiled in a BoundedSandbox; renders one row at a time."""

    def __init__(self, spec: SynthSpec, where: str) -> None:
        self.sandbox = BoundedSandbox(spec.limits)
        self.where = where
        try:
            self.template: Template = self.sandbox.compile_template(spec.template)
        except Exception as exc:  # noqa: BLE001 (syntax errors, and any other a template makes)
            raise SpecError([f"{where}: template: {_reason(exc)}"]) from None

    def try_render(self, i: int, row: dict[str, Any]) -> tuple[str | None, str | None]:
        """(rendered text, None), or (None, the problem naming row ``i``): the template
        failed, or its text is no prompt (empty, or not storable)."""
        try:
            text = self.sandbox.render(self.template, row)
        except Exception as exc:  # noqa: BLE001 (whatever the template raises is its error)
            columns = ", ".join(show(c, 40) for c in row) or "none"
            return None, f"{self.where}: template: row {i}: {_reason(exc)} (columns: {columns})"
        problem = "is empty" if not text.strip() else text_problem(text)
        if problem:
            return None, f"{self.where}: template: row {i}: the rendered text {problem}"
        return text, None

    def render(self, i: int, row: dict[str, Any]) -> str:
        text, problem = self.try_render(i, row)
        if problem is not None:
            raise SpecError([problem])
        return text or ""


def _reason(exc: BaseException) -> str:
    """One line saying what went wrong in a template."""
    if isinstance(exc, RecursionError):
        return "recursion too deep (a macro that calls itself without end?)"
    text = " ".join(str(exc).split()) or type(exc).__name__
    if not isinstance(exc, TemplateError):
        text = f"{type(exc).__name__}: {text}"
    return show(text, 300)


def check_spec(path: str | os.PathLike, presets_file: Path | None,
               client: Client | None = None) -> tuple[SynthSpec, int]:
    """The spec at ``path`` checked as `specq synth run` would take it, with no model loaded:
    its fields, its pair among the presets, every seed row rendered; with ``client``, every
    request too as its submit checks them (prompt lengths against the model's context,
    where its tokenizer is on this machine), storing nothing. SpecError names each
    problem. Returns it and its number of seed rows."""
    from specq.configs.presets import UnknownPair, get_preset

    spec = load_spec(path)
    try:
        get_preset(spec.pair, presets_file)
    except UnknownPair as exc:
        raise SpecError([f"{path}: pair: {exc.args[0]}"]) from None
    rows = check_rows(spec, str(path))
    if client is not None:
        try:
            client.check(list(requests(spec)), pair=spec.pair, **_job_params(spec))
        except InputError as exc:
            raise SpecError(by_row(spec, exc.problems, str(path))) from None
    return spec, rows


REQUEST_AT = re.compile(r"prompt (\d+): (.*)", re.S)  # an entry's problem, as submit names it


def by_row(spec: SynthSpec, problems: list[str], where: str) -> list[str]:
    """Problems of the spec's requests ('prompt K: ...', K from 1) said of the template's
    seed row they came from, once a row: its n samples share their text."""
    out: list[str] = []
    for problem in problems:
        found = REQUEST_AT.fullmatch(problem)
        said = problem if found is None else \
            f"{where}: template: row {(int(found.group(1)) - 1) // spec.n}: {found.group(2)}"
        if said not in out:
            out.append(said)
    return out


def _job_params(spec: SynthSpec) -> dict[str, Any]:
    """The job-wide parameters its submit gives: its sampling and response_format."""
    shape = {"response_format": spec.response_format} if spec.response_format else {}
    return {**spec.sampling, **shape}


def check_rows(spec: SynthSpec, where: str = "spec") -> int:
    """Render the template over every seed row within the spec's limits; SpecError names
    the template field, the first row that fails and why (a missing column, a limit passed,
    any error the template raised, text no prompt can be). Returns the number of rows."""
    renderer = _Renderer(spec, where)
    problems: list[str] = []
    rows = 0
    try:
        for i, row in enumerate(seed_rows(spec)):
            rows += 1
            clash = sorted(set(row) & set(SAMPLE_COLUMNS))
            if clash and not problems:
                problems.append(f"{where}: seed_data: column {clash[0]!r} clashes with an "
                                f"output column (reserved: {', '.join(SAMPLE_COLUMNS)})")
            _, problem = renderer.try_render(i, row)
            if problem:  # the first row that fails is enough: one line, the row named
                problems.append(problem)
                break
    except (ValueError, OSError, pa.ArrowException, csv.Error) as exc:
        if isinstance(exc, SpecError):
            raise SpecError([f"{where}: {p}" for p in exc.problems]) from None
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        raise SpecError([f"{where}: seed_data: cannot read it: {show(str(reason), 300)}"]) \
            from None
    if not problems and rows == 0:
        problems.append(f"{where}: seed_data: no rows")
    if problems:
        raise SpecError(problems)
    return rows


def requests(spec: SynthSpec) -> Iterator[dict[str, Any]]:
    """One JSONL-shaped request per (row, sample), in that order: item index = row * n + k."""
    renderer = _Renderer(spec, "spec")
    for r, row in enumerate(seed_rows(spec)):
        text = renderer.render(r, row)
        for k in range(spec.n):
            entry: dict[str, Any] = {"custom_id": f"{r}-{k}",
                                     "seed": sample_seed(spec.seed, r, k)}
            if spec.chat:
                entry["messages"] = [{"role": "user", "content": text}]
            else:
                entry["prompt"] = text
            yield entry


# -- running ---------------------------------------------------------------------------------


def submit(client: Client, spec: SynthSpec, *, schedule: str | None = None) -> Job:
    """Submit the spec as an ordinary job that records its spec and schedule."""
    origin = {"spec": spec.name, "schedule": schedule, "synthesis": spec.model_dump()}
    try:
        job = client.submit(list(requests(spec)), pair=spec.pair, chunk_size=spec.chunk_size,
                            origin=origin, priority=spec.priority, **_job_params(spec))
    except SpecError:
        raise
    except InputError as exc:  # a request's problem is its template row's
        raise SpecError(by_row(spec, exc.problems, "spec"), exc.truncated) from None
    log.info("synthesis %s%s: job %d submitted", spec.name,
             f" (schedule {schedule})" if schedule else "", job.id)
    return job


def output_path(spec: SynthSpec, job_id: int, when: datetime | None = None) -> Path:
    """The spec's output path with {name}, {job_id} and {date} (``when``, the run's start:
    one path a run, however often it is written) filled in; SpecError for any other
    placeholder, or one with attributes, conversions or wide format specs."""
    known = "(known: {name}, {job_id}, {date}, {data_dir})"
    try:
        for _, field, spec_, conversion in string.Formatter().parse(spec.output.path):
            if field is None:
                continue
            if field not in OUTPUT_PLACEHOLDERS:
                raise SpecError([f"output.path: unknown placeholder {{{show(field)}}} {known}"])
            if conversion or "{" in (spec_ or "") or len(spec_ or "") > 8:
                raise SpecError([f"output.path: {{{field}}}: only a short format spec such as "
                                 f"{{job_id:05d}} is allowed"])
        date = as_utc(when or datetime.now(timezone.utc)).strftime("%Y%m%dT%H%M%SZ")
        return Path(spec.output.path.format(name=spec.name, job_id=job_id, date=date))
    except ValueError as exc:  # SpecError included
        if isinstance(exc, SpecError):
            raise
        raise SpecError([f"output.path: {exc} {known}"]) from None


def write_output(client: Client, job_id: int) -> Path:
    """Write the finished synthesis job's data set (one row per sample: the seed row's fields,
    then SAMPLE_COLUMNS), streamed, then record its path on the job. Returns the path."""
    with client.sessions() as s:
        job = repo.get_job(s, job_id=job_id)
        if job is None or job.synthesis is None:
            raise NotFound(f"job {job_id}: not a synthesis run")
        if job.swept_at is not None:  # its outputs are gone: a rewrite would empty the set
            raise RuntimeError(f"job {job_id}: its results were swept at "
                               f"{as_utc(job.swept_at):%Y-%m-%d %H:%M} UTC (retention); the "
                               f"data set written before is the only copy left: kept as it is")
        spec = SynthSpec.model_validate(job.synthesis)
        created = job.created_at
    path = output_path(spec, job_id, created)
    path.parent.mkdir(parents=True, exist_ok=True)
    fmt = spec.output.resolved_format()
    schema = pa.schema(_seed_schema(spec) + SAMPLE_SCHEMA) if fmt == "parquet" else None
    dropped: list[int] = []
    n = write_batches(open_sink(path, fmt, schema), _output_rows(client, spec, job_id, dropped))
    with client.sessions.begin() as s:
        repo.set_output_path(s, job_id=job_id, path=str(path))
    log.info("synthesis %s: job %d: %d rows written to %s%s", spec.name, job_id, n, path,
             f" ({len(dropped)} left out: not completed to their response_format, e.g. cut "
             f"by max_new_tokens)" if dropped else "")
    return path


def _seed_schema(spec: SynthSpec) -> list[pa.Field]:
    """The seed columns' Arrow fields: the file's own for Parquet, strings for CSV; for JSONL
    and inline rows, read from all of them (formats.infer_schema: typed where the rows
    agree, JSON text where they do not)."""
    fmt, seed = spec.resolved_seed_format(), spec.seed_data
    if isinstance(seed, list) or fmt == "jsonl":
        return list(infer_schema(seed_rows(spec)))
    if fmt == "parquet":
        return list(pq.read_schema(seed))
    with open(seed, encoding="utf-8-sig", newline="") as f:  # csv
        return [pa.field(c, pa.string()) for c in next(csv.reader(f), [])]


def _output_rows(client: Client, spec: SynthSpec, job_id: int,
                 dropped: list[int]) -> Iterator[dict[str, Any]]:
    """The data set's rows. A spec with a response_format keeps only the samples that
    completed it (status completed, finish_reason stop: their grammar reached its end, so a
    JSON schema's output parses and validates); the others' indices go to ``dropped``."""
    rows = seed_rows(spec)
    renderer = _Renderer(spec, "spec")
    shaped = spec.shape() not in (None, {"type": "text"})
    row: dict[str, Any] = {}
    with client.sessions() as s:
        for item in repo.iter_items(s, job_id=job_id, batch=BATCH):
            r, k = divmod(item.index, spec.n)
            if k == 0:
                next_row = next(rows, None)
                if next_row is None:
                    raise _changed(spec, job_id, "it has fewer rows than the job")
                row = next_row
                sent = item.prompt if item.messages is None else item.messages[0]["content"]
                if sent is not None and renderer.try_render(r, row)[0] != sent:
                    raise _changed(spec, job_id, f"its row {r} renders another prompt than "
                                                 f"the job's item {item.index}")
            if shaped and (item.status != "completed" or item.finish_reason != "stop"):
                dropped.append(item.index)
                continue
            rate = acceptance_rate(item.accepted, item.proposed) if item.proposed else None
            yield {**row, "row_index": r, "sample_index": k,
                   "seed": (item.params or {}).get("seed"), "custom_id": item.custom_id,
                   "prompt": item.prompt if item.prompt is not None
                   else json.dumps(item.messages, ensure_ascii=False),
                   "output": item.output, "finish_reason": item.finish_reason,
                   "status": item.status, "error": item.error,
                   "prompt_tokens": item.prompt_tokens,
                   **{c: getattr(item, c) for c in SCALARS}, "acceptance_rate": rate}
    if next(rows, None) is not None:
        raise _changed(spec, job_id, "it has more rows than the job")


def _changed(spec: SynthSpec, job_id: int, how: str) -> RuntimeError:
    """The seed data changed since the run was submitted: its columns would not be the
    rows the job's prompts were rendered from, so no data set is written."""
    where = "the inline seed rows" if isinstance(spec.seed_data, list) else spec.seed_data
    return RuntimeError(f"job {job_id}: {where} changed since the run was submitted ({how}); "
                        f"its data set is not written (submit the run again)")


def run(client: Client, spec: SynthSpec, *, wait: bool = True, progress: bool = False,
        timeout: float | None = None) -> tuple[Job, Path | None]:
    """Submit; with ``wait``, wait for the job and write its data set. (job, path or None)"""
    job = submit(client, spec)
    if not wait:
        return job, None
    state = job.wait(progress=progress, timeout=timeout)
    log.info("synthesis %s: job %d %s", spec.name, job.id, state.status)
    return job, write_output(client, job.id)
