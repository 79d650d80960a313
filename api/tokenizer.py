"""The target's tokenizer and context, for checking prompts without the model stack.

A submission tokenizes only the prompts that may not fit (configs/generation.py:
fits_by_size); for those it needs the target's tokenizer. It is read with the
`tokenizers` library from the model's tokenizer.json (a local directory, or the hub), its
chat template from tokenizer_config.json or chat_template.jinja and rendered as
transformers renders it (a sandboxed Jinja2 environment), and the context length from
config.json or a GGUF file's metadata: no torch, no transformers. A model whose tokenizer
lives only inside a GGUF file is converted once with transformers (installed with
specq[worker]) and kept under SPECQ_DATA_DIR/tokenizers for every later submission.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from specq.configs.generation import Request, RequestError, check_length, context_length
from specq.configs.presets import ModelSource, PairError, PairPreset, locate
from specq.configs.settings import Settings

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

    def encode(self, request: Request, context: int) -> list[int]:
        """Token ids of the prompt; RequestError when it cannot fit ``context``."""
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
        try:
            return _compile(self.chat_template).render(
                messages=[m.model_dump() for m in request.messages], tools=None,
                documents=None, add_generation_prompt=True, **self.special)
        except Exception as exc:  # noqa: BLE001 (a model's own Jinja template: anything)
            raise RequestError("messages", f"the model's chat template refused them: "
                               f"{type(exc).__name__}: {exc}") from None


@lru_cache(maxsize=16)
def _compile(template: str) -> Any:
    """A chat template compiled as transformers compiles it."""
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


def target_context(preset: PairPreset, settings: Settings) -> int:
    """The target's context length, from its config (no weights, no tokenizer)."""
    return _context(preset.target.model_dump_json(), str(settings.data_dir))


def prompt_tokenizer(preset: PairPreset, settings: Settings) -> PromptTokenizer:
    """The target's tokenizer, loaded once per process."""
    return _tokenizer(preset.target.model_dump_json(), str(settings.data_dir),
                      preset.trust_remote_code)


@lru_cache(maxsize=8)
def _context(source_json: str, data_dir: str) -> int:
    source = ModelSource.model_validate_json(source_json)
    where, kwargs = locate(source, Path(data_dir))
    if source.gguf_file:
        return _gguf_context(Path(where) / source.gguf_file)
    return context_length(json.loads(_file(where, "config.json", kwargs).read_text()))


@lru_cache(maxsize=8)
def _tokenizer(source_json: str, data_dir: str, trust_remote_code: bool) -> PromptTokenizer:
    from tokenizers import Tokenizer

    source = ModelSource.model_validate_json(source_json)
    where, kwargs = locate(source, Path(data_dir))
    if source.gguf_file:  # the tokenizer is inside the GGUF file: converted once, kept
        folder = Path(data_dir) / "tokenizers" / hashlib.sha1(source_json.encode()).hexdigest()
        if not (folder / "tokenizer.json").exists():
            _export(where, kwargs, folder, trust_remote_code)
        where, kwargs = str(folder), {}
    tokenizer = Tokenizer.from_file(str(_file(where, "tokenizer.json", kwargs)))
    config = json.loads(_file(where, "tokenizer_config.json", kwargs).read_text())
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    if template is None:
        jinja = _file(where, "chat_template.jinja", kwargs, required=False)
        template = jinja.read_text() if jinja else None
    special = {k: v.get("content", "") if isinstance(v, dict) else v
               for k, v in config.items() if k in SPECIAL and v is not None}
    return PromptTokenizer(tokenizer, template, special)


def _file(where: str, name: str, kwargs: dict, required: bool = True) -> Path | None:
    """A file of a model: in its directory, or fetched from the hub (tokenizer and config
    files only: kilobytes)."""
    local = Path(where) / name
    if local.is_file():
        return local
    if Path(where).is_dir():
        if required:
            raise PairError(f"{where}: no {name}")
        return None
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError

    try:
        return Path(hf_hub_download(where, name, revision=kwargs.get("revision")))
    except EntryNotFoundError:
        if required:
            raise PairError(f"{where}: no {name} on the hub") from None
        return None
    except Exception as exc:  # noqa: BLE001 (offline, no such repository, no access)
        raise PairError(f"{where}: cannot fetch {name}: {type(exc).__name__}: {exc}") from None


def _gguf_context(path: Path) -> int:
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    arch = _gguf_value(reader, "general.architecture")
    value = _gguf_value(reader, f"{arch}.context_length")
    return int(value) if value is not None else 2**31


def _gguf_value(reader: Any, key: str) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return None
    part = field.parts[field.data[0]]
    return bytes(part).decode() if field.types and field.types[0].name == "STRING" \
        else part[0]


def _export(where: str, kwargs: dict, folder: Path, trust_remote_code: bool) -> None:
    """Convert a GGUF file's tokenizer to tokenizer.json with transformers, once."""
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise PairError(
            f"{where}: the tokenizer lives in a GGUF file; convert it once on a machine with "
            f"the model stack (pip install 'specq[worker]'), or copy {folder} from one"
        ) from None
    log.info("converting the tokenizer of %s %s to %s", where, kwargs.get("gguf_file"), folder)
    tokenizer = AutoTokenizer.from_pretrained(where, trust_remote_code=trust_remote_code,
                                              **kwargs)
    tmp = folder.with_name(folder.name + ".tmp")
    tokenizer.save_pretrained(tmp)
    tmp.rename(folder)
