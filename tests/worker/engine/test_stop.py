"""Stop strings under speculation: the output ends at the token that completes the stop
string even when a draft proposed (and the target accepted) tokens past it, the text is
cut before it, and the result does not depend on the batch or the drafter."""

from __future__ import annotations

import re

import pytest

from specq.schema.generation import Request
from specq.worker.engine.drafters import DraftModel, NoDraft, PromptLookup
from specq.worker.engine.speculative import SpeculativeEngine

PROMPTS = ["The quick brown fox", "Once upon a time there", "hello hello hello", "a b c d"]


def _engine(models, tokenizer, drafter: str, batch: int) -> SpeculativeEngine:
    draft = {"near": lambda: DraftModel(models["near"]), "lookup": PromptLookup,
             "none": NoDraft}[drafter]()
    return SpeculativeEngine(models["target"], tokenizer, draft, max_batch_size=batch,
                             draft_length=4, adaptive=False)


@pytest.mark.parametrize("drafter", ["near", "lookup", "none"])
def test_a_stop_string_ends_the_output_exactly_there(drafter, tiny_models, tiny_tokenizer):
    free = _engine(tiny_models, tiny_tokenizer, "none", 4).generate(
        [Request(id=i, prompt=p, max_new_tokens=40) for i, p in enumerate(PROMPTS)])
    stops = {}
    for r in free:  # a printable ASCII character from the last two thirds of each output
        text = r.text  # (the tiny random model babbles bytes; U+FFFD is no fair stop)
        found = re.search(r"[\x21-\x7e]", text[len(text) // 3:])
        assert found, text
        stops[r.id] = found.group()
    requests = [Request(id=i, prompt=p, max_new_tokens=40, stop=[stops[i], "\x7f never"])
                for i, p in enumerate(PROMPTS)]
    outputs = {}
    for batch in (1, 3):
        for res in _engine(tiny_models, tiny_tokenizer, drafter, batch).generate(requests):
            full = free[res.id]
            stop = stops[res.id]
            assert res.finish_reason == "stop", (res.id, res.text)
            assert res.text == full.text[: full.text.find(stop)]  # cut before the stop
            assert res.token_ids == full.token_ids[: len(res.token_ids)]  # greedy prefix
            kept = tiny_tokenizer.decode(res.token_ids, skip_special_tokens=True)
            shorter = tiny_tokenizer.decode(res.token_ids[:-1], skip_special_tokens=True)
            assert stop in kept and stop not in shorter  # ends at the completing token
            assert res.counters.new_tokens == len(res.token_ids)
            outputs.setdefault(res.id, res.token_ids)
            assert outputs[res.id] == res.token_ids  # same whatever the batch


@pytest.mark.parametrize("drafter", ["lookup", "none"])
def test_no_max_new_tokens_runs_to_the_end_of_the_context(drafter, tiny_models, tiny_tokenizer):
    """max_new_tokens None (an OpenAI line without max_tokens): each row generates until
    its end of text or the model's context (512 tokens for the tiny target), whatever its
    prompt's length, beside a row with a cap of its own."""
    context = tiny_models["target"].config.max_position_embeddings
    prompts = [[(7 * i + 3 * k) % 200 + 5 for k in range(n)] for i, n in enumerate((500, 470))]
    requests = [Request(id=i, prompt_token_ids=p, max_new_tokens=None)
                for i, p in enumerate(prompts)]
    requests.append(Request(id=2, prompt_token_ids=prompts[1], max_new_tokens=5))
    got = _engine(tiny_models, tiny_tokenizer, drafter, 2).generate(requests)
    for req, res in zip(requests[:2], got):
        room = context - len(req.prompt_token_ids)
        assert res.error is None
        assert len(res.token_ids) == room if res.finish_reason == "length" else \
            res.token_ids[-1] in {tiny_tokenizer.eos_token_id}
        assert len(res.token_ids) <= room
    capped = got[2].token_ids
    assert len(capped) <= 5 and capped == got[1].token_ids[:len(capped)]
    assert "length" in {r.finish_reason for r in got[:2]}  # the context's end was reached
    plain = _engine(tiny_models, tiny_tokenizer, "none", 1).generate(requests)
    assert [r.token_ids for r in got] == [r.token_ids for r in plain]
