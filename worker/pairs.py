"""Load a target/drafter pair from a preset: local path, hub id, GGUF file or tiny model."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from specq.configs import tokenizer_cache
from specq.configs.hub import hub_problem
from specq.configs.presets import ModelSource, PairError, PairPreset, locate
from specq.configs.settings import Settings, get_settings
from specq.schema.generation import context_length
from specq.worker.engine.drafters import Drafter, DraftModel, NoDraft, PromptLookup
from specq.worker.engine.speculative import SpeculativeEngine
from specq.worker.engine.suffix import SuffixDrafter

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CONVERTED = "converted"  # under the data dir: GGUF checkpoints saved as safetensors, once
FINGERPRINT_BYTES = 1 << 20  # read from each end of a GGUF file to name its conversion


def resolve_device(device: str) -> torch.device:
    """The device SPECQ_DEVICE names; PairError, saying why, when this process cannot use
    it (checked before any weights load, so a worker on the wrong host fails at once)."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    resolved = torch.device(device)
    if resolved.type == "cuda":
        if torch.version.cuda is None and torch.version.hip is None:
            raise PairError(f"SPECQ_DEVICE={device}: this torch ({torch.__version__}) is built "
                            f"without CUDA; install a CUDA build or use SPECQ_DEVICE=cpu")
        count = torch.cuda.device_count()
        if count == 0:
            raise PairError(f"SPECQ_DEVICE={device}: no CUDA device is visible (driver, "
                            f"CUDA_VISIBLE_DEVICES, or the container's GPU reservation)")
        if resolved.index is not None and resolved.index >= count:
            raise PairError(f"SPECQ_DEVICE={device}: only {count} CUDA device(s) visible")
    if resolved.type == "mps" and not torch.backends.mps.is_available():
        raise PairError(f"SPECQ_DEVICE={device}: MPS is not available on this host")
    return resolved


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise PairError(f"dtype: {dtype!r} is not one of auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


@contextmanager
def _gguf_read_once(gguf_file: bool) -> Iterator[None]:
    """While a GGUF file converts: one reader of it for every call, one tensor-name map per
    architecture. transformers reads the whole file three times (for the config, the
    tokenizer and the weights: gguf's reader parses every metadata field, SmolLM2's 49,152
    vocabulary strings among them) and builds gguf's name map once for each of the model's
    ~400 modules: most of SmolLM2's 19 s first load on a 2-core CPU. Both are read-only
    there, and the gguf module's own names come back after."""
    if not gguf_file:
        yield
        return
    import gguf  # installed with the worker (pyproject.toml): transformers reads GGUF with it

    module: Any = gguf  # its names are rebound below, for the conversion's calls
    reader_class, name_map = module.GGUFReader, module.get_tensor_name_map
    readers: dict[tuple[str, str], Any] = {}
    maps: dict[tuple[Any, int], Any] = {}

    def reader(path: Any, mode: str = "r") -> Any:
        key = (os.fspath(path), mode)
        if key not in readers:
            readers[key] = reader_class(path, mode)
        return readers[key]

    def names(arch: Any, n_blocks: int) -> Any:
        if (arch, n_blocks) not in maps:
            maps[arch, n_blocks] = name_map(arch, n_blocks)
        return maps[arch, n_blocks]

    module.GGUFReader, module.get_tensor_name_map = reader, names
    try:
        yield
    finally:
        module.GGUFReader, module.get_tensor_name_map = reader_class, name_map


def load_model(
    source: ModelSource,
    *,
    device: torch.device,
    dtype: torch.dtype,
    data_dir: Path,
    trust_remote_code: bool = False,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    if source.tiny:  # test models: built from fixed seeds on first use
        from specq.worker.tiny import DRAFT_KINDS, build_tiny_pair

        if source.tiny not in ("target", *DRAFT_KINDS):
            raise PairError(f"tiny: unknown model {source.tiny!r}; known: target, "
                            f"{', '.join(DRAFT_KINDS)}")
        build_tiny_pair(data_dir / "tiny")
    where, kwargs = locate(source, data_dir)
    saved = _converted(where, kwargs, dtype, data_dir)
    if saved is not None and (saved / "config.json").is_file():
        where, kwargs = str(saved), {}
    log.info("loading %s %s on %s as %s", where, kwargs.get("gguf_file", ""), device, dtype)
    try:
        with _gguf_read_once(bool(kwargs.get("gguf_file"))):
            tokenizer = AutoTokenizer.from_pretrained(
                where, trust_remote_code=trust_remote_code, **kwargs)
            model = AutoModelForCausalLM.from_pretrained(
                where, dtype=dtype, trust_remote_code=trust_remote_code,
                attn_implementation="sdpa", **kwargs,
            )
    except OSError as exc:  # transformers' wrapping of the hub's and the disk's errors
        problem = hub_problem(exc, where)
        if problem is None:
            raise
        raise PairError(problem) from exc
    if saved is not None and kwargs:
        _save_converted(model, tokenizer, saved)
    model.to(device).eval()
    _check_cache_layout(model, where)
    return model, tokenizer


def _converted(where: str, kwargs: dict, dtype: torch.dtype, data_dir: Path) -> Path | None:
    """Where a local GGUF checkpoint is kept converted, under ``data_dir/converted``; None
    for any other checkpoint.

    transformers parses and de-quantizes a GGUF file on every load, many times slower than
    loading the same weights saved as safetensors
    (docs/benchmarks.md#2026-11-30-gguf-conversion). The folder is named for the file's
    contents (its name, size, first and last FINGERPRINT_BYTES) and the dtype, not for where
    it lies: a new virtual environment's copy of the same package finds the conversion the
    last one made, and a changed file is converted again.
    """
    gguf = Path(where) / kwargs["gguf_file"] if kwargs.get("gguf_file") else None
    if gguf is None or not gguf.is_file():
        return None
    key = f"{gguf.name}|{_fingerprint(gguf)}|{dtype}"
    return data_dir / CONVERTED / f"{gguf.stem}-{hashlib.sha1(key.encode()).hexdigest()[:16]}"


def _fingerprint(path: Path) -> str:
    """The file's size and a hash of its first and last FINGERPRINT_BYTES (a GGUF file's
    header and metadata lead it; a few milliseconds to read, not the whole checkpoint)."""
    size = path.stat().st_size
    digest = hashlib.sha1()
    with path.open("rb") as f:
        digest.update(f.read(FINGERPRINT_BYTES))
        f.seek(max(size - FINGERPRINT_BYTES, 0))
        digest.update(f.read(FINGERPRINT_BYTES))
    return f"{size}-{digest.hexdigest()}"


def _save_converted(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
                    folder: Path) -> None:
    """Save a model loaded from a GGUF file, once de-quantized (weights left in GGUF blocks
    for a device kernel stay in the file). Written aside and renamed, so that a worker
    never reads half a folder; workers starting together may each convert, the first
    rename wins."""
    quantizer = getattr(model, "hf_quantizer", None)
    if not all(t.is_floating_point() for t in [*model.parameters(), *model.buffers()]):
        log.info("%s: weights stay quantized on this device; not converting", folder.name)
        return
    if quantizer is not None:
        quantizer.remove_quantization_config(model)  # plain float weights now
    tmp = folder.with_name(f"{folder.name}.{os.getpid()}.tmp")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    try:
        tmp.rename(folder)
        log.info("converted to %s: later loads read it", folder)
    except OSError:  # another worker's conversion came first
        shutil.rmtree(tmp, ignore_errors=True)


def _check_cache_layout(model: PreTrainedModel, where: str) -> None:
    """The engine's cache layout needs full attention (no sliding windows)."""
    cfg = model.config.get_text_config()
    sliding = getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True)
    layer_types = getattr(cfg, "layer_types", None) or []
    if sliding or any("sliding" in t for t in layer_types):
        raise PairError(f"{where}: sliding-window attention is not supported by the engine")


def check_vocab(target_tok: PreTrainedTokenizerBase, draft_tok: PreTrainedTokenizerBase) -> None:
    """A draft must share the target's tokenizer, token for token."""
    if len(target_tok) != len(draft_tok) or target_tok.get_vocab() != draft_tok.get_vocab():
        raise PairError(
            f"draft vocabulary ({len(draft_tok)} tokens) does not match the target's "
            f"({len(target_tok)} tokens); a draft model must use the target's tokenizer"
        )


@dataclass
class Pair:
    """A loaded target with its tokenizer and drafter, ready to build engines."""

    preset: PairPreset
    target: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    drafter: Drafter

    def engine(self, max_batch_size: int | None = None, draft_length: int | None = None,
               grammar_drafts: bool | None = None) -> SpeculativeEngine:
        """An engine over this pair; a given ``draft_length`` pins g (else the preset's
        draft_length starts, and adapts unless the preset says ``adaptive: false``).
        Shaped rows draft their grammar's forced tokens unless the drafter is none or the
        preset says ``grammar_drafts: false`` (a given ``grammar_drafts`` decides alone)."""
        bs = max_batch_size or self.preset.max_batch_size or get_settings().max_batch_size
        g = self.preset.draft_length if draft_length is None else draft_length
        if grammar_drafts is None and not self.preset.grammar_drafts:
            grammar_drafts = False
        return SpeculativeEngine(
            self.target, self.tokenizer, self.drafter, max_batch_size=bs, draft_length=g,
            adaptive=self.preset.adaptive and draft_length is None,
            grammar_drafts=grammar_drafts,
        )


def load_pair(preset: PairPreset, settings: Settings | None = None) -> Pair:
    """Load the preset's models once; raises PairError for a pair that cannot work."""
    settings = settings or get_settings()
    device = resolve_device(settings.device)
    dtype = resolve_dtype(preset.dtype or settings.dtype, device)
    common: dict[str, Any] = dict(device=device, dtype=dtype, data_dir=settings.data_dir,
                  trust_remote_code=preset.trust_remote_code)
    target, tokenizer = load_model(preset.target, **common)
    drafter: Drafter
    if preset.drafter == "model":
        assert preset.draft is not None  # the preset's check
        draft, draft_tok = load_model(preset.draft, **common)
        check_vocab(tokenizer, draft_tok)
        drafter = DraftModel(draft, pad_id=_pad_id(tokenizer), vocab_size=_vocab(target))
    elif preset.drafter == "prompt_lookup":
        drafter = PromptLookup()
    elif preset.drafter == "suffix":
        drafter = SuffixDrafter()
    else:
        drafter = NoDraft()
    return Pair(preset, target, tokenizer, drafter)


def cache_tokenizer(pair: Pair, data_dir: Path) -> Path:
    """Write the target's tokenizer and context length where submitters look for them
    (configs/tokenizer_cache.py), so that submitting needs neither the model stack nor the
    hub. Returns the folder."""
    folder = tokenizer_cache.cache_dir(pair.preset.target, data_dir)
    tmp = folder.with_name(f"{folder.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    pair.tokenizer.save_pretrained(tmp)
    tokenizer_cache.write_context(tmp, context_length(pair.target.config.to_dict()),
                                  pair.preset.target.label)
    tokenizer_cache.install(tmp, folder)
    return folder


def _pad_id(tokenizer: PreTrainedTokenizerBase) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0


def _vocab(model: PreTrainedModel) -> int:
    return model.get_output_embeddings().weight.shape[0]
