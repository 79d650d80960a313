"""A shared prompt prefix prefilled once: same cache, same logits, same greedy output."""

import pytest
import torch

from specq.schema.generation import Request
from specq.worker.engine.drafters import DraftModel, NoDraft
from specq.worker.engine.prefix import (
    MIN_PREFIX,
    Prefix,
    PrefixStore,
    _groups,
    common_length,
    prefill,
)
from specq.worker.engine.speculative import SpeculativeEngine


def _prompts(seed: int, shared: int, n: int, plain: int) -> list[list[int]]:
    """n prompts that start with the same `shared` tokens and `plain` that do not."""
    gen = torch.Generator().manual_seed(seed)
    head = torch.randint(3, 259, (shared,), generator=gen).tolist()
    out = []
    for i in range(n + plain):
        tail = torch.randint(3, 259, (int(torch.randint(1, 12, (1,), generator=gen)),),
                             generator=gen).tolist()
        out.append(head + tail if i < n else tail + head[: MIN_PREFIX + i])
    return out


def test_groups_are_runs_that_share_enough():
    a = list(range(3, 3 + MIN_PREFIX + 4))
    prompts = [a + [1], [9] * 30, a + [2, 2], a[:MIN_PREFIX] + [7, 7], [5, 6]]
    assert _groups(prompts) == [([3, 0, 2], MIN_PREFIX)]  # in sorted order
    assert _groups([a, a]) == [([0, 1], len(a) - 1)]  # the last token's logits are needed
    assert _groups([[5, 6]]) == []
    assert _groups([]) == []
    # prompts nested a token deeper each (a one-token job's admission holds thousands of
    # rows): planned without a frame a level
    head = list(range(1000, 3000))
    nested = [head[:k] + [1, k] for k in range(MIN_PREFIX, 1600)]
    for rows, n in _groups(nested):
        assert len(rows) > 1 and n >= MIN_PREFIX
        assert all(nested[i][:n] == nested[rows[0]][:n] and len(nested[i]) > n for i in rows)
    assert common_length([1, 2, 3], [1, 2, 4]) == 2


def test_the_store_serves_the_longest_share_and_forgets_the_least_recent():
    store = PrefixStore(max_tokens=100, max_entries=2)
    a, b = Prefix(tuple(range(40)), []), Prefix(tuple(range(30)) + (99,) * 20, [])
    store.add(a)
    store.add(b)
    assert store.match(list(range(20)))[1] == 19  # all but the prompt's last token
    assert store.match(list(range(35)) + [1])[1] == 35
    assert store.match(list(range(50)))[0] is a  # a is now the most recent
    store.add(Prefix(tuple(range(100, 130)), []))
    assert list(store.entries) == [a.tokens, tuple(range(100, 130))]  # b was least recent
    store.add(Prefix(tuple(range(200, 301)), []))  # over max_tokens alone: not kept
    assert len(store.entries) == 2


def test_prefilled_rows_match_a_plain_prefill(tiny_models):
    """Rows that take a shared prefix's columns hold what a plain prefill computes: the
    same last logits, and the same logits for the next token."""
    model = tiny_models["target"]
    prompts = _prompts(0, shared=24, n=4, plain=2)
    store = PrefixStore()
    plain_kv, plain_logits = prefill(model, prompts, 0, None)
    with torch.inference_mode():
        for rnd in range(2):  # the second round takes every prefix from the store
            kv, logits = prefill(model, prompts, 0, store)
            assert torch.allclose(logits, plain_logits, atol=1e-4), rnd
            nxt = torch.arange(10, 10 + len(prompts))[:, None]
            one = torch.ones(len(prompts), 1, dtype=torch.bool)
            start = plain_kv.marker()
            assert torch.allclose(kv.forward(nxt, one), plain_kv.forward(nxt, one), atol=1e-4)
            plain_kv.keep(start, torch.zeros(len(prompts), dtype=torch.long))
    # round 1: three rows shared the group's 24 tokens and the plain rows nothing; round 2:
    # all four shared rows took the stored 24, and each plain row its own stored prompt
    assert store.served == 3 * 24 + 4 * 24 + sum(len(p) - 1 for p in prompts[4:])


def test_suffixes_join_a_running_batch(tiny_models):
    """A refill that takes a stored prefix joins rows already decoding, and both stay exact."""
    model = tiny_models["target"]
    prompts = _prompts(1, shared=30, n=3, plain=0)
    store = PrefixStore()
    with torch.inference_mode():
        kv, _ = prefill(model, prompts[:2], 0, store)
        kv.forward(torch.tensor([[40], [41]]), torch.ones(2, 1, dtype=torch.bool))
        late, _ = prefill(model, prompts[2:], 0, store)
        kv.extend(late)
        logits = kv.forward(torch.tensor([[50], [51], [52]]), torch.ones(3, 1, dtype=torch.bool))
        seqs = [prompts[0] + [40, 50], prompts[1] + [41, 51], prompts[2] + [52]]
        for b, seq in enumerate(seqs):
            want = model(torch.tensor([seq])).logits[0, -1]
            assert torch.allclose(logits[b, -1], want, atol=1e-4), b
    assert store.served == 30 + 30  # the group's second row, then the refill


def _requests(seed: int) -> list[Request]:
    prompts = _prompts(seed, shared=40, n=9, plain=4)
    order = torch.randperm(len(prompts), generator=torch.Generator().manual_seed(seed))
    return [Request(id=i, prompt_token_ids=prompts[j], max_new_tokens=4 + 3 * (i % 5))
            for i, j in enumerate(order.tolist())]


@pytest.mark.parametrize("drafter", ["none", "near"])
def test_greedy_output_is_the_same_with_shared_prefixes(drafter, tiny_models, tiny_tokenizer,
                                                        check_greedy):
    requests = _requests(3)
    for bs in (1, 3, 8):  # 13 requests: every batch size refills
        outs = {}
        for share in (True, False):
            draft = (NoDraft() if drafter == "none"
                     else DraftModel(tiny_models["near"], share_prefixes=share))
            engine = SpeculativeEngine(tiny_models["target"], tiny_tokenizer, draft,
                                       max_batch_size=bs, draft_length=3, adaptive=False,
                                       share_prefixes=share)
            outs[share] = engine.generate(requests)
            assert check_greedy(requests, outs[share]) <= 1
            if share:
                assert engine.prefixes.served >= 8 * 40 - 40  # every sharing row but one
                if drafter == "near":
                    assert draft.prefixes.served > 0
        same = sum(a.token_ids == b.token_ids for a, b in zip(outs[True], outs[False]))
        assert same >= len(requests) - 1, bs  # a float near-tie may flip one


@pytest.mark.parametrize("share_lengths", [(40, 40, 40, 40), (20, 33, 51, 26)])
def test_several_groups_in_one_admission_each_take_their_own_prefix(tiny_models,
                                                                    share_lengths):
    """Four templates, two prompts each, in one prefill: every row's cache and logits are
    what a plain prefill computes. Equal template lengths once gave a row another group's
    prefix silently; unequal ones crashed (the plan indexed a list it had shortened)."""
    model = tiny_models["target"]
    gen = torch.Generator().manual_seed(7)
    prompts = []
    for shared in share_lengths:
        head = torch.randint(3, 259, (shared,), generator=gen).tolist()
        prompts += [head + torch.randint(3, 259, (k,), generator=gen).tolist() for k in (3, 5)]
    order = torch.randperm(len(prompts), generator=gen).tolist()
    prompts = [prompts[i] for i in order]
    store = PrefixStore()
    plain_kv, plain_logits = prefill(model, prompts, 0, None)
    kv, logits = prefill(model, prompts, 0, store)
    assert torch.allclose(logits, plain_logits, atol=1e-4)
    nxt = torch.arange(10, 10 + len(prompts))[:, None]
    one = torch.ones(len(prompts), 1, dtype=torch.bool)
    with torch.inference_mode():
        assert torch.allclose(kv.forward(nxt, one), plain_kv.forward(nxt, one), atol=1e-4)
    assert len(store.entries) == len(share_lengths)
    assert store.served == sum(share_lengths)  # each group's second row


def test_templates_under_one_header_each_share_their_whole_prefix():
    """A chat header common to every prompt, then each template's own instructions: each
    template is one group over its whole share, not every prompt one group over the header
    (which left each row its template to prefill); a store that serves only the header
    does not stop it either."""
    head = list(range(3, 3 + 24))
    templates = [head + [100 + t] * 40 for t in range(3)]
    prompts = [templates[i % 3] + [200 + i, 7] for i in range(9)]
    assert sorted(n for _, n in _groups(prompts)) == [64, 64, 64]
    assert sorted(n for _, n in _groups(prompts, [24] * 9)) == [64, 64, 64]
    # two templates of two rows each save less apart than under the header alone
    few = [head + [100 + t] * 5 + [200 + i] for t in range(2) for i in range(2)]
    assert _groups(few) == [([0, 1, 2, 3], 24)]


def _tree_prompts(gen: torch.Generator) -> list[list[int]]:
    """Prompts drawn from a random tree: a header or none, templates under it, tails."""
    def tokens(n: int) -> list[int]:
        return torch.randint(3, 259, (n,), generator=gen).tolist()

    def draw(n: int) -> int:
        return int(torch.randint(n, (1,), generator=gen))

    heads = [tokens(draw(30)) for _ in range(1 + draw(2))]
    templates = [heads[draw(len(heads))] + tokens(draw(40)) for _ in range(1 + draw(4))]
    return [templates[draw(len(templates))] + tokens(1 + draw(6)) for _ in range(2 + draw(9))]


@pytest.mark.parametrize("packed", ["1", "0"])
def test_random_templates_prefill_in_two_passes_and_match_a_plain_prefill(tiny_models,
                                                                         monkeypatch, packed):
    """Random trees of headers, templates and tails, over a store that is empty, then warm,
    then full of other prompts: every row's logits are a plain prefill's, the store's count
    of tokens served is the tokens not computed, and an admission takes two passes at most
    (the shared prefixes', then every row's rest). Both forwards: the packed one writes a
    row's rest right after its prefix, transformers' own after the padding."""
    from specq.worker.engine import batch
    from specq.worker.engine import packed as packing

    monkeypatch.setenv(packing.ENV, packed)
    model = tiny_models["target"]
    passes: list[int] = []
    forward = batch.KVRows.logits

    def counted(self, input_ids, valid, *args, **kwargs):
        passes.append(int(valid.sum()))
        return forward(self, input_ids, valid, *args, **kwargs)

    gen = torch.Generator().manual_seed(11)
    for case in range(12):
        store = PrefixStore(max_entries=int(torch.randint(1, 9, (1,), generator=gen)))
        for _ in range(3):  # the same store: empty, then holding the last rounds' prefixes
            prompts = _tree_prompts(gen)
            monkeypatch.setattr(batch.KVRows, "logits", forward)
            _, want = prefill(model, prompts, 0, None)
            monkeypatch.setattr(batch.KVRows, "logits", counted)
            passes.clear()
            before = store.served
            _, got = prefill(model, prompts, 0, store)
            assert torch.allclose(got, want, atol=1e-4), case
            assert len(passes) <= 2, case
            assert store.served - before == sum(map(len, prompts)) - sum(passes), case
