"""The pair `specq bench gpu` builds on the machine it runs on, from this repository alone.

No hub, no weights carried: the target has Llama-3.2-1B's architecture (its config.json,
architecture fields only, is ``llama-3.2-1b.json`` beside this file) with random weights
drawn from a fixed seed, and a tokenizer of the same size built here (``build_tokenizer``).
Smaller sizes (``SIZES``) shrink the same config for a CPU.

The draft is the target's own first ``draft_layers`` layers with the shared embeddings,
final norm and head (bench/drafts.py ``shallow_draft``): no weight of its own, cheap,
deterministic. A random network's later layers would each move the next token as much as
the first ones, so a shallow draft would agree by chance only; a trained model's later
layers refine what the first ones decided (why early exit works). The target is built that
way: the output projections (attention o_proj, MLP down_proj) of every layer past the
draft's are scaled by ``late_scale``. The shape, and so every pass's cost, is the real
model's; only how often the draft is right is set by that one number.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel, PreTrainedTokenizerFast

from specq.bench.drafts import shallow_draft

CONFIG = Path(__file__).with_name("llama-3.2-1b.json")
SEED = 36
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}"
    "<|end_header_id|>\n\n{{ m['content'] }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n"
    "{% endif %}"
)
# Llama 3's first specials (its remaining ones are reserved tokens)
SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|finetune_right_pad_id|>",
            "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
# characters whose pairs and triples make the merged tokens: ordinary text and JSON
_COMMON = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
              ".,:;!?\"'(){}[]-_/")
_SPACE, _NEWLINE = "\u0120", "\u010a"  # ByteLevel's space and newline


@dataclass(frozen=True)
class Size:
    """One size of the check: the model and how much each part runs."""

    name: str
    config: dict[str, Any]  # over llama-3.2-1b.json
    specials: int  # the vocabulary's last ``specials`` ids are special tokens
    draft_layers: int
    late_scale: float
    lossless_batches: tuple[int, ...]
    lossless_prompts: dict[int, int]  # prompts run at each lossless batch size
    lossless_new: int
    throughput_batches: tuple[int, ...]
    throughput_prompts: dict[int, int]
    throughput_new: int
    g: int  # the fixed draft length, and the width of the measured verify pass
    pass_context: int  # columns the measured passes attend to
    dtypes: tuple[str, ...] = ("float32", "bfloat16")
    max_g: int = 8
    oom_base: int = 16  # a batch that fits (gpu_device.oom_halving) ...
    oom_factor: int = 16  # ... and the oversized batch, in multiples of it
    extra: dict[str, Any] = field(default_factory=dict)


SIZES = {
    "tiny": Size(
        "tiny",
        dict(vocab_size=640, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             initializer_range=0.1),
        specials=16, draft_layers=1, late_scale=0.15,
        lossless_batches=(1, 8), lossless_prompts={1: 4, 8: 12}, lossless_new=16,
        throughput_batches=(1, 4), throughput_prompts={1: 2, 4: 4}, throughput_new=12,
        g=3, pass_context=32, oom_base=2, oom_factor=4),
    "medium": Size(
        "medium",
        dict(vocab_size=16384, hidden_size=512, intermediate_size=2048, num_hidden_layers=8,
             num_attention_heads=8, num_key_value_heads=2, head_dim=64),
        specials=64, draft_layers=2, late_scale=0.15,
        lossless_batches=(1, 8, 16), lossless_prompts={1: 4, 8: 16, 16: 16}, lossless_new=32,
        throughput_batches=(1, 8, 16), throughput_prompts={1: 4, 8: 16, 16: 16},
        throughput_new=32, g=4, pass_context=128),
    "full": Size(
        "full", {}, specials=256, draft_layers=4, late_scale=0.15,
        lossless_batches=(1, 8, 64), lossless_prompts={1: 4, 8: 32, 64: 64}, lossless_new=48,
        throughput_batches=(1, 8, 64, 256),
        throughput_prompts={1: 4, 8: 16, 64: 64, 256: 256}, throughput_new=64,
        g=4, pass_context=256),
}


def llama_config(size: Size) -> LlamaConfig:
    """Llama-3.2-1B's config with the size's changes; the specials are the last ids."""
    cfg = json.loads(CONFIG.read_text())
    cfg.pop("_comment", None)
    cfg.update(size.config)
    first = cfg["vocab_size"] - size.specials
    cfg.update(bos_token_id=first, eos_token_id=first + 1, pad_token_id=first + 2,
               attn_implementation="sdpa")
    return LlamaConfig(**cfg)


def build_tokenizer(vocab_size: int, specials: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE of exactly ``vocab_size`` ids laid out as Llama 3's: the 256 bytes,
    merged tokens (pairs, then triples, of ordinary characters and a leading space), then
    ``specials`` special tokens. Any text round-trips; the merges are a fixed list, so the
    tokenizer is the same on every machine."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    common = sorted(c for c in alphabet if c in _COMMON) + [_SPACE, _NEWLINE]
    merges: list[tuple[str, str]] = []
    room = vocab_size - specials
    pairs = [a + b for a in common for b in common]
    for left, rights in ((None, pairs), *((p, common) for p in pairs)):
        for right in rights:
            if len(vocab) >= room:
                break
            a, b = (right[0], right[1]) if left is None else (left, right)
            if a + b not in vocab:
                vocab[a + b] = len(vocab)
                merges.append((a, b))
        if len(vocab) >= room:
            break
    names = SPECIALS + [f"<|reserved_special_token_{i}|>"
                        for i in range(specials - len(SPECIALS))]
    for name in names[:specials]:
        vocab[name] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=names[0], eos_token=names[1], pad_token=names[2],
        additional_special_tokens=names[3:specials])
    fast.chat_template = CHAT_TEMPLATE
    return fast


@torch.no_grad()
def build_target(size: Size, device: torch.device) -> LlamaForCausalLM:
    """The target in float32 on ``device``, its weights drawn there from SEED."""
    torch.manual_seed(SEED)
    with torch.device(device):
        model = LlamaForCausalLM(llama_config(size))
    for layer in model.model.layers[size.draft_layers:]:
        layer.self_attn.o_proj.weight.mul_(size.late_scale)
        layer.mlp.down_proj.weight.mul_(size.late_scale)
    cfg = model.config
    model.generation_config.update(bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id,
                                   pad_token_id=cfg.pad_token_id)
    return model.eval()


def build_draft(target: PreTrainedModel, size: Size) -> PreTrainedModel:
    """The target's first draft_layers layers, sharing its modules (in its dtype)."""
    return shallow_draft(target, size.draft_layers)


def to_dtype(target: PreTrainedModel, dtype: torch.dtype) -> None:
    """Convert the weights in place; the rotary embedding's frequencies stay float32, as
    `from_pretrained(dtype=...)` leaves them (converted, long positions lose their angles)."""
    rotary = getattr(getattr(target, "model", None), "rotary_emb", None)
    kept = {n: b.clone() for n, b in rotary.named_buffers()} if rotary is not None else {}
    cast(torch.nn.Module, target).to(dtype)
    for name, buf in kept.items():
        setattr(rotary, name, buf)
