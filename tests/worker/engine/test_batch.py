"""One model's cache over ragged rows: holes, compaction, refill and removal stay exact."""

import torch

from worker.engine.batch import KVRows, left_pad


def _alone(model, tokens):
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0, -1]


def test_holes_compaction_extend_and_select_keep_logits_exact(tiny_models):
    model = tiny_models["target"]
    kv = KVRows(model)
    rows = [[10, 11, 12, 13, 14], [20, 21, 22]]
    with torch.inference_mode():
        kv.forward(*left_pad(rows, 0, "cpu"))
        # a draft step: row 0 keeps 1 of 3 new columns, row 1 keeps all 3
        kv.forward(torch.tensor([[15, 99, 98], [23, 24, 25]]), torch.ones(2, 3, dtype=torch.bool))
        kv.keep(kv.length - 3, torch.tensor([1, 3]))
        seqs = [[10, 11, 12, 13, 14, 15], [20, 21, 22, 23, 24, 25]]
        assert kv.waste() == 2
        kv.compact(force=True)
        assert kv.waste() == 0 and kv.length == 6
        # refill: a new, longer row joins; then the first row leaves
        new = KVRows(model)
        new.forward(*left_pad([[30, 31, 32, 33, 34, 35, 36, 37]], 0, "cpu"))
        kv.extend(new)
        seqs.append([30, 31, 32, 33, 34, 35, 36, 37])
        kv.select(torch.tensor([2, 1]))
        seqs = [seqs[2], seqs[1]]
        logits = kv.forward(torch.tensor([[40], [41]]), torch.ones(2, 1, dtype=torch.bool))
    for b, seq in enumerate(seqs):
        want = _alone(model, seq + [[40], [41]][b])
        assert torch.allclose(logits[b, -1], want, atol=1e-4), b
