"""One model's cache over ragged rows: holes, compaction, refill and removal stay exact."""

import torch

from specq.worker.engine.batch import KVRows, left_pad


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
        start = kv.marker()
        kv.forward(torch.tensor([[15, 99, 98], [23, 24, 25]]), torch.ones(2, 3, dtype=torch.bool))
        kv.keep(start, torch.tensor([1, 3]))
        seqs = [[10, 11, 12, 13, 14, 15], [20, 21, 22, 23, 24, 25]]
        # the packed forward put row 1 right after its prompt; row 0 dropped its last two
        assert kv.waste() == 2 and kv.packed
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


def test_rows_added_empty_then_replaced_match_a_direct_prefill(tiny_models):
    model = tiny_models["target"]
    kv = KVRows(model)
    with torch.inference_mode():
        kv.forward(*left_pad([[10, 11, 12]], 0, "cpu"))
        kv.add_rows(2)  # two rows join with nothing cached yet
        late = KVRows(model)
        late.forward(*left_pad([[20, 21, 22, 23, 24], [30]], 0, "cpu"))
        kv.replace(torch.tensor([1, 2]), late)
        logits = kv.forward(torch.tensor([[13], [25], [31]]), torch.ones(3, 1, dtype=torch.bool))
    for b, seq in enumerate([[10, 11, 12, 13], [20, 21, 22, 23, 24, 25], [30, 31]]):
        assert torch.allclose(logits[b, -1], _alone(model, seq), atol=1e-4), b


def test_a_draft_model_costs_nothing_while_the_engine_does_not_draft(tiny_models,
                                                                      tiny_tokenizer,
                                                                      make_requests,
                                                                      monkeypatch):
    from specq.worker.engine.drafters import DraftModel
    from specq.worker.engine.speculative import SpeculativeEngine

    draft = DraftModel(tiny_models["noisy"])
    calls = []
    forward = KVRows.logits  # every pass of either model, packed or padded, goes here

    def watched(kv, *args, **kwargs):
        if kv.model is draft.model:
            calls.append(1)
        return forward(kv, *args, **kwargs)

    monkeypatch.setattr(KVRows, "logits", watched)
    engine = SpeculativeEngine(tiny_models["target"], tiny_tokenizer, draft,
                               max_batch_size=3, draft_length=0, adaptive=False)  # g = 0
    engine.generate(make_requests(8, seed=11, max_new=10))
    assert not calls  # no row is prefilled in the draft until a proposal needs it
    drafting = SpeculativeEngine(tiny_models["target"], tiny_tokenizer, DraftModel(draft.model),
                                 max_batch_size=3, draft_length=2, adaptive=False)
    drafting.generate(make_requests(2, seed=11, max_new=4))
    assert calls  # the watch sees a draft model that does draft


def test_compaction_counts_the_waste_only_when_it_could_pass_the_bar(tiny_models):
    """Counting the waste is a sync with the device: the cache counts it again only once
    its length could have let the waste reach the bar, and compacts at the very steps it
    would if it counted every time. Transformers' forward, whose passes leave the holes
    (the packed forward writes over a row's dropped columns: test_packed.py)."""
    model = tiny_models["target"]
    lazy, eager = KVRows(model, packed=False), KVRows(model, packed=False)
    counts, compactions = [], 0
    waste = KVRows.waste
    lazy.waste = lambda: counts.append(1) or waste(lazy)
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for kv in (lazy, eager):
            kv.forward(*left_pad([[10, 11, 12], [20, 21]], 0, "cpu"))
        for step in range(120):
            ids = torch.randint(3, 200, (2, 4), generator=gen)
            keep = torch.randint(1, 3, (2,), generator=gen)  # 1 or 2 of 4 columns
            for kv in (lazy, eager):
                start = kv.marker()
                kv.forward(ids, torch.ones(2, 4, dtype=torch.bool))
                kv.keep(start, keep)
            eager._recheck_at = 0  # counts every step
            length = lazy.length
            lazy.compact()
            eager.compact()
            compactions += lazy.length < length
            assert torch.equal(lazy.mask, eager.mask), step
    print(f"{compactions} compactions, waste counted {len(counts)} times in 120 steps")
    assert compactions >= 2 and len(counts) < 120 / 4, (compactions, len(counts))
