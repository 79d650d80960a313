"""Loading pairs from presets, and the pairs that are refused."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from specq.configs.presets import ModelSource, PairPreset, UnknownPair, get_preset, load_presets
from specq.configs.settings import Settings
from specq.schema.generation import Request
from specq.worker.engine.drafters import DraftModel, PromptLookup
from specq.worker.pairs import PairError, load_pair, resolve_dtype
from specq.worker.tiny import build_tokenizer


def test_builtin_presets_validate():
    presets = load_presets()
    assert {"tiny", "smollm2-135m", "pythia-1.4b", "llama-3.1-8b", "qwen2.5-7b"} <= set(presets)
    assert presets["smollm2-135m"].drafter == "prompt_lookup"
    assert not any(p.trust_remote_code for p in presets.values())


def test_unknown_pair_names_the_known_ones():
    with pytest.raises(UnknownPair, match="unknown pair 'nope'.*tiny"):
        get_preset("nope")


def test_tiny_pair_loads_from_disk_and_generates(tmp_path):
    pair = load_pair(get_preset("tiny"), Settings(data_dir=tmp_path, device="cpu"))
    assert isinstance(pair.drafter, DraftModel)
    assert pair.target.dtype == torch.float32 and (tmp_path / "tiny" / "target").is_dir()
    (res,) = pair.engine(max_batch_size=2).generate([Request(prompt="abc", max_new_tokens=6)])
    assert len(res.token_ids) >= 1 and res.counters.target_passes >= 1
    lookup = load_pair(get_preset("tiny-lookup"), Settings(data_dir=tmp_path))
    assert isinstance(lookup.drafter, PromptLookup)
    assert pair.engine().policy.adapts and pair.engine().policy.default == 4
    pinned = pair.engine(draft_length=3).policy
    assert not pinned.adapts and pinned.default == 3
    pair.preset = pair.preset.model_copy(update={"adaptive": False})
    assert not pair.engine().policy.adapts


def test_draft_with_another_vocabulary_is_refused(tmp_path, tiny_dirs):
    tok = build_tokenizer()
    tok.add_tokens([f"<extra{i}>" for i in range(5)])
    model = AutoModelForCausalLM.from_pretrained(tiny_dirs["unrelated"])
    model.resize_token_embeddings(len(tok))
    model.save_pretrained(tmp_path / "other")
    tok.save_pretrained(tmp_path / "other")
    preset = PairPreset(name="mismatch", target=ModelSource(path=str(tiny_dirs["target"])),
                        draft=ModelSource(path=str(tmp_path / "other")), drafter="model")
    sizes = r"draft vocabulary \(264 tokens\).*target.s \(259 tokens\)"
    with pytest.raises(PairError, match=sizes):
        load_pair(preset, Settings(data_dir=tmp_path))


def test_bad_presets_and_settings():
    with pytest.raises(ValueError, match="needs a draft"):
        PairPreset(name="x", target=ModelSource(path="a"), drafter="model")
    with pytest.raises(ValueError, match="exactly one of path, package, tiny"):
        ModelSource(path="a", tiny="target")
    with pytest.raises(PairError, match="dtype"):
        resolve_dtype("float8", torch.device("cpu"))
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    missing = PairPreset(name="m", target=ModelSource(package="no-such-dist", gguf_file="x.gguf"),
                         drafter="none")
    with pytest.raises(PairError, match="no-such-dist.*not installed"):
        load_pair(missing)
