"""The target's tokenizer and context, for checking prompts without the model stack and
without the hub.

A submission tokenizes only the prompts that may not fit (schema/generation.py:
fits_by_size); for those it needs the target's tokenizer. It is read with the
`tokenizers` library from files on this machine: the folder a worker (or `specq
cache-tokenizer`) wrote in the data directory (configs/tokenizer_cache.py), else the model's
own directory, else the hub's local cache. Its chat template comes from
tokenizer_config.json or chat_template.jinja, rendered as transformers renders it (a
sandboxed Jinja2 environment), and the context length from that folder, config.json or a
GGUF file's metadata: no torch, no transformers, no request to the hub. When none is here
the submission says its prompts were not checked (TokenizerUnavailable) and goes on. A
model whose tokenizer lives only inside a GGUF file is converted once with transformers
(installed with specq[worker]) into the same folder.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import struct
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal, overload

from specq.configs import tokenizer_cache
from specq.configs.hub import hub_problem
from specq.configs.presets import ModelSource, PairError, PairPreset, locate
from specq.configs.settings import Settings
from specq.schema.generation import (
    Request,
    RequestError,
    check_length,
    check_size,
    context_length,
    longest_token,
)

log = logging.getLogger(__name__)

SPECIAL = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token",
           "mask_token")


@dataclass
class PromptTokenizer:
    """Encodes a request's prompt as the engine does (worker/engine/speculative.py:
    encode_prompt), with the tokenizers library alone."""

    tokenizer: Any  # tokenizers.Tokenizer
    chat_template: str | None
    special: dict[str, str]
    longest_token: int = 0  # bytes, at most, of one token's text (0: read from the vocabulary)

    def __post_init__(self) -> None:
        if not self.longest_token:
            self.longest_token = longest_token(self.tokenizer.get_vocab())

    def encode(self, request: Request, context: int) -> list[int]:
        """Token ids of the prompt; RequestError when it cannot fit ``context`` (one far
        too long for it is refused by its size, untokenized)."""
        check_size(request, self.longest_token, context)
        if request.prompt_token_ids is not None:
            ids = list(request.prompt_token_ids)
        elif request.messages is not None:
            ids = self.tokenizer.encode(self.render(request), add_special_tokens=False).ids
        else:
            ids = self.tokenizer.encode(request.prompt).ids
        check_length(len(ids), request.max_new_tokens, context)
        return ids

    def render(self, request: Request) -> str:
        if not self.chat_template:
            raise RequestError("messages", "this model's tokenizer has no chat template")
        assert request.messages is not None  # encode renders requests of messages only
        try:
            return _compile(self.chat_template).render(
                messages=[m.model_dump() for m in request.messages], tools=None,
                documents=None, add_generation_prompt=True, **self.special)
        except Exception as exc:  # noqa: BLE001 (a model's own Jinja template: anything)
            raise RequestError("messages", f"the model's chat template refused them: "
                               f"{type(exc).__name__}: {exc}") from None


@lru_cache(maxsize=16)
def _compile(template: str) -> Any:
    """A chat template compiled as transformers compiles it (Jinja2 is imported here: a
    submission of plain prompts never needs it, and `specq submit` starts faster)."""
    from jinja2 import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: Any = None, sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


# -- finding the files ------------------------------------------------------------------


class TokenizerUnavailable(PairError):
    """The target's tokenizer or context is not on this machine (a hub model that no worker
    or operator cached here, a package not installed here): prompts are not checked."""


def target_context(preset: PairPreset, settings: Settings) -> int:
    """The target's context length, from files on this machine (no weights, no hub);
    TokenizerUnavailable when there are none."""
    return _context(preset.target.model_dump_json(), str(settings.data_dir))


def prompt_tokenizer(preset: PairPreset, settings: Settings) -> PromptTokenizer:
    """The target's tokenizer, loaded once per process, from files on this machine;
    TokenizerUnavailable when there are none."""
    return _tokenizer(preset.target.model_dump_json(), str(settings.data_dir),
                      preset.trust_remote_code)


def grammar_problem(preset: PairPreset, settings: Settings) -> str | None:
    """Why the grammar library cannot read the target's tokenizer (a response_format could
    not be served), or None; TokenizerUnavailable when its files are not on this machine.
    Read once per process and pair (the library indexes the vocabulary: about a second)."""
    tokenizer = prompt_tokenizer(preset, settings)
    return _grammar_problem(preset.target.model_dump_json(), str(settings.data_dir),
                            tokenizer.tokenizer.to_str())


@lru_cache(maxsize=8)
def _grammar_problem(source_json: str, data_dir: str, tokenizer_json: str) -> str | None:
    import llguidance

    try:
        llguidance.LLTokenizer(tokenizer_json)
    except Exception as exc:  # noqa: BLE001 (the library's word on any tokenizer)
        return f"the grammar library cannot read this pair's tokenizer ({exc})"
    return None


def unchecked_note(preset: PairPreset, exc: TokenizerUnavailable) -> str:
    """What a submission says when it cannot check prompt lengths, and how to fix it."""
    return (f"prompt lengths not checked: {exc}; start a worker for pair {preset.name} once "
            f"with this data directory, or run `specq cache-tokenizer --pair {preset.name}`"
            f" (prompts that do not fit fail one by one on the workers)")


@lru_cache(maxsize=8)
def _context(source_json: str, data_dir: str) -> int:
    source = ModelSource.model_validate_json(source_json)
    cached = tokenizer_cache.cache_dir(source, Path(data_dir))
    context = tokenizer_cache.read_context(cached) if tokenizer_cache.is_complete(cached) \
        else None
    if context is not None:
        return context
    where, _ = _local(source, Path(data_dir))
    if source.gguf_file:
        return _gguf_context(where / source.gguf_file)
    return context_length(json.loads(_file(where, "config.json").read_text()))


@lru_cache(maxsize=8)
def _tokenizer(source_json: str, data_dir: str, trust_remote_code: bool) -> PromptTokenizer:
    from tokenizers import Tokenizer

    source = ModelSource.model_validate_json(source_json)
    where = tokenizer_cache.cache_dir(source, Path(data_dir))
    if not all((where / n).is_file() for n in ("tokenizer.json", "tokenizer_config.json")):
        local, kwargs = _local(source, Path(data_dir))
        if source.gguf_file:  # the tokenizer is inside the GGUF file: converted once, kept
            _export(str(local), kwargs, where, trust_remote_code)
        else:
            where = local
    tokenizer = Tokenizer.from_file(str(_file(where, "tokenizer.json")))
    config = json.loads(_file(where, "tokenizer_config.json").read_text())
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    if template is None and (where / "chat_template.jinja").is_file():
        template = (where / "chat_template.jinja").read_text()
    special = {k: v.get("content", "") if isinstance(v, dict) else v
               for k, v in config.items() if k in SPECIAL and v is not None}
    return PromptTokenizer(tokenizer, template, special)


def _local(source: ModelSource, data_dir: Path) -> tuple[Path, dict]:
    """A folder on this machine holding the model's config and tokenizer files (its own
    directory, or the hub's local cache, which is read without asking the hub), and the
    from_pretrained arguments; TokenizerUnavailable when there is none."""
    try:
        where, kwargs = locate(source, data_dir)
    except PairError as exc:  # e.g. the package that ships it is not installed here
        raise TokenizerUnavailable(str(exc)) from None
    if Path(where).is_dir():
        return Path(where), kwargs
    needed = [source.gguf_file] if source.gguf_file else \
        ["config.json", "tokenizer.json", "tokenizer_config.json"]
    snapshot = _hub_cache(where, needed, kwargs.get("revision"))
    if snapshot is None:
        raise TokenizerUnavailable(f"no cached tokenizer for {where} ({_what(source, where)})")
    return snapshot, kwargs


def _what(source: ModelSource, where: str) -> str:
    """What a model without files on this machine is, as a note says it."""
    if source.tiny:
        return "a tiny test model not built on this machine yet: a worker or `specq run` " \
               "of the pair builds it"
    if Path(where).is_absolute() or where.startswith((".", "~")):
        return "a local path that does not exist on this machine"
    return "a hub model not in this machine's hub cache"


def _hub_cache(repo: str, names: list[str], revision: str | None) -> Path | None:
    """The folder of the hub's local cache (HF_HOME) that holds all of ``names`` for
    ``repo``, or None. Reads the disk only."""
    from huggingface_hub import try_to_load_from_cache

    folders = set()
    for name in names:
        try:
            found = try_to_load_from_cache(repo, name, revision=revision)
        except Exception:  # noqa: BLE001 (a name the hub library refuses: not cached)
            return None
        if not isinstance(found, str):
            return None
        folders.add(Path(found).parent)
    return folders.pop() if len(folders) == 1 else None


def _file(where: Path, name: str) -> Path:
    path = where / name
    if not path.is_file():
        raise TokenizerUnavailable(f"{where}: no {name}")
    return path


def cache_from_hub(preset: PairPreset, settings: Settings) -> Path:
    """Fetch the target's tokenizer and context length into the data directory (where
    submissions look: configs/tokenizer_cache.py), from its own files or from the hub:
    `specq cache-tokenizer`, for a submitting machine that shares no data directory
    with a worker. PairError says why not (the hub unreachable, the model missing or
    gated). Returns the folder."""
    source, data_dir = preset.target, Path(settings.data_dir)
    folder = tokenizer_cache.cache_dir(source, data_dir)
    where, kwargs = locate(source, data_dir)
    tmp = folder.with_name(f"{folder.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    if source.gguf_file:  # the tokenizer lives in the GGUF file: transformers converts it
        local = Path(where) if Path(where).is_dir() else \
            _download(where, source.gguf_file, kwargs).parent
        _export(str(local), kwargs, tmp, preset.trust_remote_code, replace=True)
        context = _gguf_context(local / source.gguf_file)
    else:
        for name in ("config.json", "tokenizer.json", "tokenizer_config.json",
                     "chat_template.jinja", "special_tokens_map.json"):
            required = name in tokenizer_cache.NEEDED or name == "config.json"
            path = Path(where) / name if Path(where).is_dir() else \
                _download(where, name, kwargs, required)
            if path is not None and path.is_file():
                shutil.copyfile(path, tmp / name)
            elif required:
                raise PairError(f"{where}: no {name}")
        context = context_length(json.loads((tmp / "config.json").read_text()))
        (tmp / "config.json").unlink()
    tokenizer_cache.write_context(tmp, context, source.label)
    tokenizer_cache.install(tmp, folder)
    _context.cache_clear()
    _tokenizer.cache_clear()
    return folder


@overload
def _download(repo: str, name: str, kwargs: dict, required: Literal[True] = True) -> Path: ...
@overload
def _download(repo: str, name: str, kwargs: dict, required: bool) -> Path | None: ...
def _download(repo: str, name: str, kwargs: dict, required: bool = True) -> Path | None:
    """One file of a hub model (asking the hub: `specq cache-tokenizer` only)."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError

    try:
        return Path(hf_hub_download(repo, name, revision=kwargs.get("revision")))
    except EntryNotFoundError as exc:
        if not required and not isinstance(exc, LocalEntryNotFoundError):
            return None
        raise PairError(hub_problem(exc, repo, name) or str(exc)) from None
    except Exception as exc:  # noqa: BLE001 (the hub's and the network's errors vary)
        problem = hub_problem(exc, repo, name)
        raise PairError(problem or f"{repo}: cannot fetch {name}: {type(exc).__name__}: "
                        f"{exc}") from None


def _gguf_context(path: Path) -> int:
    """The context length a GGUF file's metadata gives ({arch}.context_length), else 2**31.

    Read from the header alone, stopping at the key: gguf's GGUFReader parses every field
    first, a large vocabulary's included (docs/benchmarks.md#2026-12-02-gguf-header-read)."""
    found = _gguf_header(path, lambda key: key == "general.architecture"
                         or key.endswith(".context_length"))
    value = found.get(f"{found.get('general.architecture')}.context_length")
    return int(value) if isinstance(value, int) else 2**31


# GGUF metadata value types: their struct formats (8: string, 9: array)
_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q",
                 11: "q", 12: "d"}


def _gguf_header(path: Path, wanted: Callable[[str], bool]) -> dict[str, Any]:
    """The scalar and string values of the GGUF metadata keys ``wanted`` accepts, read in
    order until the key that ends the search (its architecture's context_length) or the
    end of the metadata; arrays (the vocabulary) are skipped without being decoded.
    TokenizerUnavailable for a file that is not GGUF (v2 or later, little-endian)."""
    def read(fmt: str) -> Any:
        size = struct.calcsize("<" + fmt)
        data = f.read(size)
        if len(data) != size:
            raise TokenizerUnavailable(f"{path}: GGUF metadata cut short")
        return struct.unpack("<" + fmt, data)[0]

    def text() -> str:
        return f.read(read("Q")).decode("utf-8", "replace")

    def skip(kind: int) -> None:
        if kind == 8:
            f.seek(read("Q"), 1)
        elif kind == 9:
            inner, count = read("I"), read("Q")
            if inner in _GGUF_SCALARS:
                f.seek(struct.calcsize("<" + _GGUF_SCALARS[inner]) * count, 1)
            else:
                for _ in range(count):
                    skip(inner)
        elif kind in _GGUF_SCALARS:
            read(_GGUF_SCALARS[kind])
        else:
            raise TokenizerUnavailable(f"{path}: unknown GGUF value type {kind}")

    found: dict[str, Any] = {}
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF" or read("I") not in (2, 3):
            raise TokenizerUnavailable(f"{path}: not a GGUF file (v2 or v3, little-endian)")
        read("Q")  # tensors
        for _ in range(read("Q")):  # metadata keys
            key, kind = text(), read("I")
            if not wanted(key):
                skip(kind)
                continue
            if kind == 8:
                found[key] = text()
            elif kind in _GGUF_SCALARS:
                found[key] = read(_GGUF_SCALARS[kind])
            else:
                skip(kind)
            arch = found.get("general.architecture")
            if arch is not None and f"{arch}.context_length" in found:
                break
    return found


def _export(where: str, kwargs: dict, folder: Path, trust_remote_code: bool,
            replace: bool = False) -> None:
    """Convert a GGUF file's tokenizer to tokenizer.json with transformers, once (into
    ``folder`` itself with ``replace``, else beside it and renamed)."""
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise TokenizerUnavailable(
            f"{where}: the tokenizer lives in a GGUF file; convert it once on a machine with "
            f"the model stack (pip install 'specq[worker]'), or copy {folder} from one"
        ) from None
    log.info("converting the tokenizer of %s %s to %s", where, kwargs.get("gguf_file"), folder)
    tokenizer = AutoTokenizer.from_pretrained(where, trust_remote_code=trust_remote_code,
                                              **kwargs)
    if replace:
        tokenizer.save_pretrained(folder)
        return
    tmp = folder.with_name(f"{folder.name}.{os.getpid()}.tmp")
    tokenizer.save_pretrained(tmp)
    tokenizer_cache.install(tmp, folder)
