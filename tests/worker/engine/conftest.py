"""Helpers for engine tests: mixed requests and target-only greedy references."""

from __future__ import annotations

import json
import random
import re
import types

import jsonschema
import llguidance
import llguidance.hf
import pytest
import torch

from specq.schema.generation import Request

NEAR_TIE = 1e-5  # relative gap between the two best logits that float noise may flip


def tie_gap(target, prompt: list[int], want: list[int], got: list[int]) -> tuple[int, float]:
    """Where ``got`` first leaves ``want`` (the reference's tokens after ``prompt``), and the
    target's relative logit gap there between the two tokens: under NEAR_TIE it is a float
    near-tie that either side may take."""
    i = next(j for j, (a, b) in enumerate(zip(got, want)) if a != b)
    with torch.inference_mode():
        logits = target(torch.tensor([prompt + want[:i]])).logits[0, -1]
    a, b = logits[want[i]], logits[got[i]]
    return i, float((a - b).abs() / a.abs().clamp_min(1e-6))


def assert_shaped(fmt, text: str) -> None:
    """A finished shaped output is what its format asks: JSON that parses (and validates
    against its schema), a full regex match, one of the choices."""
    if fmt.type == "json_schema":
        jsonschema.validate(json.loads(text), fmt.json_schema.schema_)
    elif fmt.type == "json_object":
        assert isinstance(json.loads(text), dict), text
    elif fmt.type == "regex":
        assert re.fullmatch(fmt.regex, text), text
    else:
        assert text in fmt.choice, text


@pytest.fixture(scope="session")
def lltok(tiny_tokenizer):
    """The tiny tokenizer as llguidance reads it."""
    return llguidance.hf.from_tokenizer(tiny_tokenizer)


def mixed_requests(n: int, seed: int = 0, max_new: int = 48, **params) -> list[Request]:
    """n requests with prompts of 2..40 random tokens and max_new_tokens of 1..max_new."""
    gen = torch.Generator().manual_seed(seed)
    reqs = []
    for i in range(n):
        length = int(torch.randint(2, 41, (1,), generator=gen))
        # a repeated chunk gives prompt lookup something to find
        base = torch.randint(3, 259, (max(1, length // 2),), generator=gen).tolist()
        ids = (base * 3)[:length]
        new = int(torch.randint(1, max_new + 1, (1,), generator=gen))
        reqs.append(Request(id=i, prompt_token_ids=ids, max_new_tokens=new, **params))
    return reqs


@pytest.fixture
def fixed_entropy(monkeypatch):
    """Unseeded rows draw their keys from a fixed stream instead of the system's entropy:
    a statistical test of the unseeded path (Algorithm 1) then sees the same draws on every
    run, so it fails on a wrong law and never by a one-in-a-thousand chance."""
    stream = random.Random(20_261_205)
    monkeypatch.setattr("specq.worker.engine.batch.secrets",
                        types.SimpleNamespace(randbits=stream.getrandbits))


@pytest.fixture(scope="session")
def make_requests():
    return mixed_requests


@pytest.fixture(scope="session")
def greedy_reference(tiny_models):
    """Target-only greedy `generate`, one request at a time, memoised."""
    target = tiny_models["target"]
    memo: dict[tuple, list[int]] = {}

    def ref(req: Request) -> list[int]:
        key = (tuple(req.prompt_token_ids), req.max_new_tokens)
        if key not in memo:
            ids = torch.tensor([req.prompt_token_ids])
            out = target.generate(ids, max_new_tokens=req.max_new_tokens, do_sample=False)
            memo[key] = out[0, ids.shape[1]:].tolist()
        return memo[key]

    return ref


@pytest.fixture(scope="session")
def check_greedy(tiny_models, greedy_reference):
    """Compare results to the reference; a divergence must be a float near-tie.

    Returns the number of near-tie divergences (the caller reports them).
    """
    target = tiny_models["target"]

    def check(requests, results) -> int:
        ties = 0
        for req, res in zip(requests, results):
            assert res.error is None, res.error
            want = greedy_reference(req)
            if res.token_ids == want:
                continue
            i, gap = tie_gap(target, req.prompt_token_ids, want, res.token_ids)
            assert gap < NEAR_TIE, (
                f"request {req.id}: token {i} is {res.token_ids[i]}, target-only greedy "
                f"gives {want[i]}; relative logit gap {gap:.2e} is no near-tie"
            )
            ties += 1
        return ties

    return check
