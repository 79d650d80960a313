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
