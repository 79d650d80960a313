"""Reading prompts: strings, chat message lists, specq JSONL lines, OpenAI Batch lines.

Each input entry becomes an item row (index, custom_id, prompt | messages, params) and a
validated engine Request. Problems are reported with where they are ("line 12") and the
field they concern, before anything is stored. Whatever is stored is plain JSON that every
database keeps as it is: valid Unicode text without NUL, finite numbers, integers within
64 bits (`storable`).
"""

from __future__ import annotations

import codecs
import json
import math
import os
import reprlib
import sys
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from specq.schema.errors import InputError, describe
from specq.schema.errors import path as field_path
from specq.schema.generation import INT32_MAX, Request, SamplingParams, merge

SAMPLING_FIELDS = frozenset(SamplingParams.model_fields)
LINE_FIELDS = frozenset({"custom_id", "prompt", "messages"}) | SAMPLING_FIELDS
OPENAI_URLS = {"/v1/chat/completions": "messages", "/v1/completions": "prompt"}
# accepted, not used: who asks (user, safety_identifier), OpenAI's own caching, tiers and
# stored-completion tags, none of which changes what a model writes
OPENAI_IGNORED = frozenset({"model", "user", "stream", "safety_identifier", "prompt_cache_key",
                            "service_tier", "metadata"})
# OpenAI's own defaults for what a line leaves out (or sends as null): sampled at
# temperature 1, no cap on new tokens but the model's context; a job's parameters given
# explicitly (`Client.submit`'s sampling, the CLI's flags) go first
OPENAI_DEFAULTS: dict[str, Any] = {"temperature": 1.0, "max_new_tokens": None}
# fields specq does not serve, at the values that ask for nothing (OpenAI's defaults)
OPENAI_NOOPS: dict[str, tuple[Any, ...]] = {
    "logprobs": (False,), "top_logprobs": (0,), "presence_penalty": (0, 0.0),
    "frequency_penalty": (0, 0.0), "logit_bias": ({},), "tools": ([],),
    "tool_choice": ("none",), "parallel_tool_calls": (True, False),
    "store": (True, False),  # whether OpenAI keeps the completion: specq keeps every one
    "modalities": (["text"],), "echo": (False,), "best_of": (1,)}  # (the last two:
# /v1/completions' prompt echoed back, and candidates generated to return the best of)
OPENAI_MAX_TEMPERATURE = 2  # OpenAI's range is 0 to 2
# an OpenAI batch line's field that is none of its four (the HTTP door names it as it is)
UNKNOWN_LINE_FIELD = "unknown field of a request line (it has custom_id, method, url, body)"
OPENAI_RENAMED = {"max_tokens": "max_new_tokens", "max_completion_tokens": "max_new_tokens"}
# vLLM's guided decoding extras, read as the response_format they mean (schema/grammar.py)
OPENAI_GUIDED = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice"}
MAX_PROBLEMS = 20
MAX_CUSTOM_ID = 512  # items.custom_id is a String(512) column
MAX_DEPTH = 32  # levels of nesting in one entry
MAX_VALUES = 1_000_000  # values in one entry (a YAML alias bomb is small text, not data)
INT64 = 2**63
STDIN = "-"  # a source of this name is standard input, read as a JSONL file

Source = str | os.PathLike | Iterable[Any]


def show(value: Any, limit: int = 60) -> str:
    """``value`` for an error message: one line of printable text, at most ``limit`` chars
    (a printable string as it is, anything else as a shortened repr)."""
    if isinstance(value, str) and value.isprintable() and value:
        text = value
    elif isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        text = f"<a {value.bit_length()}-bit integer>"
    else:
        try:
            text = _REPR.repr(value)  # repr() escapes what is not printable
        except (ValueError, RecursionError):  # an int of thousands of digits, deep nesting
            text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[:limit - 3] + "..."


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother = 3, 80, 80


def text_problem(text: str) -> str | None:
    """Why ``text`` cannot be stored in a text column, or None: a NUL, or a lone surrogate
    (not Unicode: it has no UTF-8 encoding)."""
    if "\x00" in text:
        return "contains a NUL character (\\u0000), which no text column can store"
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return (f"contains a lone surrogate ({ascii(text[exc.start])[1:-1]} at character "
                f"{exc.start + 1}), which is not valid Unicode")
    return None


def storable(value: Any, path: str) -> str | None:
    """The first reason ``value`` cannot be stored as JSON, as 'path: reason', or None.

    Accepted: dicts with str keys, lists, str (`text_problem`), bool, None, ints within
    64 bits, finite floats; at most MAX_DEPTH levels and MAX_VALUES values (cycles and
    YAML alias bombs end there). ``path`` names ``value``; nested ones read
    'messages[0].content'."""
    if _fine(value):  # the common case, without a path built for every value
        return None
    stack: list[tuple[str, Any, int]] = [(path, value, 0)]
    seen = 0
    while stack:
        where, v, depth = stack.pop()
        seen += 1
        if seen > MAX_VALUES:
            return f"{path or 'entry'}: more than {MAX_VALUES} values"
        if depth > MAX_DEPTH:
            return f"{where}: nested more than {MAX_DEPTH} levels deep"
        if isinstance(v, str):
            problem = text_problem(v)
        elif v is None or isinstance(v, bool):
            problem = None
        elif isinstance(v, int):
            problem = None if -INT64 <= v < INT64 else "integer out of range (beyond 64 bits)"
        elif isinstance(v, float):
            problem = None if math.isfinite(v) else f"must be a finite number, got {v}"
        elif isinstance(v, (list, tuple)):
            problem = None
            stack.extend((f"{where}[{i}]", x, depth + 1) for i, x in enumerate(v))
        elif isinstance(v, dict):
            problem = None
            for k, x in v.items():
                if not isinstance(k, str):
                    return f"{where or 'entry'}: key {show(k)}: keys must be strings"
                key_problem = text_problem(k)
                if key_problem:
                    return f"{where or 'entry'}: key {show(k)}: {key_problem}"
                stack.append((f"{where}.{show(k)}" if where else show(k), x, depth + 1))
        else:
            problem = f"{type(v).__name__} is not a JSON value"
        if problem:
            return f"{where or 'entry'}: {problem}"
    return None


def _fine(value: Any) -> bool:
    """True when `storable` finds nothing wrong with ``value``; False when it may (it then
    walks again, naming the place). Plain JSON types only: anything else is for storable."""
    stack: list[tuple[Any, int]] = [(value, 0)]
    seen = 0
    while stack:
        v, depth = stack.pop()
        seen += 1
        if seen > MAX_VALUES or depth > MAX_DEPTH:
            return False
        kind = type(v)
        if kind is str:
            if "\x00" in v or (not v.isascii() and text_problem(v)):
                return False
        elif kind is dict:
            for k, x in v.items():
                if type(k) is not str or "\x00" in k or (not k.isascii() and text_problem(k)):
                    return False
                stack.append((x, depth + 1))
        elif kind is list:
            stack.extend((x, depth + 1) for x in v)
        elif kind is int:
            if not -INT64 <= v < INT64:
                return False
        elif kind is float:
            if not math.isfinite(v):
                return False
        elif v is not None and kind is not bool:
            return False
    return True


class ArgumentError(InputError):
    """A call's argument (a job id, a page's limit) out of its range: not a job spec's."""

    title = "invalid argument"


def check_count(name: str, value: Any, *, low: int = 1, high: int = INT32_MAX,
                error: type[InputError] = InputError) -> int:
    """``value`` if it is an int in [low, high] (not a bool); ``error`` naming ``name``."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise error([f"{name}: must be an integer, got {type(value).__name__} {show(value)}"])
    if value < low:
        raise error([f"{name}: must be at least {low}, got {value}"])
    if value > high:
        raise error([f"{name}: must be at most {high}, got {show(value)}"])
    return value


def check_job_id(value: Any) -> int:
    """``value`` as a job id (jobs.id is a 32-bit INTEGER); ArgumentError otherwise."""
    return check_count("job", value, error=ArgumentError)


@dataclass
class Entry:
    """One validated prompt: its item row and the engine request it becomes; ``names``:
    the line's own names of specq's fields where they differ (an OpenAI line's
    max_completion_tokens for max_new_tokens), for problems found later."""

    row: dict[str, Any]
    request: Request
    names: Mapping[str, str] = field(default_factory=dict)


@dataclass
class Refused:
    """One bad entry: its problem (one line naming the entry and the field), and the
    custom_id it gives when that can be read. The id is taken all the same, so a later
    entry that reuses it is named in the same pass."""

    problem: str
    custom_id: str | None = None


def open_source(source: Source) -> tuple[str | None, Iterable[tuple[str, Any]]]:
    """(file name or None, a re-iterable of (where, raw entry)); raw entries from a file are
    its JSONL lines, still text. A str or path is a file ("-": standard input, and a pipe
    such as <(cmd), read once and kept in memory, since validating and storing each read
    the lines); anything else holds prompts."""
    if isinstance(source, str) and source == STDIN:
        return "<stdin>", list(_lines(sys.stdin.buffer))
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        name = show(str(path), 200)
        try:
            is_file, is_dir, exists = path.is_file(), path.is_dir(), path.exists()
        except (OSError, ValueError) as exc:  # a NUL in the name, a name too long
            raise InputError([f"{name}: cannot open it ({exc})"]) from None
        if exists and not is_file and not is_dir:  # a pipe (<(cmd), a FIFO): one reading
            try:
                with path.open("rb") as f:
                    return name, list(_lines(f))
            except OSError as exc:
                raise InputError([f"{name}: cannot read it ({exc.strerror or exc})"]) from None
        if not is_file:
            kind = "a directory, not a file" if is_dir else "file not found"
            raise InputError([f"{name}: {kind}"])
        # the name as stored (jobs.source): a name of undecodable bytes keeps them escaped
        return str(path).encode("utf-8", "backslashreplace").decode("utf-8"), _FileLines(path)
    if isinstance(source, (bytes, bytearray, Mapping)) or not isinstance(source, Iterable):
        raise InputError([f"prompts: expected a file path or a list of prompts, got "
                          f"{type(source).__name__}"])
    if isinstance(source, (set, frozenset)):  # items are stored by their place: none here
        raise InputError([f"prompts: a {type(source).__name__} has no order, and each item "
                          f"keeps its place; give a list (sorted(...), or as written)"])
    items = source if isinstance(source, (list, tuple)) else list(source)
    return None, [(f"prompt {i + 1}", raw) for i, raw in enumerate(items)]


class _FileLines:
    """Iterating opens the file again: a first pass validates, a second stores. Lines are
    decoded one by one, so a bad byte is that line's problem (a BadLine), not the file's."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        try:
            f = self.path.open("rb")
        except OSError as exc:
            raise InputError([f"{show(str(self.path), 200)}: cannot read it "
                              f"({exc.strerror or exc})"]) from None
        with f:
            yield from _lines(f)


# what a file that is not JSON lines starts with, and what it is
NOT_JSONL = {b"PAR1": "a Parquet file, not JSON lines (Parquet and CSV are read as a "
                      "synthesis spec's seed_data: docs/synthesis.md)",
             b"\x1f\x8b": "gzip-compressed: decompress it first (zcat FILE | specq submit -)",
             b"PK\x03\x04": "a zip archive, not JSON lines",
             codecs.BOM_UTF16_LE: "UTF-16 text (it starts with a UTF-16 byte order mark); "
                                  "JSONL is UTF-8: convert it (iconv -f UTF-16 -t UTF-8 FILE)",
             codecs.BOM_UTF16_BE: "UTF-16 text (it starts with a UTF-16 byte order mark); "
                                  "JSONL is UTF-8: convert it (iconv -f UTF-16 -t UTF-8 FILE)"}


def _lines(f: Iterable[bytes]) -> Iterator[tuple[str, Any]]:
    """(where, JsonLine or BadLine) for each non-blank line of a binary stream; a file that
    is plainly something else (Parquet, gzip, zip) is one BadLine saying so."""
    for n, data in enumerate(f, 1):
        if n == 1:
            kind = next((what for magic, what in NOT_JSONL.items()
                         if data.startswith(magic)), None)
            if kind:
                yield "line 1", BadLine(f"the file is {kind}")
                return
        try:
            line = data.decode("utf-8-sig" if n == 1 else "utf-8")
        except UnicodeDecodeError as exc:
            yield f"line {n}", BadLine(f"not valid UTF-8 (byte 0x{data[exc.start]:02x} "
                                       f"at byte {exc.start + 1} of the line)")
            continue
        if line.strip():
            yield f"line {n}", JsonLine(line)


class JsonLine(str):
    """A line of a JSONL file, not yet parsed."""


class BadLine(str):
    """A line of a JSONL file that cannot be read; the text says why."""


def parse_entries(
    raw_entries: Iterable[tuple[str, Any]], defaults: dict[str, Any],
    given: frozenset[str] = frozenset(),
) -> Iterator[tuple[str, Entry | Refused]]:
    """(where, Entry) for each good entry, (where, Refused) for each bad one. A plain
    prompt (`plain_row`) is checked in a few steps, and its request is a copy of one
    validated with the job's defaults, its prompt and id put in: what validating it would
    give. ``given``: the job's parameters its submitter gave, which go before an OpenAI
    line's defaults (OPENAI_DEFAULTS)."""
    try:
        template: Request | None = Request(id=0, prompt="x", messages=None, **defaults)
    except ValidationError:  # every entry fails: the slow path names how
        template = None
    for index, (where, raw) in enumerate(raw_entries):
        yield where, read_entry(index, where, raw, defaults, template, given)


def read_entry(index: int, where: str, raw: Any, defaults: dict[str, Any],
               template: Request | None = None,
               given: frozenset[str] = frozenset()) -> Entry | Refused:
    """Entry ``index`` (named ``where``) as an Entry, or Refused naming its problem. With a
    ``template`` (a request validated with the job's defaults) a plain prompt takes the
    fast path; without one every entry is read in full. An OpenAI line's own defaults
    are stored with its parameters, but for those in ``given``."""
    names: dict[str, str] = {}
    value = None
    try:
        value = _loads(raw) if isinstance(raw, JsonLine) else raw
        if template is not None and (row := plain_row(value)) is not None:
            request = template.model_copy(update={"id": index, "prompt": row["prompt"]})
        else:
            row = normalise(value)
            implied = {k: v for k, v in row.pop("implied", {}).items() if k not in given}
            names = row.pop("names", {})
            if implied:
                row["params"] = {**implied, **(row["params"] or {})}
            request = Request(id=index, prompt=row["prompt"], messages=row["messages"],
                              **merge(defaults, row["params"]))
    except _Problem as exc:
        return Refused(f"{where}: {exc}", _given_id(value))
    except ValidationError as exc:
        return Refused(first_problem(where, exc), _given_id(value))
    row["index"] = index
    return Entry(row, request, names)


def _given_id(value: Any) -> str | None:
    """The custom_id a bad entry gives, when it is one that could be stored."""
    if not isinstance(value, dict):
        return None
    cid = value.get("custom_id")
    if isinstance(cid, str) and text_problem(cid):
        return None
    try:
        return _custom_id(cid)
    except _Problem:
        return None


def first_problem(where: str, exc: ValidationError) -> str:
    """One line for an entry: its first problem, and how many more it has."""
    problems = describe(exc)
    more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
    return f"{where}: {problems[0]}{more}"


class _Problem(ValueError):
    pass


_PLAIN_KEYS = frozenset({"prompt", "custom_id"})


def plain_row(raw: Any) -> dict[str, Any] | None:
    """The row `normalise` makes of the commonest entry, a good prompt, in a few checks: a
    str, or a dict of a str prompt and at most a str custom_id (as JSON gives them: exact
    types); None for anything else, which `normalise` and Request then read in full. What
    it accepts they accept (a prompt not blank, storable text, a custom_id as stored),
    and its row is theirs (tests/api/test_plain_prompts.py)."""
    prompt: Any  # a str, checked below
    if type(raw) is str:
        prompt, cid = raw, None
    elif type(raw) is dict and raw.keys() <= _PLAIN_KEYS and all(type(k) is str for k in raw):
        prompt, cid = raw.get("prompt"), raw.get("custom_id")
        if cid is not None and (type(cid) is not str or not 0 < len(cid) <= MAX_CUSTOM_ID
                                or text_problem(cid)):
            return None
    else:
        return None
    if type(prompt) is not str or not prompt.strip() or text_problem(prompt):
        return None
    return {"custom_id": cid, "prompt": prompt, "messages": None, "params": None}


def normalise(raw: Any) -> dict[str, Any]:
    """An item row (custom_id, prompt, messages, params) from a raw entry; _Problem when the
    entry is not of a known shape or holds anything that cannot be stored (`storable`)."""
    if isinstance(raw, BadLine):
        raise _Problem(str(raw))
    if isinstance(raw, JsonLine):
        raw = _loads(raw)
    if not isinstance(raw, (str, list, dict)):
        raise _Problem(f"expected a prompt, a message list or an object, got {type(raw).__name__}")
    problem = storable(raw, "prompt" if isinstance(raw, str) else
                       "messages" if isinstance(raw, list) else "")
    if problem:
        raise _Problem(_prompt_first(problem))
    if isinstance(raw, str):
        return {"custom_id": None, "prompt": raw, "messages": None, "params": None}
    if isinstance(raw, list):
        if raw and all(isinstance(m, dict) and "role" not in m for m in raw):
            raise _Problem("a JSON array of objects without a role: a list on a line is one "
                           "prompt's chat messages; a file of prompts holds one JSON object "
                           "per line (JSONL), not an array")
        return {"custom_id": None, "prompt": None, "messages": raw, "params": None}
    if "body" in raw:
        return _openai(raw)
    if "url" in raw or "method" in raw:  # an OpenAI batch line that lost its body
        raise _Problem("body: required in an OpenAI batch line (custom_id, method, url, "
                       "body), the request's parameters")
    unknown = sorted(set(raw) - LINE_FIELDS)
    if unknown:
        raise _Problem(f"{show(unknown[0])}: unknown field (known: "
                       f"{', '.join(sorted(LINE_FIELDS))})")
    if (raw.get("prompt") is None) == (raw.get("messages") is None):
        raise _Problem("a line gives a prompt or messages, exactly one of them ("
                       + ("both given)" if raw.get("prompt") is not None else "neither given)"))
    params = {k: v for k, v in raw.items() if k in SAMPLING_FIELDS}
    return {"custom_id": _custom_id(raw.get("custom_id")), "prompt": raw.get("prompt"),
            "messages": raw.get("messages"), "params": params or None}


def _loads(line: str) -> Any:
    try:
        return json.loads(line)
    except json.JSONDecodeError as exc:
        what = exc.msg.removesuffix(" at")  # 'Invalid control character at'
        raise _Problem(f"not valid JSON ({what} at column {exc.colno})") from None
    except RecursionError:
        raise _Problem("not valid JSON (nested too deeply)") from None
    except ValueError as exc:  # an integer of thousands of digits
        raise _Problem(f"not valid JSON ({str(exc).split(':')[0]})") from None


def _prompt_first(problem: str) -> str:
    """A problem inside the prompt's text (prompt, messages, body.prompt, body.messages) is
    reported under 'prompt', with the exact place after it."""
    path, _, reason = problem.partition(": ")
    top = path.removeprefix("body.").split(".")[0].split("[")[0]
    if top not in ("prompt", "messages") or path == "prompt":
        return problem
    head, _, tail = reason.partition(", ")
    return f"prompt: {head} at {path}" + (f", {tail}" if tail else "")


def _openai(raw: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI Batch API request line: custom_id, method, url, body."""
    if raw.get("method", "POST") != "POST":
        raise _Problem(f"method: must be POST, got {show(raw.get('method'))}")
    url = raw.get("url", "/v1/chat/completions")
    if not isinstance(url, str) or url not in OPENAI_URLS:
        raise _Problem(f"url: must be one of {', '.join(OPENAI_URLS)}, got {show(url)}")
    if raw.get("custom_id") is None:
        raise _Problem("custom_id: required in an OpenAI batch line")
    extra = sorted(set(raw) - {"custom_id", "method", "url", "body"})
    if extra:
        raise _Problem(f"{show(extra[0])}: {UNKNOWN_LINE_FIELD}")
    body = raw["body"]
    if not isinstance(body, dict):
        raise _Problem(f"body: must be an object, got {type(body).__name__}")
    kind = OPENAI_URLS[url]
    params: dict[str, Any] = {}
    keys: dict[str, str] = {}  # our name -> the body's own
    for key, value in body.items():
        if key in OPENAI_IGNORED or key == kind or value is None:  # null: OpenAI's default
            continue
        if key == "n":
            _one_choice(value)
            continue
        if any(value == v and type(value) is type(v) for v in OPENAI_NOOPS.get(key, ())):
            continue
        name = OPENAI_RENAMED.get(key, key)
        if key in OPENAI_GUIDED:
            name, value = "response_format", _guided(OPENAI_GUIDED[key], value)
        if name not in SAMPLING_FIELDS:
            raise _Problem(f"body.{show(key)}: not supported")
        if name in keys:
            raise _Problem(f"body.{key}: the same setting as body.{keys[name]}, which the line "
                           f"gives already; give one of them")
        params[name] = [value] if name == "stop" and isinstance(value, str) else value
        keys[name] = key
    if body.get(kind) is None:
        raise _Problem(f"body.{kind}: required for {url}")
    if kind == "prompt" and isinstance(body["prompt"], list):
        raise _Problem("body.prompt: one prompt string per request; an array (of prompts or "
                       "of token ids) is not served: give each prompt a line of its own")
    try:
        SamplingParams.model_validate(params)
    except ValidationError as exc:  # named as the line names it: body.max_tokens
        raise _Problem(_openai_problem(exc.errors()[0], keys)) from None
    if params.get("temperature", 0) > OPENAI_MAX_TEMPERATURE:
        raise _Problem(f"body.{keys['temperature']}: at most {OPENAI_MAX_TEMPERATURE} in an "
                       f"OpenAI batch line, as OpenAI takes it (specq's own lines take more)")
    return {"custom_id": _custom_id(raw["custom_id"]), "prompt": body.get("prompt"),
            "messages": body.get("messages"), "params": params or None,
            "implied": {k: v for k, v in OPENAI_DEFAULTS.items() if k not in params},
            "names": {ours: theirs for ours, theirs in keys.items() if ours != theirs}}


def _openai_problem(err: Mapping[str, Any], keys: Mapping[str, str]) -> str:
    """A validation error of an OpenAI line's parameters, its place as the line names it
    (``body.max_completion_tokens``, ``body.response_format.json_schema.schema``); a check
    of several fields names its field in its message (``stop: ...``)."""
    msg = str(err["msg"]).removeprefix("Value error, ")
    loc = list(err["loc"])
    if not loc:
        head, sep, rest = msg.partition(": ")
        if sep and head in keys:
            return f"body.{keys[head]}: {rest}"
        return f"body: {msg}"
    return f"body.{keys.get(loc[0], loc[0])}{field_path(loc)[len(str(loc[0])):]}: {msg}"


def _guided(kind: str, value: Any) -> dict[str, Any]:
    """A vLLM guided_json, guided_regex or guided_choice value as a response_format."""
    if kind == "json_schema":
        if isinstance(value, str):  # vLLM takes the schema as JSON text too
            try:
                value = json.loads(value)
            except json.JSONDecodeError:
                raise _Problem("body.guided_json: not a JSON schema (not valid JSON)") from None
        return {"type": "json_schema", "json_schema": {"name": "guided_json", "schema": value}}
    return {"type": kind, kind: value}


def _one_choice(n: Any) -> None:
    """OpenAI's ``n``: choices per request. One is served (each item has one output);
    more would come back as one answer, silently, so it is refused."""
    if n is None:  # OpenAI's default, 1
        return
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise _Problem(f"body.n: must be a positive integer, got {show(n)}")
    if n != 1:
        raise _Problem(f"body.n: {n} choices per request are not served (one output per "
                       f"item); send the request {n} times with distinct custom_ids and "
                       f"seeds instead")


def _custom_id(value: Any) -> str | None:
    """A custom_id as stored: a non-empty string (an integer is taken as its digits) of at
    most MAX_CUSTOM_ID characters; its text was checked by `storable` already."""
    if value is None:
        return None
    if not isinstance(value, (str, int)) or isinstance(value, bool):
        raise _Problem(f"custom_id: must be a non-empty string, got {type(value).__name__}")
    text = str(value)  # `storable` bounded an int to 64 bits: at most 20 characters
    if text == "":
        raise _Problem("custom_id: must be a non-empty string")
    if len(text) > MAX_CUSTOM_ID:
        raise _Problem(f"custom_id: longer than {MAX_CUSTOM_ID} characters ({len(text)})")
    return text
