"""The batch file's line scan (api/server/uploads.py: LineScan), without a server: every
bad line is named in one pass, a duplicate custom_id included."""

from __future__ import annotations

import json

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
