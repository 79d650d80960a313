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


@pytest.mark.parametrize("drafter", ["lookup", "none"])
def test_a_stop_string_in_the_prompt_stops_nothing(drafter, tiny_models, tiny_tokenizer):
    """Stop strings match the generated text only (OpenAI's and vLLM's rule): a prompt
    ending in one (a chat template's "assistant\\n" beside the stop "\\n") generates as
    if it had none, until the output holds the stop string itself."""
    prompts = ["Write a list:\n", "say END", "a b c"]
    stops = ["\n", "END", "c"]
    free = _engine(tiny_models, tiny_tokenizer, "none", 3).generate(
        [Request(id=i, prompt=p, max_new_tokens=30) for i, p in enumerate(prompts)])
    got = _engine(tiny_models, tiny_tokenizer, drafter, 3).generate(
        [Request(id=i, prompt=p, max_new_tokens=30, stop=[s])
         for i, (p, s) in enumerate(zip(prompts, stops))])
    for stop, full, res in zip(stops, free, got):
        if stop in full.text:  # the output's own stop string ends it there
            assert res.finish_reason == "stop"
            assert res.text == full.text[: full.text.find(stop)]
        else:  # nothing stops it: it runs as far as the free run
            assert res.token_ids == full.token_ids
            assert res.finish_reason == full.finish_reason
        assert res.token_ids == full.token_ids[: len(res.token_ids)]
    assert any(stop not in full.text[:3] for stop, full in zip(stops, free))


@pytest.mark.parametrize("stop", ["\U0001f389" * 6, "\u6f22\u5b57\u304b\u306a" * 2])
def test_a_stop_string_of_many_tokens_ends_the_row_once_complete(stop, tiny_tokenizer):
    """A stop string is found however many tokens it takes (an emoji is 3-4 of them): the
    row ends at the token that completes it, not at its max_new_tokens."""
    from specq.worker.engine.batch import Row

    prompt = tiny_tokenizer("Say it:", add_special_tokens=False).input_ids
    tokens = tiny_tokenizer("ok " + stop + " and more after it", add_special_tokens=False
                            ).input_ids
    row = Row(Request(prompt_token_ids=prompt, max_new_tokens=200, stop=[stop]), prompt,
              set(), tiny_tokenizer, 512)
    kept = row.emit(tokens)
    text = tiny_tokenizer.decode(tokens[:kept], skip_special_tokens=True)
    assert row.result.finish_reason == "stop"
    assert text.endswith(stop) and stop not in tiny_tokenizer.decode(tokens[: kept - 1])
    assert len(tokens) - kept == len(tiny_tokenizer(" and more after it",
                                                     add_special_tokens=False).input_ids)
    assert row.finish().text == "ok "


def test_token_ids_past_the_vocabulary_fail_alone(tiny_models, tiny_tokenizer):
    """A request of its own token ids past the model's vocabulary gets an error naming the
    id and its place; its batch-mates go on."""
    vocab = tiny_models["target"].config.vocab_size
    good = Request(id="good", prompt="hello there", max_new_tokens=5)
    bad = Request(id="bad", prompt_token_ids=[5, vocab + 7, 7], max_new_tokens=5)
    got = {r.id: r for r in _engine(tiny_models, tiny_tokenizer, "lookup", 2).generate(
        [bad, good])}
    assert got["bad"].error == (f"prompt_token_ids: token id {vocab + 7} at position 1 is "
                                f"past the model's vocabulary of {vocab} tokens")
    assert got["good"].error is None and len(got["good"].token_ids) == 5
    with pytest.raises(ValueError, match="token ids are 0 or more"):
        Request(prompt_token_ids=[3, -1])
