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
