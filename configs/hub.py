"""What a model hub error means to whoever reads it: unreachable, missing, or gated.

huggingface_hub raises a distinct exception for each (transformers wraps them in an
OSError whose cause is the hub's): a model that is gated needs its licence accepted and a
token (HF_TOKEN), a model that does not exist (or is private) needs another name or a
token, and a hub that cannot be reached needs the network or a local cache (HF_HOME).
Saying "no config.json on the hub" for all three sends people the wrong way.
"""

from __future__ import annotations

import os

# connection failures of the HTTP clients huggingface_hub has used (httpx, requests)
_UNREACHABLE = {"ConnectError", "ConnectTimeout", "ReadTimeout", "NetworkError",
                "ConnectionError", "Timeout", "TimeoutException"}


def hub_problem(exc: BaseException, repo: str, filename: str | None = None) -> str | None:
    """One line saying what went wrong between this process and the hub for ``repo``, if
    ``exc`` (or what caused it) is a hub or connection error; None otherwise."""
    from huggingface_hub import errors as hub

    what = filename or "the model"
    for x in _chain(exc):
        if isinstance(x, hub.GatedRepoError):
            return (f"{repo} is a gated model: accept its terms at https://huggingface.co/"
                    f"{repo} with your account and set HF_TOKEN to a token of that account")
        if isinstance(x, hub.RepositoryNotFoundError):
            token = "HF_TOKEN is set" if os.environ.get("HF_TOKEN") else "set HF_TOKEN"
            return (f"{repo}: no such model on the hub (check the name; if it is private, "
                    f"{token} to a token that may read it)")
        if isinstance(x, hub.RevisionNotFoundError):
            return f"{repo}: the hub has no such revision"
        if isinstance(x, (hub.LocalEntryNotFoundError, hub.OfflineModeIsEnabled)) or \
                _is_unreachable(x):
            why = "HF_HUB_OFFLINE is set" if _offline() else "no connection"
            return (f"{repo}: the hub cannot be reached ({why}) and {what} is not in the "
                    f"local cache (HF_HOME)")
        if isinstance(x, hub.EntryNotFoundError):
            return f"{repo}: the hub has no {what} for this model"
        if isinstance(x, hub.HfHubHTTPError):
            first = str(x).splitlines()[0] if str(x) else type(x).__name__
            return f"{repo}: the hub refused the request ({first})"
    return None


def _chain(exc: BaseException) -> list[BaseException]:
    out: list[BaseException] = []
    x: BaseException | None = exc
    while x is not None and x not in out and len(out) < 16:
        out.append(x)
        x = x.__cause__ or x.__context__
    return out


def _is_unreachable(exc: BaseException) -> bool:
    return isinstance(exc, (ConnectionError, TimeoutError)) or any(
        c.__name__ in _UNREACHABLE for c in type(exc).__mro__)


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
