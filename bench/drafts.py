"""Draft models built from the target itself, for pairs that have no pretrained draft.

``shallow_draft(target, k)`` is a self-speculative, early-exit draft: the target's own
token embeddings, its first ``k`` decoder layers, its final norm and its lm_head, run as
a model of their own. No weight is copied or trained: the draft's modules *are* the
target's modules, so it costs no memory beyond its own KV cache, and its cost per token
is roughly (k layers + embeddings + head) / (all layers + embeddings + head) of a target
step. It agrees with the target where the first k layers already decide the next token
(copying, formatting, function words) and less elsewhere; the bench measures both its
acceptance and its cost (`specq bench --draft shallow:K`).

The draft's cache holds k layers; attention layer ``i < k`` of the target has
``layer_idx == i``, so it indexes the draft's own cache correctly.

``skip_draft(target, keep)`` is the layer-skipping variant (self-speculative decoding,
Zhang et al. 2023, arXiv 2309.08168): any subset of the layers, typically the first and
the last few, which keeps the layers that map hidden states to the output vocabulary.
Its decoder layers are new shells numbered 0..len(keep)-1 (so their ``layer_idx``
indexes the draft's own cache) whose submodules are the target's.
"""

from __future__ import annotations

import copy
import logging

import torch
from torch import nn
from transformers import PreTrainedModel

log = logging.getLogger(__name__)


class DraftBuildError(ValueError):
    """The target's architecture has no layout a shallow draft can be cut from."""


def _skeleton(target: PreTrainedModel, num_layers: int) -> PreTrainedModel:
    """A meta-device model of the target's class with ``num_layers`` layers, whose
    embeddings, final norm, rotary embedding and head are already the target's."""
    inner = getattr(target, "model", None)
    needed = ("embed_tokens", "layers", "norm")
    if inner is None or not all(hasattr(inner, n) for n in needed) or not hasattr(
        target, "lm_head"
    ):
        raise DraftBuildError(
            f"{type(target).__name__}: a shallow draft needs model.embed_tokens, "
            "model.layers, model.norm and lm_head (a llama-family causal LM)"
        )
    cfg = copy.deepcopy(target.config)
    cfg.num_hidden_layers = num_layers
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = list(cfg.layer_types[:num_layers])
    with torch.device("meta"):  # a skeleton: every module below is replaced by the target's
        draft = type(target)(cfg)
    draft.model.embed_tokens = inner.embed_tokens
    draft.model.norm = inner.norm
    if hasattr(inner, "rotary_emb"):
        draft.model.rotary_emb = inner.rotary_emb
    draft.lm_head = target.lm_head
    return draft


def _finish(draft: PreTrainedModel, target: PreTrainedModel) -> PreTrainedModel:
    left = [n for n, t in [*draft.named_parameters(), *draft.named_buffers()] if t.is_meta]
    if left:
        raise DraftBuildError(f"{type(target).__name__}: modules not shared: {left[:4]}")
    for i, layer in enumerate(draft.model.layers):
        idx = getattr(getattr(layer, "self_attn", None), "layer_idx", i)
        if idx != i:
            raise DraftBuildError(f"layer {i} has attention layer_idx {idx}")
    draft.generation_config = copy.deepcopy(target.generation_config)
    return draft.eval()


def skip_draft(target: PreTrainedModel, keep: list[int]) -> PreTrainedModel:
    """A draft running only the target's layers ``keep`` (sorted, distinct), sharing
    every weight; see the module docstring."""
    keep = sorted(set(keep))
    total = len(getattr(getattr(target, "model", None), "layers", []))
    if not keep or keep[0] < 0 or keep[-1] >= total or len(keep) == total:
        raise DraftBuildError(f"keep: {keep} is not a proper subset of the {total} layers")
    draft = _skeleton(target, len(keep))
    for shell, j in zip(draft.model.layers, keep):
        src = target.model.layers[j]
        for name, child in src.named_children():
            if name == "self_attn":  # the shell keeps its own layer_idx
                for sub, module in child.named_children():
                    setattr(shell.self_attn, sub, module)
            else:
                setattr(shell, name, child)
    log.info("skip draft: layers %s of %d of %s", keep, total, type(target).__name__)
    return _finish(draft, target)


def shallow_draft(target: PreTrainedModel, num_layers: int) -> PreTrainedModel:
    """A model of the target's class made of the target's embeddings, first
    ``num_layers`` decoder layers, final norm and lm_head (shared modules, no copies).

    Works for llama-family causal LMs (``model.embed_tokens``, ``model.layers``,
    ``model.norm``, ``model.rotary_emb``, ``lm_head``): Llama, Mistral, Qwen2, SmolLM...
    """
    total = len(getattr(getattr(target, "model", None), "layers", []))
    if not 1 <= num_layers < total:
        raise DraftBuildError(f"num_layers: {num_layers}, the target has {total} layers")
    draft = _skeleton(target, num_layers)
    draft.model.layers = nn.ModuleList(target.model.layers[:num_layers])
    _finish(draft, target)
    log.info("shallow draft: %d of %d layers of %s", num_layers, total, type(target).__name__)
    return draft
