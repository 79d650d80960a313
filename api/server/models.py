"""Which pair a batch's ``body.model`` names: a preset's name, or its target's model id (a
hub id such as meta-llama/Llama-3.1-8B-Instruct, or a model's label) when exactly one
preset has that target."""

from __future__ import annotations

from specq.configs.presets import PairPreset


class UnknownModel(ValueError):
    """A model no preset serves, or a model id that several presets share."""


def target_ids(preset: PairPreset) -> set[str]:
    """The names of a preset's target model besides the preset's own name."""
    target = preset.target
    ids = {target.label}
    if target.path:
        ids.add(target.path)
    return ids


def resolve(model: str, presets: dict[str, PairPreset]) -> PairPreset:
    if model in presets:
        return presets[model]
    having = sorted(name for name, p in presets.items() if model in target_ids(p))
    if len(having) == 1:
        return presets[having[0]]
    if having:
        raise UnknownModel(f"model {model!r} is the target of several pairs "
                           f"({', '.join(having)}): name one of them")
    raise UnknownModel(f"model {model!r} is not served here; models: {', '.join(sorted(presets))}")
