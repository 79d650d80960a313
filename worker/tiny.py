"""Tiny llama-architecture models with a byte-level tokenizer, built from fixed seeds.

They stand in for a real target/draft pair where no weights can be downloaded (tests, CI,
the `tiny` preset). Every model is saved with `save_pretrained` and loaded back through
`from_pretrained`, the same path a real checkpoint takes.

Drafts built from the target:
- ``near``: target weights plus small noise; agrees almost always.
- ``shallow``: the target's embeddings, first layer and head; cheaper, agrees often.
- ``noisy``: target weights plus large noise; agrees sometimes.
- ``unrelated``: another seed; agrees by chance.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

log = logging.getLogger(__name__)

SPECIALS = ["<pad>", "<s>", "</s>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant: {% endif %}"
)
DRAFT_KINDS = ("near", "shallow", "noisy", "unrelated")


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer: 256 byte tokens and three specials, any text round-trips."""
    byte_vocab = pre_tokenizers.ByteLevel.alphabet()
    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for ch in sorted(byte_vocab):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>"
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _config(vocab_size: int, layers: int, **over) -> LlamaConfig:
    cfg: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.15,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        attn_implementation="sdpa",
    )
    cfg.update(over)
    return LlamaConfig(**cfg)


def build_target(vocab_size: int, seed: int = 0, layers: int = 4) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(_config(vocab_size, layers)).eval()


def build_draft(target: LlamaForCausalLM, kind: str, seed: int = 1) -> LlamaForCausalLM:
    """A draft for ``target``; see the module docstring for the kinds."""
    gen = torch.Generator().manual_seed(seed)
    cfg = target.config
    if kind == "unrelated":
        return build_target(cfg.vocab_size, seed=seed, layers=2)
    if kind == "shallow":
        draft = LlamaForCausalLM(_config(cfg.vocab_size, 1)).eval()
        own = target.state_dict()
        draft.load_state_dict({k: v for k, v in own.items() if k in draft.state_dict()})
        return draft
    scale = {"near": 0.002, "noisy": 0.05}[kind]
    draft = LlamaForCausalLM(_config(cfg.vocab_size, cfg.num_hidden_layers)).eval()
    with torch.no_grad():
        for p, q in zip(draft.parameters(), target.parameters()):
            noise = torch.randn(q.shape, generator=gen) * q.std().clamp_min(1e-3) * scale
            p.copy_(q + noise)
    return draft


def build_tiny_pair(root: Path | str, kinds: tuple[str, ...] = DRAFT_KINDS) -> dict[str, Path]:
    """Save the tiny target and its drafts under ``root``; returns name -> directory.

    Idempotent: a directory that already holds a model is reused.
    """
    root = Path(root)
    tokenizer = build_tokenizer()
    out = {"target": root / "target", **{k: root / f"draft-{k}" for k in kinds}}
    if all((d / "config.json").exists() for d in out.values()):
        return out
    target = build_target(len(tokenizer))
    models_ = {"target": target, **{k: build_draft(target, k) for k in kinds}}
    for name, model in models_.items():
        d = out[name]
        d.mkdir(parents=True, exist_ok=True)
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        model.save_pretrained(d)
        tokenizer.save_pretrained(d)
    log.info("built tiny pair under %s", root)
    return out
