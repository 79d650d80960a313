"""The packed forward (packed.py) against transformers' own forward, its reference: the same
logits within float tolerance on every preset family it takes, over a prefill, ragged verify
steps, keep and compaction, with the dense work done on the valid tokens only."""

import gc
import weakref

import pytest
import torch
from torch import nn
from transformers import (
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from specq.worker.engine import batch, packed
from specq.worker.engine.batch import KVRows, left_pad

ATOL = 1e-4  # float32 logits: sums in another order, nothing more
SMALL = dict(vocab_size=300, hidden_size=96, intermediate_size=192, num_hidden_layers=3,
             num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=512,
             attn_implementation="sdpa")
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 100000.0, "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}


def _jitter(model, seed: int):
    """Every weight and bias moved off its initial value (biases start at zero), so a
    forward that skipped one would show."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    return model.eval()


def _family(name: str):
    """A tiny model of each family a preset names that the packed forward takes: SmolLM2's
    shape (llama, tied head, GQA), Llama 3's (rope scaling), Qwen2's (q/k/v biases)."""
    torch.manual_seed(0)
    if name == "smollm2":
        cfg = LlamaConfig(**SMALL, tie_word_embeddings=True, rope_theta=100000.0)
        return _jitter(LlamaForCausalLM(cfg), 1)
    if name == "llama3":
        cfg = LlamaConfig(**{**SMALL, "num_key_value_heads": 3}, rope_parameters=LLAMA3_ROPE,
                          tie_word_embeddings=False)
        return _jitter(LlamaForCausalLM(cfg), 2)
    cfg = Qwen2Config(**SMALL, use_sliding_window=False, tie_word_embeddings=False)
    return _jitter(Qwen2ForCausalLM(cfg), 3)


FAMILIES = ["smollm2", "llama3", "qwen2"]


def _verify_step(gen: torch.Generator, B: int, T: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [B, T] and valid [B, T] of a ragged verify step: each row carries its last token
    and 0..T-1 drafts (row 0 none, row 1 all)."""
    ids = torch.randint(3, 290, (B, T), generator=gen)
    carried = torch.randint(1, T + 1, (B,), generator=gen)
    carried[0], carried[1] = 1, T
    valid = torch.arange(T)[None] < carried[:, None]  # [B, T]
    return ids, valid


def _alone(model, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([tokens])).logits[0]  # [len, V]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("per_call", [packed.CALL_COLUMNS, 0])
def test_packed_logits_equal_transformers_forward(family, per_call, monkeypatch):
    """per_call 0: a call costs nothing, so every pass whose rows differ in width is split
    (packed.split): the attention of the narrow width for all rows, then a call per wider
    row."""
    monkeypatch.setattr(packed, "CALL_COLUMNS", per_call)
    plans: list[bool] = []  # per ragged pass: was it split
    cut = packed.split

    def split(extents: list[int], old: int) -> int:
        t = cut(extents, old, per_call)
        plans.append(t < max(extents))
        return t

    monkeypatch.setattr(packed, "split", split)
    model = _family(family)
    fast, ref = KVRows(model), KVRows(model, packed=False)
    assert fast.packed and not ref.packed
    gen = torch.Generator().manual_seed(7)
    prompts = [[5, 6, 7, 8, 9, 10, 11], [20, 21], [30, 31, 32, 33], [40]]
    seqs = [list(p) for p in prompts]
    holes: list[int] = []  # the reference's waste after each step
    with torch.inference_mode():
        ids, valid = left_pad(prompts, 0, "cpu")
        a, b = fast.forward(ids, valid), ref.forward(ids, valid)
        assert torch.allclose(a[valid], b[valid], atol=ATOL)
        for step in range(12):
            ids, valid = _verify_step(gen, len(seqs), 5)
            starts = fast.marker(), ref.marker()
            got, b = fast.logits(ids, valid), ref.forward(ids, valid)  # [N, V], [B, T, V]
            assert torch.allclose(got.values, b[valid], atol=ATOL), step  # only the valid
            a = got.padded()
            assert torch.isfinite(a).all() and (a[~valid] == 0).all()  # never used
            assert torch.equal(got.argmax(), torch.where(valid, a.argmax(-1), 0))
            kept = (torch.rand(len(seqs), generator=gen) * valid.sum(1)).long() + 1  # [B]
            for kv, start in zip((fast, ref), starts):
                kv.keep(start, kept)
            for r, k in enumerate(kept.tolist()):
                seqs[r] += ids[r, :k].tolist()
            if step % 4 == 3:
                fast.compact(force=True)
                ref.compact(force=True)
                assert fast.length == max(map(len, seqs))  # no holes left in either
            assert torch.equal(fast.mask.sum(1), ref.mask.sum(1))
            # the packed rows write over their dropped drafts: once the prompts' padding is
            # compacted away, no holes but the longest row's dropped tail (the next pass
            # writes over it); transformers' forward keeps every pass's widest row
            assert fast.waste() <= 4 or step < 3
            holes.append(ref.waste())
        last = torch.tensor([[50], [51], [52], [53]])
        one = torch.ones(4, 1, dtype=torch.bool)
        a = fast.forward(last, one, last_only=True)  # [B, 1, V]
        b = ref.forward(last, one, last_only=True)
    assert torch.allclose(a, b, atol=ATOL)
    for r, seq in enumerate(seqs):  # and the model alone, on each row's real tokens
        assert torch.allclose(a[r, 0], _alone(model, seq + [50 + r])[-1], atol=ATOL), r
    assert any(plans) == (per_call == 0)  # the tiny model's short rows: split only when free
    assert max(holes[4:]) >= 4


def test_attention_is_split_where_a_few_rows_are_wide():
    """One row of 9 tokens (or of 2) among 15 of 1: the 15 rows' attention stays one token
    wide and the wide row takes a call of its own; rows all as wide, half the rows a token
    wider, or a short cache where a call costs more than the padding it saves, keep one
    padded call (the choices a CPU's passes of 16 rows x 200 columns timed best:
    docs/benchmarks.md, "a split pass's queries gathered")."""
    assert packed.split([9] + [1] * 15, old=200) == 1
    assert packed.split([9, 5, 3, 3, 2, 2, 2, 2] + [1] * 8, old=200) in (1, 2, 3)
    assert packed.split([5] * 16, old=200) == 5
    assert packed.split([2] * 15 + [1], old=200) == 2
    assert packed.split([2] * 8 + [1] * 8, old=200) == 2
    assert packed.split([3] * 8 + [1] * 8, old=200) == 3
    assert packed.split([2] + [1] * 15, old=200) == 1
    assert packed.split([5] * 4 + [1] * 12, old=200) == 1
    assert packed.split([2, 1, 1, 1], old=4) == 2


@pytest.mark.parametrize("family", FAMILIES)
def test_prefix_rows_refills_and_removals_stay_exact_when_packed(family):
    """from_prefix, extend, select and replace act on the buffers the packed forward
    writes: rows that went through them give the logits of their sequences alone."""
    model = _family(family)
    with torch.inference_mode():
        one = KVRows(model)
        one.forward(torch.tensor([[9, 8, 7, 6, 5]]), torch.ones(1, 5, dtype=torch.bool))
        kv = KVRows.from_prefix(model, one.columns(0, 0, 5), [5, 3])
        kv.forward(*left_pad([[60, 61], [62]], 0, "cpu"))
        seqs = [[9, 8, 7, 6, 5, 60, 61], [9, 8, 7, 62]]
        late = KVRows(model)
        late.forward(*left_pad([[70, 71, 72, 73, 74, 75, 76, 77, 78]], 0, "cpu"))
        kv.extend(late)
        seqs.append([70, 71, 72, 73, 74, 75, 76, 77, 78])
        kv.select([2, 0])
        seqs = [seqs[2], seqs[0]]
        ids = torch.tensor([[80, 81, 82], [83, 84, 85]])
        valid = torch.tensor([[True, False, False], [True, True, True]])
        logits = kv.forward(ids, valid)
    assert kv.packed
    assert torch.allclose(logits[0, 0], _alone(model, seqs[0] + [80])[-1], atol=ATOL)
    assert torch.allclose(logits[1], _alone(model, seqs[1] + [83, 84, 85])[-3:], atol=ATOL)


def test_the_dense_parts_see_only_the_tokens_the_rows_carry(monkeypatch):
    """A verify pass where one row carries 5 tokens and three carry 1: the MLPs and the
    head run on 8 tokens, not 4 * 5 (the cost follows what the rows carry)."""
    model = _family("smollm2")
    seen: list[int] = []

    def spy(layer):
        def call(x):
            seen.append(x.shape[:-1].numel())
            return layer(x)
        return call

    kv = KVRows(model)
    forward = kv._packed
    assert forward is not None
    monkeypatch.setattr(forward, "mlps", [spy(forward.mlps[0]), *forward.mlps[1:]])
    monkeypatch.setattr(forward, "head", spy(forward.head))
    with torch.inference_mode():
        kv.forward(*left_pad([[5, 6, 7], [8], [9, 10], [11]], 0, "cpu"))
        seen.clear()
        valid = torch.tensor([[True] * 5] + [[True] + [False] * 4] * 3)  # [4, 5]
        kv.forward(torch.randint(3, 290, (4, 5)), valid)
    assert seen == [8, 8]  # layer 0's MLP, then the head


def test_linear_layers_run_prepacked_on_a_cpu_and_follow_their_weights(monkeypatch):
    """On a CPU each linear layer runs over a copy of its weight reordered for oneDNN: the
    same outputs as the module's (float tolerance, bias included, whatever the rows in the
    call: a row's output does not depend on the others), a weight or bias written in place
    or replaced is read again, and the switch or a library that disagrees keeps the module."""
    torch.manual_seed(0)
    layer = nn.Linear(64, 96)
    fast = packed.prepacked(layer)
    assert fast is not layer
    x = torch.randn(9, 64)
    with torch.inference_mode():
        torch.testing.assert_close(fast(x), layer(x), rtol=1e-4, atol=1e-5)
        assert torch.equal(fast(x[:1]), fast(x)[:1])  # a row alone as in the batch
        torch.testing.assert_close(fast(x[None]), layer(x[None]), rtol=1e-4, atol=1e-5)
        wide = nn.Linear(1536, 64)  # from 1,536 inputs oneDNN's one-row kernel adds in
        fast_wide, y = packed.prepacked(wide), torch.randn(9, 1536)  # another order
        every = fast_wide(y)
        for m in range(1, 10):  # a row alone, in 2D and 3D, as in a batch: bit for bit
            assert torch.equal(fast_wide(y[:m]), every[:m]), m
            assert torch.equal(fast_wide(y[None, 9 - m:]), every[None, 9 - m:]), m
        assert torch.equal(fast_wide(y[0]), every[0])
        torch.testing.assert_close(fast_wide(y[:1]), wide(y[:1]), rtol=1e-4, atol=1e-4)
    with torch.no_grad():
        layer.weight.mul_(2.0)  # in place: its version moves
    with torch.inference_mode():
        torch.testing.assert_close(fast(x), layer(x), rtol=1e-4, atol=1e-5)
    with torch.no_grad():
        layer.bias.add_(1.0)  # the bias too: the copy holds it
    with torch.inference_mode():
        torch.testing.assert_close(fast(x), layer(x), rtol=1e-4, atol=1e-5)
    layer.weight = nn.Parameter(torch.randn(96, 64))  # replaced
    with torch.inference_mode():
        torch.testing.assert_close(fast(x), layer(x), rtol=1e-4, atol=1e-5)
    layer.to(torch.bfloat16)  # the same parameters on other storage: prepacked again where
    with torch.inference_mode():  # oneDNN has bfloat16 kernels, else the module's call
        torch.testing.assert_close(fast(x.bfloat16()), layer(x.bfloat16()), rtol=2e-2,
                                   atol=2e-2)
    layer.to(torch.float32)

    monkeypatch.setenv(packed.LINEAR_ENV, "0")
    assert packed.prepacked(layer) is layer
    monkeypatch.delenv(packed.LINEAR_ENV)
    real = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise",
                        lambda *args: real(*args) + 1.0)  # a library that computes wrong
    assert packed.prepacked(layer) is layer
    monkeypatch.undo()
    model = _family("smollm2")  # and the packed forward holds such layers
    forward = packed.PackedForward(model)
    assert not isinstance(forward.head, nn.Linear)
    assert not isinstance(forward.attention[0].o_proj, nn.Linear)
    # layers that read one input run as one: each output as its module's, biases or none
    a, b = nn.Linear(64, 32), nn.Linear(64, 16, bias=False)
    both = packed.fused(a, b)
    with torch.inference_mode():
        got = both(x)
        assert [t.shape[-1] for t in got] == [32, 16]
        torch.testing.assert_close(got[0], a(x), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(got[1], b(x), rtol=1e-4, atol=1e-5)
    with torch.no_grad():
        b.weight.add_(1.0)  # one of them written: both read again
    with torch.inference_mode():
        torch.testing.assert_close(both(x)[1], b(x), rtol=1e-4, atol=1e-5)


def test_a_model_dropped_takes_its_packed_forward_with_it():
    """The forward made once per model (with its copies of the weights) is kept in a table
    keyed weakly by the model: it holds the model's layers, not the model, so a model
    dropped is collected with its forward and nothing of it stays."""
    gc.collect()  # models earlier tests dropped: gone before the count
    before = len(batch._PACKED)
    model = _family("smollm2")
    kv = KVRows(model)
    assert kv.packed and len(batch._PACKED) == before + 1
    dropped = weakref.ref(model)
    del kv, model
    gc.collect()
    assert dropped() is None and len(batch._PACKED) == before


def test_other_architectures_keep_transformers_forward(monkeypatch):
    torch.manual_seed(0)
    neox = GPTNeoXForCausalLM(GPTNeoXConfig(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=512)).eval()
    windowed = Qwen2ForCausalLM(Qwen2Config(**SMALL, use_sliding_window=True, sliding_window=8,
                                            max_window_layers=0)).eval()
    assert "gpt_neox" in (packed.refusal(neox) or "")
    assert "sliding" in (packed.refusal(windowed) or "")
    assert not KVRows(neox).packed and not KVRows(windowed).packed
    with pytest.raises(ValueError, match="no packed forward"):
        KVRows(neox, packed=True)
    llama = _family("smollm2")
    assert packed.refusal(llama) is None and KVRows(llama).packed
    monkeypatch.setenv(packed.ENV, "0")  # the switch to compare against the padded forward
    assert not KVRows(llama).packed
    assert KVRows(llama, packed=True).packed
