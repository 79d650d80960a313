"""Impossible parameters and prompts that cannot fit give errors that name the field."""

import pytest
from pydantic import ValidationError

from specq.schema.generation import Request
from specq.worker.engine.speculative import SpeculativeEngine


@pytest.mark.parametrize("field,value", [
    ("temperature", -1), ("top_p", -0.1), ("top_p", 1.5), ("max_new_tokens", 0),
    ("top_k", -2), ("stop", [""]),
])
def test_impossible_parameters_name_the_field(field, value):
    with pytest.raises(ValidationError, match=field):
        Request(prompt="hi", **{field: value})


@pytest.mark.parametrize("kwargs,match", [
    ({"prompt": "   "}, "prompt"),
    ({"messages": []}, "messages"),
    ({}, "exactly one"),
    ({"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "exactly one"),
])
def test_prompt_must_be_given_once(kwargs, match):
    with pytest.raises(ValidationError, match=match):
        Request(**kwargs)


def test_too_long_prompts_fail_alone(tiny_models, tiny_tokenizer):
    """The tiny model's context is 512 tokens; the other requests still finish."""
    reqs = [
        Request(id="ok", prompt="hello", max_new_tokens=5),
        Request(id="long", prompt="word " * 200, max_new_tokens=5),  # 1000 byte tokens
        Request(id="budget", prompt="hello", max_new_tokens=510),
        Request(id="chat", messages=[{"role": "user", "content": "hi"}], max_new_tokens=3),
    ]
    engine = SpeculativeEngine(tiny_models["target"], tiny_tokenizer)
    ok, long, budget, chat = engine.generate(reqs)
    assert ok.error is None and len(ok.token_ids) >= 1
    assert long.error.startswith("prompt: 1000 tokens") and "context is 512" in long.error
    assert long.token_ids == [] and long.finish_reason is None
    assert budget.error.startswith("max_new_tokens: 510") and budget.token_ids == []
    assert chat.error is None and chat.prompt_tokens > 3


def test_size_shortcut_never_passes_a_prompt_that_does_not_fit(tiny_tokenizer):
    """fits_by_size lets submissions skip tokenizing; it must be an upper bound."""
    from specq.schema.generation import fits_by_size
    from specq.worker.engine.speculative import encode_prompt

    context = 512
    texts = ["é" * 200, "word " * 90, "日本語" * 50, "x" * 480, "a b"]
    for text in texts:
        for max_new in (1, 16, 100):
            for req in (Request(prompt=text, max_new_tokens=max_new),
                        Request(messages=[{"role": "user", "content": text}],
                                max_new_tokens=max_new)):
                if fits_by_size(req, context):
                    n = len(encode_prompt(tiny_tokenizer, req, 10**9))
                    assert n + max_new <= context, (text[:10], max_new)
    assert fits_by_size(Request(prompt="short", max_new_tokens=8), context)
    assert not fits_by_size(Request(prompt="x" * 500, max_new_tokens=8), context)


def test_prompts_encoded_together_are_the_ones_encoded_alone(tiny_tokenizer):
    """An admission tokenizes its plain prompts in one call: each gets the ids (or the
    refusal) it gets alone, beside chat messages, given token ids and prompts too long."""
    from specq.schema.generation import Request, RequestError, check_length
    from specq.worker.engine.speculative import encode_prompts

    requests = [
        Request(id=0, prompt="Fix the grammar: he go home", max_new_tokens=8),
        Request(id=1, messages=[{"role": "user", "content": "Summarise: a b c"}],
                max_new_tokens=8),
        Request(id=2, prompt="é ü " * 300, max_new_tokens=8),  # too long for 512
        Request(id=3, prompt_token_ids=[5, 6, 7], max_new_tokens=8),
        Request(id=4, prompt="x", max_new_tokens=600),  # max_new_tokens past the context
        Request(id=5, prompt="a\n\tb  ", max_new_tokens=4),
        Request(id=6, prompt="Label the sentiment: fine", max_new_tokens=1),
    ]
    together = encode_prompts(tiny_tokenizer, requests, 512)
    for req, got in zip(requests, together):
        if req.prompt is not None:
            alone = tiny_tokenizer(req.prompt).input_ids  # the tokenizer, one prompt a call
        elif req.messages is not None:
            text = tiny_tokenizer.apply_chat_template([m.model_dump() for m in req.messages],
                                                      tokenize=False, add_generation_prompt=True)
            alone = tiny_tokenizer(text, add_special_tokens=False).input_ids
        else:
            alone = list(req.prompt_token_ids)
        try:
            check_length(len(alone), req.max_new_tokens, 512)
        except RequestError as exc:
            assert isinstance(got, RequestError) and str(got) == str(exc), req.id
            continue
        assert got == alone, req.id
    assert [isinstance(g, RequestError) for g in together] == [False, False, True, False,
                                                               True, False, False]


class _Spy:
    """A tokenizer that records the length of every text it is asked to encode."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer, self.texts = tokenizer, []

    def __call__(self, texts, **kwargs):
        self.texts += [len(t) for t in ([texts] if isinstance(texts, str) else texts)]
        return self._tokenizer(texts, **kwargs)

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


def test_a_prompt_far_too_long_is_refused_by_its_size_untokenized(tiny_tokenizer):
    """A prompt whose bytes over the vocabulary's longest token already pass the context is
    refused naming both, and never reaches the tokenizer (8 MB of text cost a tokenizer
    1.8 GB); the rest of the admission is encoded as before."""
    from specq.schema.generation import Request, RequestError
    from specq.worker.engine.speculative import encode_prompts

    spy = _Spy(tiny_tokenizer)
    huge = "the quick brown fox " * 400_000  # 8 MB
    requests = [Request(id=0, prompt=huge, max_new_tokens=4),
                Request(id=1, messages=[{"role": "user", "content": huge}], max_new_tokens=4),
                Request(id=2, prompt="Fix the grammar: he go home", max_new_tokens=8)]
    got = encode_prompts(spy, requests, 512)
    for refused in got[:2]:
        assert isinstance(refused, RequestError)
        assert str(refused).startswith("prompt: at least ")
        assert "the model's context is 512" in str(refused)
    assert got[2] == tiny_tokenizer(requests[2].prompt).input_ids
    assert max(spy.texts) < 100
