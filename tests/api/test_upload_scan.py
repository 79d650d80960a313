"""The batch file's line scan (api/server/uploads.py: LineScan), without a server: every
bad line is named in one pass, a duplicate custom_id included."""

from __future__ import annotations

import json
import random

from specq.api.server import uploads
from specq.api.server.uploads import LineScan


def _scan(lines: list[bytes]) -> list[tuple[int | None, str | None, str]]:
    scan = LineScan(check_model=lambda model: None, max_lines=100)
    scan.feed(b"".join(line + b"\n" for line in lines))
    scan.finish()
    return [(p.line, p.param, p.code) for p in scan.problems]


def _line(cid: object, prompt: str = "p") -> bytes:
    return json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/completions",
                       "body": {"model": "m", "prompt": prompt}}).encode()


def test_a_line_that_cannot_be_stored_still_takes_its_custom_id():
    """A NUL in a line's body refuses that line; its custom_id is taken all the same, so a
    later line reusing it is a duplicate in the same pass."""
    assert _scan([_line("x", "a\x00b"), _line("x"), _line("y")]) == [
        (1, "body.prompt", "invalid_value"), (2, "custom_id", "duplicate_custom_id")]


def test_an_unstorable_custom_id_takes_nothing():
    assert _scan([_line("x\x00"), _line("x\x00")]) == [
        (1, "custom_id", "invalid_value"), (2, "custom_id", "invalid_value")]


def _scan_chunked(data: bytes, cuts: list[int], **kw) -> tuple[int, list[tuple]]:
    scan = LineScan(check_model=lambda model: None, max_lines=kw.pop("max_lines", 100))
    for a, b in zip([0, *cuts], [*cuts, len(data)]):
        scan.feed(data[a:b])
    scan.finish()
    return scan.lines, [(p.line, p.param, p.code) for p in scan.problems]


def test_any_cutting_of_the_bytes_scans_the_same():
    """Chunks end anywhere (inside a line, on a newline, inside a UTF-8 character, empty
    chunks): the lines and problems are those of the file in one piece."""
    lines = [_line("a"), b"", _line("b", "caf\u00e9 \u2028"), b"not json", _line("a"),
             b"   ", _line("c", "x" * 300)]
    data = b"\n".join(lines) + b"\n" + _line("last")  # no final newline
    whole = _scan_chunked(data, [])
    assert whole == (6, [(4, None, "invalid_json_line"), (5, "custom_id", "duplicate_custom_id")])
    gen = random.Random(7)
    for _ in range(200):
        cuts = sorted(gen.randint(0, len(data)) for _ in range(gen.randint(1, 40)))
        assert _scan_chunked(data, cuts) == whole, cuts
    assert _scan_chunked(data, list(range(1, len(data)))) == whole  # a byte at a time


def test_a_line_past_the_limit_is_refused_where_it_starts(monkeypatch):
    """However its bytes arrive: held in pieces, never past MAX_LINE_BYTES, and named by its
    line number; the lines before it are scanned."""
    monkeypatch.setattr(uploads, "MAX_LINE_BYTES", 1000)
    long = _line("b", "x" * 2000)
    data = _line("a") + b"\n" + long + b"\n" + _line("c") + b"\n"
    for size in (1, 7, 64, 999, len(data)):
        scan = LineScan(check_model=lambda model: None, max_lines=100)
        for i in range(0, len(data), size):
            scan.feed(data[i:i + size])
            assert scan._held_bytes <= 1000
        scan.finish()
        assert [(p.line, p.code) for p in scan.problems] == [(2, "line_too_long")], size
        assert scan.lines == 1
    exact = _line("d", "y" * (1000 - len(_line("d", ""))))
    assert len(exact) == 1000 and _scan_chunked(exact + b"\n", [500]) == (1, [])
