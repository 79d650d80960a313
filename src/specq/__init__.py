"""specq: job-queue batch generation for LLMs with batched speculative decoding.

    from specq import Client

    job = Client().submit("prompts.jsonl", pair="llama-3.1-8b", max_new_tokens=256)

The package keeps its parts in the repository's top folders (api/, worker/, db/,
configs/), installed under this one name: specq.api (the client side, no torch),
specq.worker (the engine and the Celery workers), specq.db, specq.configs. Importing
specq itself loads nothing heavy; the names below are imported on first use.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

__all__ = ["Client", "Job", "InputError", "NotFound", "Settings"]

_WHERE = {"Client": "specq.api.client", "Job": "specq.api.client",
          "NotFound": "specq.schema.errors",
          "InputError": "specq.schema.errors", "Settings": "specq.configs.settings"}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'specq' has no attribute {name!r}")
