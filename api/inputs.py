"""Reading prompts: strings, chat message lists, specq JSONL lines, OpenAI Batch lines.

Each input entry becomes an item row (index, custom_id, prompt | messages, params) and a
validated engine Request. Problems are reported with where they are ("line 12") and the
field they concern, before anything is stored.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from worker.engine.request import Request, SamplingParams

SAMPLING_FIELDS = frozenset(SamplingParams.model_fields)
LINE_FIELDS = frozenset({"custom_id", "prompt", "messages"}) | SAMPLING_FIELDS
OPENAI_URLS = {"/v1/chat/completions": "messages", "/v1/completions": "prompt"}
OPENAI_IGNORED = frozenset({"model", "user", "n", "stream"})  # accepted, not used
OPENAI_RENAMED = {"max_tokens": "max_new_tokens", "max_completion_tokens": "max_new_tokens"}
MAX_PROBLEMS = 20

Source = str | os.PathLike | Iterable[Any]


class InputError(ValueError):
    """The job spec is invalid; ``problems`` lists each one as 'where: field: message'."""

    def __init__(self, problems: list[str], truncated: bool = False) -> None:
        self.problems = problems
        more = f"\n  ... (stopped after {len(problems)} problems)" if truncated else ""
        super().__init__("invalid job spec:\n  " + "\n  ".join(problems) + more)


@dataclass
class Entry:
    """One validated prompt: its item row and the engine request it becomes."""

    row: dict[str, Any]
    request: Request


def open_source(source: Source) -> tuple[str | None, Iterable[tuple[str, Any]]]:
    """(file name or None, a re-iterable of (where, raw entry)); raw entries from a file are
    its JSONL lines, still text. A str or path is a file; anything else holds prompts."""
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        if not path.is_file():
            raise InputError([f"{path}: file not found"])
        return str(path), _FileLines(path)
    items = source if isinstance(source, (list, tuple)) else list(source)
    return None, [(f"prompt {i + 1}", raw) for i, raw in enumerate(items)]


class _FileLines:
    """Iterating opens the file again: a first pass validates, a second stores."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        with self.path.open(encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if line.strip():
                    yield f"line {n}", JsonLine(line)


class JsonLine(str):
    """A line of a JSONL file, not yet parsed."""


def parse_entries(
    raw_entries: Iterable[tuple[str, Any]], defaults: dict[str, Any]
) -> Iterator[tuple[str, Entry | list[str]]]:
    """(where, Entry) for each good entry, (where, [problems]) for each bad one."""
    for index, (where, raw) in enumerate(raw_entries):
        try:
            row = normalise(raw)
            texts = [row["prompt"] or ""] + [str(m.get("content", "")) for m in
                                             row["messages"] or [] if isinstance(m, dict)]
            if any("\x00" in t for t in texts):
                raise _Problem("prompt: contains a NUL character (\\u0000), which no text "
                               "column can store")
            overrides = row["params"] or {}
            request = Request(id=index, prompt=row["prompt"], messages=row["messages"],
                              **{**defaults, **overrides})
        except _Problem as exc:
            yield where, [f"{where}: {exc}"]
        except ValidationError as exc:
            yield where, [f"{where}: {p}" for p in describe(exc)]
        else:
            row["index"] = index
            yield where, Entry(row, request)


class _Problem(ValueError):
    pass


def normalise(raw: Any) -> dict[str, Any]:
    """An item row (custom_id, prompt, messages, params) from a raw entry."""
    if isinstance(raw, JsonLine):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise _Problem(f"not valid JSON ({exc.msg} at column {exc.colno})") from None
    if isinstance(raw, str):
        return {"custom_id": None, "prompt": raw, "messages": None, "params": None}
    if isinstance(raw, list):
        return {"custom_id": None, "prompt": None, "messages": raw, "params": None}
    if not isinstance(raw, dict):
        raise _Problem(f"expected a prompt, a message list or an object, got {type(raw).__name__}")
    if "body" in raw:
        return _openai(raw)
    unknown = sorted(set(raw) - LINE_FIELDS)
    if unknown:
        raise _Problem(f"{unknown[0]}: unknown field (known: {', '.join(sorted(LINE_FIELDS))})")
    params = {k: v for k, v in raw.items() if k in SAMPLING_FIELDS}
    return {"custom_id": _custom_id(raw.get("custom_id")), "prompt": raw.get("prompt"),
            "messages": raw.get("messages"), "params": params or None}


def _openai(raw: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI Batch API request line: custom_id, method, url, body."""
    if raw.get("method", "POST") != "POST":
        raise _Problem(f"method: must be POST, got {raw.get('method')!r}")
    url = raw.get("url", "/v1/chat/completions")
    if url not in OPENAI_URLS:
        raise _Problem(f"url: must be one of {', '.join(OPENAI_URLS)}, got {url!r}")
    if raw.get("custom_id") is None:
        raise _Problem("custom_id: required in an OpenAI batch line")
    extra = sorted(set(raw) - {"custom_id", "method", "url", "body"})
    if extra:
        raise _Problem(f"{extra[0]}: unknown field")
    body = raw["body"]
    if not isinstance(body, dict):
        raise _Problem("body: must be an object")
    kind = OPENAI_URLS[url]
    params: dict[str, Any] = {}
    for key, value in body.items():
        if key in OPENAI_IGNORED or key == kind:
            continue
        name = OPENAI_RENAMED.get(key, key)
        if name not in SAMPLING_FIELDS:
            raise _Problem(f"body.{key}: not supported")
        params[name] = [value] if name == "stop" and isinstance(value, str) else value
    if kind not in body:
        raise _Problem(f"body.{kind}: required for {url}")
    return {"custom_id": _custom_id(raw["custom_id"]), "prompt": body.get("prompt"),
            "messages": body.get("messages"), "params": params or None}


def _custom_id(value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, (str, int)) or isinstance(value, bool) or str(value) == "":
        raise _Problem("custom_id: must be a non-empty string")
    return str(value)


def describe(exc: ValidationError) -> list[str]:
    """'field: message' for each error of a pydantic ValidationError."""
    out = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        out.append(f"{loc}: {msg}" if loc else msg)
    return out
