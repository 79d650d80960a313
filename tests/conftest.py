"""Shared fixtures: the tiny llama pair, built from fixed seeds and loaded from disk."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from worker.tiny import build_tiny_pair


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    """Directories of the tiny target and its drafts (near, shallow, noisy, unrelated)."""
    return build_tiny_pair(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_dirs):
    return AutoTokenizer.from_pretrained(tiny_dirs["target"])


@pytest.fixture(scope="session")
def tiny_models(tiny_dirs):
    """name -> model loaded through from_pretrained in float32."""
    return {
        name: AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
        for name, d in tiny_dirs.items()
    }
