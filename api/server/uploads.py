"""Batch input files: the multipart body of an upload is parsed as it arrives, its file
part written to a temporary file and checked on the way, so a file of any size is held in
memory one piece at a time; what the check refuses is never stored.

Two checks, each where it pays. An upload (`FileCheck`) runs at the speed of the bytes: the
size and line limits, UTF-8, no empty file, and each line an object ({...}), named by its
line number. A batch made from the file (`LineScan`, api/server/batches.py) reads each line
as JSON: an OpenAI request line (custom_id, method, url, body), custom_ids unique, one url
and one model for the whole file, a model this server serves, no ``stream: true``; then
Client.submit checks each request's parameters in full.
"""

from __future__ import annotations

import codecs
import json
import os
import re
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote_to_bytes

from python_multipart.multipart import MultipartParser, parse_options_header

from specq.api.inputs import MAX_CUSTOM_ID, MAX_PROBLEMS, OPENAI_URLS, show
from specq.api.server.errors import shown
from specq.db.batches import storable
from specq.schema.errors import json_type

MAX_LINE_BYTES = 16 * 1024 * 1024  # one request line (a prompt of 128k tokens is 1-3 MB)
# the form around the file, bounded as a whole (OpenAI's upload has two parts)
MAX_PARTS = 16  # parts of the form, the file's included
MAX_FIELD_BYTES = 4096  # one form field's value
MAX_HEADER_BYTES = 8192  # one part's headers
KNOWN_FIELDS = ("purpose", "expires_after[anchor]", "expires_after[seconds]")  # kept;
# any other field is read (within the limits) and dropped
# a NUL or a surrogate only gets into a parsed line by an escape: \u0000, \ud800-\udfff
SUSPECT = re.compile(rb"\\u(?:0000|[dD][89a-fA-F])")
PAIR = re.compile(rb"\\u[dD][89abAB][0-9a-fA-F]{2}\\u[dD][c-fC-F][0-9a-fA-F]{2}")
FATAL = ("too_many_lines", "line_too_long")  # problems after which the rest is not read
_json = json.JSONDecoder().decode  # json.loads without its checks of the argument's type


@dataclass
class Problem:
    """What is wrong, where: a line number (None: the whole file), the field, a code."""

    message: str
    line: int | None = None
    param: str | None = None
    code: str = "invalid_file"

    def text(self) -> str:
        return f"line {self.line}: {self.message}" if self.line else self.message


@dataclass(kw_only=True)
class _Lines:
    """A file's lines as its bytes arrive (`feed`, then `finish`): each non-blank one goes to
    `_check` with its number, within the line limit, until a problem refuses the file."""

    max_lines: int
    problems: list[Problem] = field(default_factory=list)
    lines: int = 0  # requests (non-blank lines)
    _number: int = 0  # lines seen, blank included
    _held: list[bytes] = field(default_factory=list)  # the unfinished line's pieces
    _held_bytes: int = 0
    _done: bool = False

    @property
    def done(self) -> bool:
        """True once the file is refused: the rest need not be read."""
        return self._done

    def feed(self, data: bytes) -> None:
        """The next bytes. Only ``data`` is searched for line ends and the unfinished line is
        kept as its pieces, joined once when its end arrives: a line of n bytes costs O(n)
        however many chunks bring it, and is refused once past MAX_LINE_BYTES."""
        start = 0
        while not self.done:
            end = data.find(b"\n", start)
            if end < 0:
                break
            if not self._take(data[start:end]):
                return
            self._line(b"".join(self._held))
            self._held, self._held_bytes = [], 0
            start = end + 1
        if not self.done and start < len(data):
            self._take(data[start:])

    def _take(self, piece: bytes) -> bool:
        """Holds a piece of the unfinished line; False (and the file refused) past the limit."""
        self._held_bytes += len(piece)
        if self._held_bytes > MAX_LINE_BYTES:
            self._held, self._held_bytes = [], 0
            self._fail(f"longer than {MAX_LINE_BYTES} bytes (a line's limit)", self._number + 1,
                       code="line_too_long")
            return False
        self._held.append(piece)
        return True

    def finish(self) -> None:
        if not self.done and self._held:
            self._line(b"".join(self._held))
        self._held, self._held_bytes = [], 0
        if not self.problems and self.lines == 0:
            self._fail("the file holds no requests (it is empty or blank)", code="empty_file")

    def _fail(self, message: str, line: int | None = None, param: str | None = None,
              code: str = "invalid_file") -> None:
        if len(self.problems) < MAX_PROBLEMS:
            self.problems.append(Problem(message, line, param, code))
        self._done = self._done or len(self.problems) >= MAX_PROBLEMS or code in FATAL

    def _line(self, raw: bytes) -> None:
        self._number += 1
        if not raw.strip():
            return
        self.lines += 1
        if self.lines > self.max_lines:
            self._fail(f"the file holds more than {self.max_lines} requests (the limit, "
                       f"SPECQ_API_MAX_FILE_LINES)", code="too_many_lines")
            return
        self._check(raw, self._number)

    def _check(self, raw: bytes, n: int) -> None:
        """Line ``n``, not blank."""
        raise NotImplementedError

    def _object(self, raw: bytes, n: int) -> dict[str, Any] | None:
        """Line ``n`` parsed (a BOM before the first skipped), or None with its problem
        said: not UTF-8, not JSON, not an object."""
        if n == 1:
            raw = raw.removeprefix(codecs.BOM_UTF8)
        try:  # (as json.loads reads bytes, without its guess at UTF-16: UTF-8 is checked)
            value = _json(raw.decode("utf-8", "surrogatepass"))
        except UnicodeDecodeError as exc:
            self._fail(f"not valid UTF-8 (byte 0x{raw[exc.start]:02x} at byte {exc.start + 1} "
                       f"of the line)", n, code="invalid_utf8")
            return None
        except json.JSONDecodeError as exc:
            self._fail(f"not valid JSON ({exc.msg} at column {exc.colno}): a batch file is "
                       f"JSONL, one request object per line", n, code="invalid_json_line")
            return None
        except (ValueError, RecursionError):
            self._fail("not valid JSON", n, code="invalid_json_line")
            return None
        if not isinstance(value, dict):
            self._fail(f"not a request object but {json_type(value)}: a batch file is JSONL, "
                       f"one request object per line", n, code="invalid_json_line")
            return None
        return value


@dataclass(kw_only=True)
class LineScan(_Lines):
    """Checks a batch file's lines as its bytes arrive (`feed`, then `finish`)."""

    check_model: Callable[[str], str | None]  # model -> why it is not served, or None
    model: str | None = None
    url: str | None = None
    _ids: set[str] = field(default_factory=set)

    def _check(self, raw: bytes, n: int) -> None:
        value = self._object(raw, n)
        if value is None:
            return
        where = unstorable(value) if suspect(raw) else None
        if where is not None:
            self._fail(f"{where}: holds a NUL character or a lone surrogate (\\u0000, "
                       "\\ud800...), which cannot be stored", n, where, "invalid_value")
            cid = value.get("custom_id")
            if isinstance(cid, str) and storable(cid):  # taken all the same: a later
                self._ids.add(cid)  # line of this id is a duplicate, said in this pass
            return
        self._request(value, n)

    def _request(self, value: dict[str, Any], n: int) -> None:
        cid = value.get("custom_id")
        if not isinstance(cid, str) or not cid or len(cid) > MAX_CUSTOM_ID:
            self._fail(f"custom_id: required, a string of 1 to {MAX_CUSTOM_ID} characters",
                       n, "custom_id")
            return
        if cid in self._ids:
            self._fail(f"custom_id: {show(cid)!r} is used more than once (each request "
                       f"needs its own)", n, "custom_id", "duplicate_custom_id")
            return
        self._ids.add(cid)
        if value.get("method", "POST") != "POST":
            self._fail(f"method: must be POST, got {show(value.get('method'))}", n, "method")
            return
        url = value.get("url")
        if url is None:
            self._fail(f"url: required in a batch line, one of {', '.join(OPENAI_URLS)}", n,
                       "url", "missing_url")
            return
        if not isinstance(url, str) or url not in OPENAI_URLS:
            self._fail(f"url: {show(url)} is not served; one of {', '.join(OPENAI_URLS)}", n,
                       "url", "unsupported_url")
            return
        if self.url is None:
            self.url = url
        elif url != self.url:
            self._fail(f"url: {url} differs from the file's {self.url} (one endpoint per "
                       f"batch)", n, "url", "mixed_urls")
            return
        body = value.get("body")
        if not isinstance(body, dict):
            self._fail("body: required, an object", n, "body")
            return
        model = body.get("model")
        if not isinstance(model, str) or not model:
            self._fail("body.model: required, a string", n, "body.model", "missing_model")
            return
        if self.model is None:
            self.model = model
            why = self.check_model(model)
            if why:
                self._fail(f"body.model: {why}", n, "body.model", "model_not_found")
                return
        elif model != self.model:
            self._fail(f"body.model: {show(model)!r} differs from the file's {show(self.model)!r}"
                       f" (one model per batch)", n, "body.model", "mixed_models")
            return
        if body.get("stream") not in (None, False):
            self._fail("body.stream: a batch request cannot stream; leave stream out or false",
                       n, "body.stream", "stream_not_supported")


@dataclass(kw_only=True)
class FileCheck(_Lines):
    """The upload's checks, a piece of the file at a time (`feed`, then `finish`)."""

    def _fail(self, message: str, line: int | None = None, param: str | None = None,
              code: str = "invalid_file") -> None:
        super()._fail(message, line, "file", code)  # every problem is the file part's

    def _check(self, raw: bytes, n: int) -> None:
        self._object(raw, n)  # parsed whole: two objects on a line, or lines ended by a
        # lone CR, are refused at the upload, not first when a batch reads the file


def suspect(raw: bytes) -> bool:
    """Whether a line's bytes may hold a NUL or a lone surrogate once parsed (then its
    strings are read one by one: `unstorable`). Surrogate pairs (an emoji written as
    escapes) are not suspect, unless escaped backslashes make the escapes ambiguous."""
    if not SUSPECT.search(raw):
        return False
    if b"\\\\" in raw:
        return True
    return SUSPECT.search(PAIR.sub(b"", raw)) is not None


def unstorable(value: Any) -> str | None:
    """The path (body.messages[0].content) of the first string in a parsed JSON value,
    key or value, holding a NUL or a lone surrogate; None if there is none."""
    stack: list[tuple[str, Any]] = [("", value)]
    while stack:
        path, v = stack.pop()
        if isinstance(v, str):
            if not storable(v):
                return path or "line"
        elif isinstance(v, dict):
            for k, item in v.items():
                key = f"{path}.{k}" if path else k
                if not storable(k):
                    return shown(key)
                stack.append((key, item))
        elif isinstance(v, list):
            stack.extend((f"{path}[{i}]", item) for i, item in enumerate(v))
    return None


class MultipartError(ValueError):
    """A body that is not the multipart form an upload is; ``param``, the form field it
    concerns."""

    def __init__(self, message: str, param: str | None = "file") -> None:
        super().__init__(message)
        self.param = param


FILENAME_STAR = re.compile(rb";\s*filename\*\s*=\s*([^;\s]+)", re.I)


def part_filename(disposition: bytes | None, options: dict[bytes, bytes]) -> bytes | None:
    """A part's file name from its Content-Disposition: RFC 5987's ``filename*``
    (``UTF-8''%E2%82%AC.jsonl``, the one RFC 6266 prefers, which python-multipart's parse
    drops) where given, else ``filename`` (of ``options``, the parsed header)."""
    star = FILENAME_STAR.search(disposition or b"")
    extended = star.group(1) if star else None
    if extended is not None and extended.count(b"'") >= 2:
        charset, _, value = extended.split(b"'", 2)
        try:
            return unquote_to_bytes(value).decode(charset.decode("ascii") or "utf-8").encode()
        except (LookupError, UnicodeDecodeError):
            pass  # an unknown charset, bytes not in it: the plain name, if any
    return options.get(b"filename")


class Upload:
    """One multipart upload (`write` each piece of the body, then `finish`): its known form
    fields, and its file part written to ``incoming``/NAME.part and checked. The form
    around the file is bounded as a whole: at most MAX_PARTS parts, MAX_HEADER_BYTES of
    headers each, MAX_FIELD_BYTES in a field; a form past them is refused as it arrives."""

    def __init__(self, boundary: bytes, incoming: Path, scan: FileCheck, max_bytes: int) -> None:
        self.scan, self.max_bytes = scan, max_bytes
        self.fields: dict[str, str] = {}
        self.filename: str | None = None
        self.size = 0  # bytes of the file part
        self.path = staging_path(incoming, ".part")
        self._out: Any = None
        self._headers: dict[bytes, bytes] = {}
        self._name: list[bytes] = []
        self._value: list[bytes] = []
        self._part: str | None = None  # the form field being read; "" for the file
        self._field: list[bytes] = []
        self._field_bytes = 0
        self._header_bytes = 0
        self._parts = 0
        self._closed = False  # the form's closing boundary was read
        self._parser = MultipartParser(boundary, {
            "on_part_begin": self._begin, "on_header_field": self._header_name,
            "on_header_value": self._header_value, "on_header_end": self._header_end,
            "on_headers_finished": self._headers_done, "on_part_data": self._data,
            "on_part_end": self._end, "on_end": self._form_end})

    @property
    def oversize(self) -> bool:
        return self.size > self.max_bytes

    def write(self, data: bytes) -> None:
        try:
            self._parser.write(data)
        except MultipartError:
            raise
        except Exception as exc:  # noqa: BLE001 (python-multipart's parse errors)
            raise MultipartError(f"the body is not a valid multipart form ({exc})") from None

    def finish(self) -> None:
        try:
            self._parser.finalize()
        except Exception as exc:  # noqa: BLE001
            raise MultipartError(f"the body is not a valid multipart form ({exc})") from None
        finally:
            self._close()
        if not self._closed:  # the parser's finalize checks nothing: a cut body looks whole
            raise MultipartError("the body ends before the form's closing boundary: a cut "
                                 "upload is not stored")
        if self.filename is None:
            raise MultipartError("file: required, the batch file as a multipart file part")
        self.scan.finish()

    def discard(self) -> None:
        self._close()
        self.path.unlink(missing_ok=True)

    def _close(self) -> None:
        if self._out is not None:
            self._out.close()
            self._out = None

    def _begin(self) -> None:
        self._parts += 1
        if self._parts > MAX_PARTS:
            raise MultipartError(f"the form has more than {MAX_PARTS} parts (an upload is "
                                 "a file and its purpose)")
        self._headers = {}
        self._header_bytes = 0

    def _header_bytes_add(self, n: int) -> None:
        self._header_bytes += n
        if self._header_bytes > MAX_HEADER_BYTES:
            raise MultipartError(f"a form part's headers are longer than {MAX_HEADER_BYTES} "
                                 "bytes")

    def _header_name(self, data: bytes, start: int, end: int) -> None:
        self._header_bytes_add(end - start)
        self._name.append(data[start:end])

    def _header_value(self, data: bytes, start: int, end: int) -> None:
        self._header_bytes_add(end - start)
        self._value.append(data[start:end])

    def _header_end(self) -> None:
        self._headers[b"".join(self._name).lower()] = b"".join(self._value).strip()
        self._name, self._value = [], []

    def _headers_done(self) -> None:
        disposition = self._headers.get(b"content-disposition")
        _, options = parse_options_header(disposition)
        name = options.get(b"name", b"").decode("utf-8", "replace")
        filename = part_filename(disposition, options)
        if name == "file" and filename is not None:
            if self.filename is not None:
                raise MultipartError("file: give one file per upload")
            name = "".join(c for c in filename.decode("utf-8", "replace") if c.isprintable())
            self.filename = name[:512] or "upload.jsonl"  # (no NUL nor control character)
            self._part = ""
            self._out = self.path.open("wb")
        else:
            self._part = name
            self._field = []
            self._field_bytes = 0

    def _data(self, data: bytes, start: int, end: int) -> None:
        piece = data[start:end]
        if self._part == "":
            self.size += len(piece)
            if self.oversize:
                return  # the rest is read and dropped: the upload is refused
            self._out.write(piece)
            self.scan.feed(piece)
        elif self._part is not None:
            self._field_bytes += len(piece)
            if self._field_bytes > MAX_FIELD_BYTES:
                raise MultipartError(f"{show(self._part[:64])}: a form field longer than "
                                     f"{MAX_FIELD_BYTES} bytes",
                                     param=self._part if self._part in KNOWN_FIELDS else None)
            if self._part in KNOWN_FIELDS:
                self._field.append(piece)

    def _form_end(self) -> None:
        self._closed = True

    def _end(self) -> None:
        if self._part == "":
            self._close()
        elif self._part in KNOWN_FIELDS:
            self.fields[self._part] = b"".join(self._field).decode("utf-8", "replace")
        self._part = None


def staging_path(incoming: Path, suffix: str) -> Path:
    """A new file name under the staging directory, led by this process's id, so that a
    server starting up can tell what dead processes left (`sweep_staging`)."""
    incoming.mkdir(parents=True, exist_ok=True)
    return incoming / f"{os.getpid()}-{secrets.token_hex(12)}{suffix}"


def sweep_staging(incoming: Path) -> int:
    """Delete what processes that died left in the staging directory (a server killed in
    the middle of an upload): the files of processes no longer running, and any older than
    a day. Files of live servers sharing the directory are kept. How many were deleted."""
    incoming.mkdir(parents=True, exist_ok=True)
    gone = 0
    day_ago = time.time() - 86400
    for path in incoming.iterdir():
        pid = path.name.partition("-")[0]
        try:
            alive = pid.isdigit() and _running(int(pid)) and path.stat().st_mtime > day_ago
            if not alive:
                path.unlink()
                gone += 1
        except FileNotFoundError:
            pass  # (its owner finished with it meanwhile)
    return gone


def _running(pid: int) -> bool:
    if pid == os.getpid():
        return False  # a file of this name from an earlier process with this pid
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def boundary_of(content_type: str | None) -> bytes:
    kind, options = parse_options_header(content_type or "")
    if kind != b"multipart/form-data" or not options.get(b"boundary"):
        raise MultipartError("an upload is a multipart/form-data body (file and purpose)")
    return options[b"boundary"]


def store_path(files_dir: Path, openai_id: str) -> Path:
    return files_dir / f"{openai_id}.jsonl"


def keep(upload: Upload, files_dir: Path, openai_id: str) -> Path:
    """Move an accepted upload into the directory store."""
    target = store_path(files_dir, openai_id)
    os.replace(upload.path, target)
    return target
