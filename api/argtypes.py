"""argparse types shared by the CLI's commands and the benches (torch-free)."""

from __future__ import annotations

import argparse

COUNT_MAX = 2**31 - 1


def positive_int(text: str) -> int:
    """An argparse type: an integer from 1 to COUNT_MAX."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text[:40]!r}") from None
    if not 1 <= value <= COUNT_MAX:
        raise argparse.ArgumentTypeError(f"must be from 1 to {COUNT_MAX}, got {text[:40]!r}")
    return value
