"""Refills that join the running pass (speculative.py: _join): a new row's prompt rides in
the next step's pass beside the other rows' drafts, and the pass yields its first token."""

import pytest
import torch

from specq.schema.generation import Request
from specq.worker.engine import speculative
from specq.worker.engine.batch import KVRows, left_pad
from specq.worker.engine.drafters import DraftModel, NoDraft, PromptLookup
from specq.worker.engine.policy import CostTable
from specq.worker.engine.speculative import SpeculativeEngine
from specq.worker.engine.suffix import SuffixDrafter
from tests.worker.engine.test_grammar import FORMATS, shaped_requests

DRAFTERS = {"none": NoDraft, "lookup": PromptLookup, "suffix": SuffixDrafter}


def _long(make_requests, n: int, seed: int) -> list[Request]:
    """n mixed requests of 2 new tokens at least: none ends at its first token."""
    return [r.model_copy(update={"max_new_tokens": r.max_new_tokens + 1})
            for r in make_requests(n, seed=seed, max_new=16)]


@pytest.mark.parametrize("drafter", sorted(DRAFTERS))
def test_refills_join_the_running_pass_and_the_output_is_the_same(
        drafter, tiny_models, tiny_tokenizer, make_requests, check_greedy):
    """Only the first rows are prefilled in a pass of their own; every refill joins a step's
    pass, at once (the batch is full whenever a request waits), the output is greedy
    decoding's, and a joined row's counters say one prefill pass and its steps."""
    requests = _long(make_requests, 24, seed=11)
    sizes: list[int] = []
    engine = SpeculativeEngine(tiny_models["target"], tiny_tokenizer, DRAFTERS[drafter](),
                               max_batch_size=4, draft_length=2,
                               on_step=lambda step: sizes.append(len(step.accepted)))
    results = engine.generate(requests)
    check_greedy(requests, results)
    assert engine.admissions == 1 and engine.joins == len(requests) - 4
    full_until = len(sizes) - max(r.max_new_tokens for r in requests)  # waiting ran out
    assert min(sizes[:full_until]) == 4
    for res in results:
        c = res.counters
        assert sum(c.steps_by_draft_length) == c.target_passes - 1  # all steps but the prefill
        assert c.accepted + c.target_passes - 1 <= c.new_tokens <= c.accepted + c.target_passes


def test_a_draft_model_and_long_prompts_are_prefilled_in_a_pass_of_their_own(
        tiny_models, tiny_tokenizer, make_requests, check_greedy, monkeypatch):
    """A draft model prefills its own cache from a row's first token: its refills take a
    prefill pass. So do prompts too long for one pass's attention mask (JOIN_CELLS)."""
    requests = _long(make_requests, 12, seed=12)
    model = SpeculativeEngine(tiny_models["target"], tiny_tokenizer,
                              DraftModel(tiny_models["near"]), max_batch_size=4)
    check_greedy(requests, model.generate(requests))
    assert model.joins == 0 and model.admissions > 1
    monkeypatch.setattr(speculative, "JOIN_CELLS", 1)
    lookup = SpeculativeEngine(tiny_models["target"], tiny_tokenizer, PromptLookup(),
                               max_batch_size=4)
    check_greedy(requests, lookup.generate(requests))
    assert lookup.joins == 0 and lookup.admissions > 1


def test_a_joining_row_takes_its_stored_prefix(tiny_models, tiny_tokenizer, check_greedy):
    """Prompts of one template: the first admission stores the shared prefix, and each row
    that joins later copies its columns and carries only its own tail in the pass."""
    gen = torch.Generator().manual_seed(3)
    template = torch.randint(3, 259, (40,), generator=gen).tolist()
    requests = [Request(id=i, prompt_token_ids=template + [10 + i, 20 + i, 30 + i],
                        max_new_tokens=4 + i % 5) for i in range(10)]
    engine = SpeculativeEngine(tiny_models["target"], tiny_tokenizer, PromptLookup(),
                               max_batch_size=3)
    check_greedy(requests, engine.generate(requests))
    assert engine.joins == 7
    assert engine.prefixes is not None and engine.prefixes.served >= 10 * 40 - 40


def test_a_template_first_seen_by_a_joining_row_serves_the_next_ones(
        tiny_models, tiny_tokenizer, check_greedy):
    """The first admission holds only template A; template B's rows all join later. The
    first B row computes its whole prompt and is stored; the next B rows take its columns."""
    gen = torch.Generator().manual_seed(4)
    a, b = (torch.randint(3, 259, (40,), generator=gen).tolist() for _ in range(2))
    prompts = [a + [5, 6], a + [7, 8]] + [b + [10 + i, 20 + i] for i in range(6)]
    requests = [Request(id=i, prompt_token_ids=p, max_new_tokens=3 + i % 4)
                for i, p in enumerate(prompts)]
    engine = SpeculativeEngine(tiny_models["target"], tiny_tokenizer, NoDraft(),
                               max_batch_size=2)
    check_greedy(requests, engine.generate(requests))
    assert engine.joins == 6 and engine.prefixes is not None
    assert engine.prefixes.served >= 5 * 40  # B's template for every B row but the first


def test_seeded_sampling_gives_the_same_text_joined_or_prefilled(
        tiny_models, tiny_tokenizer, make_requests):
    """A row's first token is the target's own draw at its position whichever pass makes
    it: seeded rows give the same text whether their refills join a pass or not."""
    requests = [r.model_copy(update={"seed": 100 + i}) for i, r in enumerate(
        _long(make_requests, 16, seed=13))]
    requests = [r.model_copy(update={"temperature": 0.9, "top_p": 0.95}) for r in requests]

    def texts(joins: bool) -> list[list[int]]:
        engine = SpeculativeEngine(tiny_models["target"], tiny_tokenizer, PromptLookup(),
                                   max_batch_size=4, draft_length=2, join_refills=joins)
        out = [r.token_ids for r in engine.generate(requests)]
        assert (engine.joins > 0) is joins
        return out

    assert texts(True) == texts(False)


@pytest.mark.parametrize("drafter", sorted(DRAFTERS))
def test_shaped_one_token_and_stopped_rows_give_the_same_output_joined_or_prefilled(
        drafter, tiny_models, tiny_tokenizer):
    """Rows under every kind of response_format, rows of one new token (they end on the
    pass they join), rows with a stop string, greedy and seeded sampled: the same tokens,
    finish reasons and errors whether refills join a pass or take one of their own."""
    greedy = shaped_requests(30, seed=3)
    greedy = [r.model_copy(update={"max_new_tokens": 1}) if i % 7 == 0 else
              r.model_copy(update={"stop": ["e"]}) if i % 9 == 1 else r
              for i, r in enumerate(greedy)]
    sampled = [r.model_copy(update={"temperature": 0.8, "seed": 50 + i})
               for i, r in enumerate(greedy)]

    def outputs(joins: bool) -> list[tuple]:
        engine = SpeculativeEngine(tiny_models["target"], tiny_tokenizer, DRAFTERS[drafter](),
                                   max_batch_size=3, join_refills=joins)
        out = [(r.token_ids, r.finish_reason, r.error)
               for r in engine.generate(greedy + sampled)]
        assert (engine.joins > 0) is joins
        return out

    assert outputs(True) == outputs(False)


def _forced_start(n: int, seed: int) -> list[Request]:
    """n requests of random prompts (2-19 tokens) under a JSON schema that forces their
    first tokens (``{"name":``)."""
    gen = torch.Generator().manual_seed(seed)
    return [Request(id=i, prompt_token_ids=torch.randint(3, 259, (int(k),),
                                                         generator=gen).tolist(),
                    max_new_tokens=24, response_format=FORMATS[0])
            for i, k in enumerate(torch.randint(2, 20, (n,), generator=gen))]


def test_a_row_its_grammar_starts_has_that_start_judged_in_the_pass_of_its_prompt(
        tiny_models, tiny_tokenizer):
    """Rows whose grammar forces their first tokens (``{"name":``) join a pass, the job's
    first rows too: no prefill pass of their own. The pass that reads a row's prompt judges
    what is forced, so it yields all of it and the token after, one pass a row fewer than
    where the rows are prefilled (the prefill yields ``{``, the next pass the rest); the
    tokens are the same."""
    requests = _forced_start(7, seed=5)

    def run(joins: bool) -> tuple[SpeculativeEngine, list, list]:
        steps: list = []
        engine = SpeculativeEngine(tiny_models["target"], tiny_tokenizer, NoDraft(),
                                   max_batch_size=3, grammar_drafts=True,
                                   join_refills=joins, on_step=steps.append)
        return engine, engine.generate(requests), steps

    joined, results, steps = run(True)
    prefilled, reference, _ = run(False)
    assert [r.token_ids for r in results] == [r.token_ids for r in reference]
    assert joined.admissions == 0 and joined.joins == len(requests)
    firsts = [(s, b) for s in steps for b, n in enumerate(s.joined) if n]
    assert len(firsts) == len(requests)
    start = len(b'{"name":')  # a byte a token: the tiny tokenizer's
    for s, b in firsts:
        assert s.forced[b][:start] == list(range(start)) and s.accepted[b] >= start
    assert ([r.counters.target_passes for r in results]
            == [r.counters.target_passes - 1 for r in reference])
    for res in results:  # every pass judged drafts: each a step, its accepted counted
        c = res.counters
        assert sum(c.steps_by_draft_length) == c.target_passes
        assert c.accepted + c.target_passes - 1 <= c.new_tokens <= c.accepted + c.target_passes


@pytest.mark.parametrize("drafter,temperature", [("none", 0.0), ("lookup", 0.9)])
def test_rows_their_grammar_forces_whole_give_the_same_output_joined_or_prefilled(
        drafter, temperature, tiny_models, tiny_tokenizer):
    """Grammars that force all of a row's output (a one-option choice, a constant, a fixed
    regex) or its start and end: the joining pass judges it all, up to the row's limit.
    Tokens, finish reasons and counts are those of rows prefilled, no row past its limit."""
    formats = [{"type": "choice", "choice": ["yes"]}, {"type": "regex", "regex": "abcdefghij"},
               {"type": "json_schema", "json_schema": {"name": "c", "schema": {
                   "const": {"a": [1, 2, 3]}}}},
               {"type": "regex", "regex": "abc[0-9]{2}xyz"}]
    requests = [Request(id=i, prompt_token_ids=[5 + i, 7, 9, 11 + i], max_new_tokens=limit,
                        response_format=formats[i % 4], temperature=temperature,
                        seed=i if temperature else None)
                for i, limit in enumerate([1, 2, 3, 5, 30, 30, 30, 30, 4, 8, 30, 30])]

    def outputs(joins: bool) -> list[tuple]:
        engine = SpeculativeEngine(tiny_models["target"], tiny_tokenizer, DRAFTERS[drafter](),
                                   max_batch_size=3, grammar_drafts=True, join_refills=joins)
        out = [(r.token_ids, r.finish_reason, r.error, r.counters.new_tokens)
               for r in engine.generate(requests)]
        assert (engine.joins > 0) is joins
        return out

    joined = outputs(True)
    assert joined == outputs(False)
    for (tokens, _, error, new), req in zip(joined, requests):
        assert error is None and new == len(tokens) <= req.max_new_tokens


def _break_joined_passes(m: pytest.MonkeyPatch) -> None:
    """Every pass that rows join (``first``: where their prompts start) raises."""
    real = KVRows.logits

    def broken(self, *args, first=None, **kwargs):
        if first is not None:
            raise RuntimeError("the joined pass failed")
        return real(self, *args, first=first, **kwargs)
    m.setattr(KVRows, "logits", broken)


@pytest.mark.parametrize("where", ["seeding", "pass"])
def test_an_error_while_a_refill_joins_names_its_rows_and_the_next_run_starts_clean(
        where, tiny_models, tiny_tokenizer, make_requests, check_greedy, monkeypatch):
    """An error copying a joining row's prefix, or in the pass it joins, ends the
    generation with the joining requests among the active ones (a worker records them
    against their attempts), and the engine's next generation is exact."""
    requests = _long(make_requests, 10, seed=15)
    engine = SpeculativeEngine(tiny_models["target"], tiny_tokenizer, PromptLookup(),
                               max_batch_size=3)
    with monkeypatch.context() as m:
        if where == "seeding":
            def broken(*args, **kwargs):
                raise RuntimeError("out of memory copying a prefix")
            m.setattr(speculative, "seeded", broken)
        else:
            _break_joined_passes(m)
        with pytest.raises(RuntimeError):
            engine.generate(requests)
        assert requests[3].id in engine.active_ids()  # the first refill, joining
    check_greedy(requests, engine.generate(requests))
    assert engine.joins > 0


def test_an_error_in_the_pass_a_job_s_first_rows_join_names_them_and_the_next_run_is_exact(
        tiny_models, tiny_tokenizer, monkeypatch):
    """A job's first rows that join the first step's pass for their grammar's forced start
    (no row is running: the pass makes the cache): an error in that pass ends the generation
    with every one of them among the active requests, and the next generation gives what
    prefilled rows give."""
    requests = _forced_start(5, seed=16)

    def engine(joins: bool) -> SpeculativeEngine:
        return SpeculativeEngine(tiny_models["target"], tiny_tokenizer, NoDraft(),
                                 max_batch_size=3, grammar_drafts=True, join_refills=joins)

    joined = engine(True)
    with monkeypatch.context() as m:
        _break_joined_passes(m)
        with pytest.raises(RuntimeError, match="joined pass"):
            joined.generate(requests)
        assert set(joined.active_ids()) == {r.id for r in requests[:3]}
    want = [r.token_ids for r in engine(False).generate(requests)]
    assert [r.token_ids for r in joined.generate(requests)] == want
    assert joined.admissions == 0


def test_a_pass_that_prefilled_joining_rows_teaches_no_cost(
        tiny_models, tiny_tokenizer, make_requests, monkeypatch):
    """A joined pass's seconds hold a prefill: the policy's cost table learns from every
    step but those."""
    added: list[int] = []
    real = CostTable.add

    def spy(self, batch, *args, **kwargs):
        added.append(batch)
        return real(self, batch, *args, **kwargs)

    steps = []
    engine = SpeculativeEngine(tiny_models["target"], tiny_tokenizer, PromptLookup(),
                               max_batch_size=4, on_step=steps.append)
    monkeypatch.setattr(CostTable, "add", spy)
    engine.generate(_long(make_requests, 12, seed=14))
    joined = [s for s in steps if s.joined]
    assert joined and all(sum(s.joined) > 0 for s in joined)
    assert len(added) == len(steps) - len(joined)


def test_a_pass_returns_each_rows_logits_from_the_position_asked(tiny_models):
    """``first``: row b's logits from position first[b] on, in slots 0, 1, ...: what the
    whole pass returns at those positions (the head computed only there)."""
    target = tiny_models["target"]
    prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]
    ids = torch.tensor([[20, 21, 22, 23, 24], [25, 26, 0, 0, 0], [27, 28, 29, 30, 0]])
    valid = ids > 0
    caches = []
    for _ in range(2):
        kv = KVRows(target)
        assert kv.packed  # the tiny target is a Llama: the packed forward
        kv.forward(*left_pad(prompts, 0, target.device))
        caches.append(kv)
    whole = caches[0].forward(ids, valid)  # [3, 5, V]
    first = [3, 1, 2]
    part = caches[1].forward(ids, valid, first=first)  # [3, 2, V]
    assert part.shape[:2] == (3, 2)
    for b, f in enumerate(first):
        for j in range(2):
            if valid[b, f + j]:
                torch.testing.assert_close(part[b, j], whole[b, f + j])
            else:
                assert not part[b, j].any()
    torch.testing.assert_close(caches[0].mask, caches[1].mask)
