"""Result files other tools read: JSONL, OpenAI Batch output lines, and Parquet.

Every writer streams: rows come from the database in index order (a server-side cursor
where there is one) and leave in batches, so a job of a million items is exported without
holding it in memory. Parquet files are written one row group per batch with plain columns
(strings, integers, floats, lists of integers), which `datasets.load_dataset("parquet",
data_files=...)` and `pyarrow.parquet.read_table` read as they are.

Each row keeps what was asked beside what came back (``input``, on by default): the prompt
or the messages, and the line's own sampling parameters, so a result needs no join with the
input file to be read, and the input can be rebuilt from it. Every row has an id: the
submitted custom_id, or request-INDEX for a plain prompt (client.item_id).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import fields
from typing import TYPE_CHECKING, Any, Literal

from specq.api.client import INPUT_COLUMNS, ItemResult, Job, item_id
from specq.api.outputs import OutputError, OutputFile, check_output, said_of
from specq.db import repository as repo
from specq.db.models import ItemStatus
from specq.schema.counters import ARRAYS, SCALARS, acceptance_rate
from specq.schema.counters import kinds as counter_kinds
from specq.schema.generation import SamplingParams

if TYPE_CHECKING:  # pyarrow is imported where Parquet is written: the CLI starts faster
    import pyarrow as pa

Format = Literal["jsonl", "openai", "parquet"]
FORMATS: tuple[str, ...] = ("jsonl", "openai", "parquet")
BATCH = 1000  # rows read from the database, and rows per Parquet row group


# -- sinks: where rows go, batch by batch ------------------------------------------------


class JsonlSink:
    """One JSON object per line, to a file or to stdout (path "-"), written as
    outputs.OutputFile writes: a reader never sees half a file, and abort() leaves
    none."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = str(path)
        self._file = OutputFile(self.path)

    def write(self, rows: list[dict[str, Any]]) -> None:
        with said_of(self._file):
            self._file.stream.writelines(json_line(r) + "\n" for r in rows)

    def close(self) -> None:
        with said_of(self._file):
            self._file.close()

    def abort(self) -> None:
        """Stop writing and remove what was written (a stream keeps what it was sent)."""
        self._file.abort()


class ParquetSink:
    """A Parquet file written one row group per write(), as outputs.OutputFile writes (a
    FIFO or /dev/fd/N too: the writer never seeks), and whole at close() (abort() leaves
    no file). The schema is ``schema`` or one read from the first batch by
    ``infer_schema``; a value that does not fit its column's type is written as JSON text
    where the column is a string, refused (ValueError naming the column) where it is
    not."""

    def __init__(self, path: str | os.PathLike, schema: pa.Schema | None = None) -> None:
        self.path = check_output(path, "parquet")
        self.schema = schema
        self._file = OutputFile(self.path, binary=True)
        self._writer: Any = None  # pyarrow.parquet.ParquetWriter, opened at the first rows

    def write(self, rows: list[dict[str, Any]]) -> None:
        import pyarrow.parquet as pq

        if not rows:
            return
        if self.schema is None:
            self.schema = infer_schema(rows)
        table = arrow_table(rows, self.schema)
        with said_of(self._file):
            if self._writer is None:
                self._writer = pq.ParquetWriter(self._file.stream, self.schema)
            self._writer.write_table(table, row_group_size=len(rows))

    def close(self) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        with said_of(self._file):
            if self._writer is None:  # no rows: still a valid, empty file
                pq.write_table(pa.Table.from_pylist([], schema=self.schema or pa.schema([])),
                               self._file.stream)
            else:
                self._writer.close()  # writes the footer; the file stays open for close()
            self._file.close()

    def abort(self) -> None:
        """Stop writing and remove what was written. The file is closed before the writer,
        so no footer follows: a stream's reader gets a Parquet file that reads as broken,
        not one that reads as complete with rows missing."""
        self._file.abort()
        if self._writer is not None:
            with contextlib.suppress(ValueError, OSError):  # the footer's write, refused
                self._writer.close()


# -- Arrow types for rows whose values may not agree ---------------------------------------

def _kind(value: Any) -> str:
    """A value's column kind: null, bool, int, float, str or json (anything else, and an
    integer Parquet's int64 cannot hold)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int" if -2**63 <= value < 2**63 else "json"
    if isinstance(value, float):
        return "float"
    if isinstance(value, str):
        return "str"
    return "json"


def column_type(kinds: set[str]) -> pa.DataType:
    """The Arrow type of a column whose values have these kinds: the kind they agree on
    (integers beside floats are floats), JSON text where they do not or are nested."""
    import pyarrow as pa

    kinds = kinds - {"null"}
    if kinds == {"int", "float"}:
        kinds = {"float"}
    single = {"bool": pa.bool_(), "int": pa.int64(), "float": pa.float64(), "str": pa.string()}
    if len(kinds) == 1 and next(iter(kinds)) in single:
        return single[next(iter(kinds))]
    return pa.string()  # JSON text, or all null


def infer_schema(rows: Iterable[Mapping[str, Any]]) -> pa.Schema:
    """A schema for rows of any shapes: every key seen (in first-seen order), typed by
    column_type over its values."""
    import pyarrow as pa

    seen: dict[str, set[str]] = {}
    for row in rows:
        for key, value in row.items():
            seen.setdefault(key, set()).add(_kind(value))
    return pa.schema([pa.field(key, column_type(kinds),
                               metadata=JSON_TEXT if _json_text(kinds) else None)
                      for key, kinds in seen.items()])


# the metadata of a column of JSON text (values that disagree, or nested): each value is
# its JSON, strings too ("3" and 3 told apart), as a reader decodes them
JSON_TEXT = {b"specq": b"json"}


def _json_text(kinds: set[str]) -> bool:
    """Whether column_type holds values of these kinds as JSON text."""
    kinds = kinds - {"null"}
    return bool(kinds) and kinds != {"int", "float"} and (
        len(kinds) > 1 or kinds == {"json"})


def _fit(value: Any, field: pa.Field) -> Any:
    """``value`` as ``field``'s column holds it: JSON text in a JSON text column (strings
    too), and in a string column a value that is not a string."""
    import pyarrow as pa

    if value is None or not pa.types.is_string(field.type):
        return value
    if isinstance(value, str) and (field.metadata or {}).get(b"specq") != b"json":
        return value
    return _ENCODE(value)


def arrow_table(rows: list[dict[str, Any]], schema: pa.Schema) -> pa.Table:
    """``rows`` as a table of ``schema``: values of string columns that are not text become
    JSON text; a value that fits no typed column is a ValueError naming the column."""
    import pyarrow as pa

    columns = []
    for field in schema:
        values = [_fit(row.get(field.name), field) for row in rows]
        try:
            columns.append(pa.array(values, type=field.type))
        except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError) as exc:
            raise ValueError(f"column {field.name}: {exc}") from None
    return pa.Table.from_arrays(columns, schema=schema)


Sink = JsonlSink | ParquetSink
_ENCODE = json.JSONEncoder(ensure_ascii=False).encode  # json.dumps(r, ensure_ascii=False)
# the characters besides \n that str.splitlines() (and readers built on it) end a line at,
# which JSON leaves raw: U+0085 (NEL), U+2028 and U+2029 (JSON escapes the C0 ones itself)
_LINE_ENDS = re.compile("[\u0085\u2028\u2029]")


def json_line(value: Any) -> str:
    """``value`` as one JSONL line's text, without its newline: UTF-8 as written, but for the
    three characters a text reader may take for a line end, written as \\uXXXX (the same
    JSON), so `text.splitlines()` gives one line a record whatever a model emitted."""
    return _LINE_ENDS.sub(lambda m: f"\\u{ord(m.group()):04x}", _ENCODE(value))


def open_sink(path: str | os.PathLike, fmt: str, schema: pa.Schema | None = None) -> Sink:
    if fmt == "parquet":
        return ParquetSink(path, schema)
    return JsonlSink(path)


def write_batches(sink: Sink, rows: Iterable[dict[str, Any]], batch: int = BATCH) -> int:
    """Send ``rows`` to ``sink`` ``batch`` at a time and close it; returns the row count. On
    any failure the sink is aborted: no file, not half of one."""
    n = 0
    chunk: list[dict[str, Any]] = []
    try:
        for row in rows:
            chunk.append(row)
            if len(chunk) >= batch:
                sink.write(chunk)
                n += len(chunk)
                chunk = []
        sink.write(chunk)
        n += len(chunk)
        sink.close()  # a Parquet footer or the last lines may fail to be written too
    except BaseException:
        sink.abort()
        raise
    return n


# -- the rows of each format --------------------------------------------------------------

def counter_fields(names: tuple[str, ...] = SCALARS + ARRAYS) -> list[tuple[str, pa.DataType]]:
    """Parquet columns of these counters, typed as schema/counters.py defines them."""
    import pyarrow as pa

    arrow = {"int": pa.int64(), "float": pa.float64(), "array": pa.list_(pa.int64())}
    kind = counter_kinds()
    return [(c, arrow[kind[c]]) for c in names]


def params_type() -> pa.DataType:
    """The Parquet type of a line's sampling parameters: a struct of SamplingParams' fields
    (null where the line did not give one). Numbers and stop strings are typed as the model
    validates them; anything else (response_format: an object of several shapes) is JSON
    text."""
    import pyarrow as pa

    def arrow(annotation: Any) -> pa.DataType:
        if annotation in (int, int | None):
            return pa.int64()
        if annotation in (float, float | None):
            return pa.float64()
        if annotation == list[str]:
            return pa.list_(pa.string())
        return pa.string()  # JSON text

    return pa.struct([(name, arrow(f.annotation))
                      for name, f in SamplingParams.model_fields.items()])


def _params_row(params: Mapping[str, Any] | None, type_: pa.DataType) -> dict[str, Any] | None:
    """A line's parameters as params_type() holds them: its JSON-text fields encoded."""
    if params is None:
        return None
    text = {f.name for f in type_ if f.type.equals("string")}
    return {k: (_ENCODE(v) if k in text and v is not None else v) for k, v in params.items()}


def result_schema(input: bool = True) -> pa.Schema:
    """The Parquet export's columns: the item's outcome, every counter, the acceptance rate,
    and with ``input`` the prompt, the messages (JSON text: any message fields kept) and
    the line's parameters."""
    import pyarrow as pa

    asked = [("prompt", pa.string()), ("messages", pa.string()),
             ("params", params_type())] if input else []
    return pa.schema(
        [("index", pa.int64()), ("custom_id", pa.string()), ("status", pa.string()),
         ("output", pa.string()), ("finish_reason", pa.string()), ("error", pa.string()),
         ("prompt_tokens", pa.int64()), ("worker", pa.string())]
        + counter_fields() + [("acceptance_rate", pa.float64())] + asked)


RESULT_FIELDS = tuple(f.name for f in fields(ItemResult))
OUTCOME_FIELDS = tuple(f for f in RESULT_FIELDS if f not in INPUT_COLUMNS)


def jsonl_rows(job: Job, input: bool = True) -> Iterator[dict[str, Any]]:
    """The stored outcome of each item, as `specq run` writes it: ItemResult.as_dict(),
    without its deep copy (each item's values are its own already); without the prompt,
    messages and params unless ``input``."""
    names = RESULT_FIELDS if input else OUTCOME_FIELDS
    for item in job.results(batch=BATCH, input=input):
        yield {name: getattr(item, name) for name in names}


def flat_rows(job: Job, input: bool = True) -> Iterator[dict[str, Any]]:
    """One flat row per item (result_schema(input)): counters as columns, acceptance rate
    derived."""
    params = params_type() if input else None
    for item in job.results(batch=BATCH, input=input):
        c = item.counters
        proposed = c.get("proposed")
        row = {
            "index": item.index, "custom_id": item.custom_id, "status": item.status,
            "output": item.output, "finish_reason": item.finish_reason, "error": item.error,
            "prompt_tokens": item.prompt_tokens, "worker": item.worker,
            **{k: c.get(k) for k in SCALARS + ARRAYS},
            "acceptance_rate": acceptance_rate(c["accepted"], proposed) if proposed else None,
        }
        if input:
            row["prompt"] = item.prompt
            row["params"] = _params_row(item.params, params)
            row["messages"] = None if item.messages is None else _ENCODE(item.messages)
        yield row


def openai_rows(job: Job) -> Iterator[dict[str, Any]]:
    """OpenAI Batch output lines: id, custom_id, response (status_code, request_id, body: a
    chat.completion or text_completion object with usage) or error, for every item."""
    with job.client.sessions() as s:
        model = repo.require_job(s, job_id=job.id).pair
        for row in repo.iter_items(s, job_id=job.id, batch=BATCH, columns=OPENAI_COLUMNS):
            yield openai_line(dict(zip(OPENAI_COLUMNS, row)), job.id, model)


# what an output line reads of an item (messages: whether it is a chat completion)
OPENAI_COLUMNS = ("index", "custom_id", "status", "error", "finished_at", "new_tokens",
                  "prompt_tokens", "finish_reason", "messages", "output")


def openai_line(item: Mapping[str, Any], job_id: int, model: str) -> dict[str, Any]:
    """The output line of one item (its OPENAI_COLUMNS)."""
    index, status = item["index"], item["status"]
    request_id = f"specq-{job_id}-{index}"
    line: dict[str, Any] = {
        "id": f"batch_req_{job_id}_{index}",
        "custom_id": item_id(item["custom_id"], index),
        "response": None,
        "error": None,
    }
    if status != ItemStatus.completed.value:
        code = {ItemStatus.failed.value: "generation_failed",
                ItemStatus.cancelled.value: "batch_cancelled"}.get(status, "not_finished")
        message = item["error"] or f"the item is {status}"
        line["error"] = {"code": code, "message": message}
        return line
    created = int(item["finished_at"].timestamp()) if item["finished_at"] else 0
    prompt_tokens = item["prompt_tokens"] or 0
    completion = item["new_tokens"] or 0
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
             "total_tokens": prompt_tokens + completion}
    finish = item["finish_reason"] or "stop"
    output = item["output"] or ""
    if item["messages"] is not None:
        body = {"id": f"chatcmpl-{request_id}", "object": "chat.completion", "created": created,
                "model": model,
                "choices": [{"index": 0, "finish_reason": finish, "logprobs": None,
                             "message": {"role": "assistant", "content": output,
                                         "refusal": None}}],
                "usage": usage}
    else:
        body = {"id": f"cmpl-{request_id}", "object": "text_completion", "created": created,
                "model": model,
                "choices": [{"index": 0, "finish_reason": finish, "logprobs": None,
                             "text": output}],
                "usage": usage}
    line["response"] = {"status_code": 200, "request_id": request_id, "body": body}
    return line


def export(job: Job, output: str | os.PathLike, fmt: Format = "jsonl", *,
           input: bool = True) -> int:
    """Write the job's results to ``output`` ("-" for stdout) in ``fmt``; returns the count.
    ``input``: each jsonl or parquet row carries the prompt or messages and the line's
    parameters (OpenAI output lines never do: their custom_id is the link)."""
    if fmt not in FORMATS:
        raise OutputError(f"format: must be one of {', '.join(FORMATS)}, got {fmt!r}")
    check_output(output, fmt)
    sink: Sink
    if fmt == "parquet":
        rows, sink = flat_rows(job, input), ParquetSink(output, result_schema(input))
    else:
        rows = openai_rows(job) if fmt == "openai" else jsonl_rows(job, input)
        sink = JsonlSink(output)
    return write_batches(sink, rows)
