"""The cache's buffers: written in place, grown by doubling, compacted and reordered within
themselves, for every model family a preset may load."""

import pytest
import torch
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM, Qwen2Config, Qwen2ForCausalLM

from specq.worker.engine.batch import MIN_COLUMNS, KVRows, fill_holes, left_pad

SMALL = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, max_position_embeddings=512)


def _family(name, tiny_models):
    """A small causal LM of each architecture the presets name (llama, gpt-neox, qwen2)."""
    torch.manual_seed(0)
    if name == "llama":
        return tiny_models["target"]
    if name == "gpt-neox":
        cfg = GPTNeoXConfig(**SMALL, attn_implementation="sdpa")
        return GPTNeoXForCausalLM(cfg).eval()
    cfg = Qwen2Config(**SMALL, num_key_value_heads=2, use_sliding_window=False,
                      attn_implementation="sdpa")
    return Qwen2ForCausalLM(cfg).eval()


def _alone(model, tokens):
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0, -1]


def _pointers(kv):
    return [layer.keys.data_ptr() for layer in kv.cache.layers]


@pytest.mark.parametrize("family", ["llama", "gpt-neox", "qwen2"])
def test_columns_are_written_in_place_and_the_buffers_double(family, tiny_models):
    model = _family(family, tiny_models)
    kv = KVRows(model)
    seqs = [[10, 11, 12, 13, 14], [20, 21, 22]]
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        kv.forward(*left_pad(seqs, 0, "cpu"))
        seqs = [[0, 0] + seqs[0], [0, 0, 0, 0] + seqs[1]]  # the padding, to count columns
        ptrs, capacity = _pointers(kv), kv.cache.layers[0].keys.shape[2]
        assert capacity == MIN_COLUMNS
        grew = []
        for _ in range(70):  # past the first capacity
            ids = torch.randint(3, 250, (2, 1), generator=gen)
            kv.forward(ids, torch.ones(2, 1, dtype=torch.bool))
            for b in range(2):
                seqs[b].append(int(ids[b, 0]))
            if _pointers(kv) != ptrs:
                grew.append((kv.length, kv.cache.layers[0].keys.shape[2]))
                ptrs = _pointers(kv)
        # one reallocation, when the 65th column came, to twice the columns
        assert grew == [(MIN_COLUMNS + 1, 2 * MIN_COLUMNS)]
        kv.keep(kv.length - 30, torch.tensor([10, 30]))  # row 0 drops 20 columns
        kv.compact(force=True)
        assert _pointers(kv) == ptrs and kv.waste() == 0  # compacted within the buffers
        logits = kv.forward(torch.tensor([[40], [41]]), torch.ones(2, 1, dtype=torch.bool))
    real = [[t for t in s if t] for s in seqs]
    real[0] = real[0][: len(real[0]) - 20]
    for b, seq in enumerate(real):
        assert torch.allclose(logits[b, -1], _alone(model, seq + [40 + b]), atol=1e-4), b


def test_leaving_rows_are_filled_from_the_end():
    assert fill_holes([False, True, False, False, True, False]) == [0, 5, 2, 3]
    assert fill_holes([True, False, False]) == [2, 1]
    assert fill_holes([False, False, True]) == [0, 1]
    assert fill_holes([True, True]) == []


def test_select_copies_only_the_rows_that_move(tiny_models):
    model = tiny_models["target"]
    kv = KVRows(model)
    seqs = [[10 + b, 11, 12 + b] for b in range(5)]
    with torch.inference_mode():
        kv.forward(*left_pad(seqs, 0, "cpu"))
        before = [layer.keys[:5, :, :3].clone() for layer in kv.cache.layers]
        keep = fill_holes([True, False, False, True, False])  # rows 0 and 3 leave
        assert keep == [4, 1, 2]
        kv.select(torch.tensor(keep))
        for layer, old in zip(kv.cache.layers, before):
            assert torch.equal(layer.keys[:3, :, :3], old[keep])
            assert torch.equal(layer.keys[3:5, :, :3], old[3:5])  # left as they were
        logits = kv.forward(torch.tensor([[40], [41], [42]]), torch.ones(3, 1, dtype=torch.bool))
    for b, row in enumerate(keep):
        assert torch.allclose(logits[b, -1], _alone(model, seqs[row] + [40 + b]), atol=1e-4)
