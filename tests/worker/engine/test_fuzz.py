"""A differential fuzz of the engine: realistic mixes against each request run alone.

Hypothesis draws jobs as offline users send them: prompts built from a few shared templates
(system prompts, synthesis templates) and lone prompts, plain and chat, with random
max_new_tokens, stop strings, seeds, temperatures and response formats (JSON schema, JSON
object, regex, choice). It runs them through an engine with a random drafter (draft model,
prompt lookup, suffix, none), grammar drafts on or off, batch size, refill group, draft
length, prefix sharing on or off, the packed pass's attention split per row wherever it can
be (packed.split) or only where it pays, top-p's cut looked for among few candidates or the
whole vocabulary (sampling.CANDIDATES), and now and then an out-of-memory error mid-run
(the worker's halving path, worker/attempts.py). Every output must equal the same request
run alone through the target by itself: token for token when greedy (a float near-tie
excepted, and counted), and when sampled with a seed (the draw is keyed by seed and
position, so it does not depend on the batch). In a quarter of the jobs the sampled rows
carry no seed: beside a draft model the engine then takes Algorithm 1 (rejection.py) for
every row of the step; such a row's tokens are not the reference's, but they must keep to
its limits, stop strings and format, and the rows beside it must still equal theirs. No
exception may escape.

The suite runs the ``ci`` profile (300 examples, derandomized: the same cases every run);
``HYPOTHESIS_PROFILE=long`` runs 3,000 fresh ones (the bench's longer profile:
``make fuzz``); ``quick`` 30 fixed ones (``make test-fast``, the edit loop).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import llguidance
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specq.configs.settings import Settings
from specq.schema.generation import Request
from specq.schema.grammar import grammar
from specq.worker.attempts import generate_with_retries
from specq.worker.engine import packed, sampling
from specq.worker.engine.drafters import DraftModel, NoDraft, PromptLookup
from specq.worker.engine.speculative import SpeculativeEngine, encode_prompt
from specq.worker.engine.suffix import SuffixDrafter

from .conftest import NEAR_TIE, assert_shaped, tie_gap

settings.register_profile("ci", max_examples=300, derandomize=True, deadline=None,
                          suppress_health_check=list(HealthCheck), print_blob=True)
settings.register_profile("quick", max_examples=30, derandomize=True, deadline=None,
                          suppress_health_check=list(HealthCheck), print_blob=True)
settings.register_profile("long", max_examples=3000, deadline=None,
                          suppress_health_check=list(HealthCheck), print_blob=True)
PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci")

WORDS = ("the", "data", "model", "answer", "json", "list", "rewrite", "formal", "summary",
         "of", "a", "user", "review", "ticket", "name", "city", "and", "short", "quiz", "key",
         # punctuation, where a value copied into a JSON string is cut and its quote guessed
         "Leeds,", "cook.", "(a)")
DRAFTERS = ("none", "lookup", "suffix", "near", "noisy")
ITEM = {"type": "object", "additionalProperties": False, "required": ["name", "n"],
        "properties": {"name": {"type": "string", "maxLength": 5},
                       "n": {"type": "integer", "minimum": 0, "maximum": 99}}}
FORMATS = (  # a quarter of the requests, shaped rows beside free ones
    {"type": "json_schema", "json_schema": {"name": "item", "schema": ITEM}},
    {"type": "json_object"},
    {"type": "regex", "regex": "(key|name)=[a-z]{1,4}; (key|name)=[0-9]{2};"},
    {"type": "choice", "choice": ["the answer", "the data", "a summary"]},
)

words = st.lists(st.sampled_from(WORDS), min_size=1, max_size=6).map(" ".join)
# a template of 3..12 words: on the byte-level tiny tokenizer, 16 or more shared tokens
templates = st.lists(st.sampled_from(WORDS), min_size=3, max_size=12).map(" ".join)


@dataclass
class Case:
    requests: list[Request]
    drafter: str
    batch: int
    admit_group: int
    share: bool
    adaptive: bool
    grammar_drafts: bool
    draft_length: int
    oom_at: int | None  # raise out-of-memory at this step (None: never)
    split: bool  # attention calls priced at nothing: every ragged pass split (packed.split)
    candidates: tuple[int, ...]  # top-k/top-p's first looks (sampling.CANDIDATES); the
    # tiny vocabulary is under the default's, so small counts make every stage run
    unseeded: bool  # the sampled requests carry no seed (Algorithm 1 beside a draft model)


@st.composite
def cases(draw) -> Case:
    shared = draw(st.lists(templates, min_size=1, max_size=4))
    n = draw(st.integers(2, 12))
    requests = []
    for i in range(n):
        template = draw(st.sampled_from([*shared, None]))  # None: a lone prompt
        tail = draw(words)
        chat = draw(st.booleans())
        if chat:
            messages = ([{"role": "system", "content": template}] if template else [])
            prompt = {"messages": [*messages, {"role": "user", "content": tail}]}
        else:
            prompt = {"prompt": f"{template}: {tail}" if template else tail}
        sampled = draw(st.integers(0, 3)) == 0  # a quarter sampled, always with a seed
        params = {
            "max_new_tokens": draw(st.integers(1, 16)),
            "stop": draw(st.lists(st.sampled_from(["e", "at", "the", "\n", "zz"]),
                                  max_size=2)),
        }
        if sampled:
            params.update(temperature=draw(st.sampled_from([0.5, 1.0, 1.5])),
                          top_k=draw(st.sampled_from([0, 5, 50])),
                          top_p=draw(st.sampled_from([1.0, 0.9])),
                          seed=draw(st.integers(0, 2**32)))
        if draw(st.integers(0, 3)) == 0:
            params["response_format"] = draw(st.sampled_from(FORMATS))
            if params["response_format"]["type"] != "text":
                params["stop"] = []  # refused beside a shaping format (Request)
        requests.append(Request(id=i, **prompt, **params))
    batch = draw(st.integers(1, 16))
    case = Case(
        requests=requests,
        drafter=draw(st.sampled_from(DRAFTERS)),
        batch=batch,
        admit_group=draw(st.integers(1, batch)),
        share=draw(st.booleans()),
        adaptive=draw(st.booleans()),
        grammar_drafts=draw(st.booleans()),
        draft_length=draw(st.integers(1, 6)),
        oom_at=draw(st.one_of(st.none(), st.integers(0, 12))),
        split=draw(st.booleans()),
        candidates=draw(st.sampled_from([sampling.CANDIDATES, (8, 64)])),
        unseeded=draw(st.integers(0, 3)) == 0,  # drawn last: the cases before keep theirs
    )
    if case.unseeded:
        case.requests = [r.model_copy(update={"seed": None}) if r.temperature > 0 else r
                         for r in case.requests]
    return case


class Outcomes:
    """Where generate_with_retries hands results (the worker's keeper writes them to the
    database; the engine is what is under test here)."""

    def __init__(self) -> None:
        self.results: dict[int, object] = {}
        self.failures: list[tuple[list[int], str]] = []

    def put(self, outcome) -> None:
        assert outcome.index not in self.results, f"item {outcome.index} written twice"
        self.results[outcome.index] = outcome

    def failed(self, indices: list[int], error: str, generation: int | None = None) -> None:
        self.failures.append((indices, error))

    def out_of_memory(self, error: str) -> None: ...

    def crashed(self, indices: list[int], why: str) -> None:
        raise AssertionError(f"no device is lost here: {why}")

    def launch(self, indices: list[int], generation: int) -> None: ...

    def should_stop(self) -> bool:
        return False


class Reference:
    """Each request alone, through the target by itself (batch 1, no drafter, no shared
    prefix), memoised by request; ``raced`` samples as an engine whose drafter races."""

    def __init__(self, target, tokenizer) -> None:
        self.engines = {raced: SpeculativeEngine(target, tokenizer, drafter,
                                                 max_batch_size=1, share_prefixes=False)
                        for raced, drafter in ((False, NoDraft()), (True, _Racing()))}
        self.memo: dict[tuple, list[int]] = {}

    def __call__(self, req: Request, raced: bool) -> list[int]:
        key = (req.model_dump_json(exclude={"id"}), raced and req.temperature > 0)
        if key not in self.memo:
            (res,) = self.engines[key[1]].generate([req])
            assert res.error is None, res.error
            self.memo[key] = res.token_ids
        return self.memo[key]


class _Racing(NoDraft):
    """No draft, but the target samples as it does beside a drafter that races."""

    races = True


def _drafter(kind: str, models, share: bool):
    if kind in ("near", "noisy"):
        return DraftModel(models[kind], share_prefixes=share)
    return {"none": NoDraft, "lookup": PromptLookup, "suffix": SuffixDrafter}[kind]()


def _near_tie(target, prompt: list[int], want: list[int], got: list[int]) -> bool:
    """Does the first difference sit on a float near-tie of the target's two best logits?"""
    return tie_gap(target, prompt, want, got)[1] < NEAR_TIE


@pytest.fixture(scope="module")
def reference(tiny_models, tiny_tokenizer):
    return Reference(tiny_models["target"], tiny_tokenizer)


@pytest.fixture(scope="module")
def ties():
    counted = {"ties": 0, "examples": 0}
    yield counted
    print(f"\nfuzz: {counted['examples']} examples, {counted['ties']} near-tie differences")


@settings(settings.get_profile(PROFILE))
@given(case=cases())
def test_every_mix_gives_what_each_request_gives_alone(case, tiny_models, tiny_tokenizer,
                                                       reference, ties, lltok):
    target = tiny_models["target"]
    drafter = _drafter(case.drafter, tiny_models, case.share)
    engine = SpeculativeEngine(target, tiny_tokenizer, drafter, max_batch_size=case.batch,
                               draft_length=case.draft_length, adaptive=case.adaptive,
                               share_prefixes=case.share, admit_group=case.admit_group,
                               grammar_drafts=case.grammar_drafts)
    steps = 0

    def on_step(_) -> None:
        nonlocal steps
        steps += 1
        assert engine.kv.packed  # the tiny target is a Llama: the fuzz runs the packed forward
        if steps == case.oom_at:
            raise torch.OutOfMemoryError("CUDA out of memory (injected by the fuzz)")

    engine.on_step = on_step
    sink = Outcomes()
    requests = {r.id: r for r in case.requests}
    price, candidates = packed.CALL_COLUMNS, sampling.CANDIDATES
    packed.CALL_COLUMNS = 0 if case.split else price  # tiny caches: at its price, seldom split
    sampling.CANDIDATES = case.candidates
    try:
        tally = generate_with_retries(
            engine, [_item(r) for r in case.requests], {}, "fuzz", sink,
            Settings(retry_backoff=0.01, retry_backoff_max=0.01), job="fuzz")
    finally:
        packed.CALL_COLUMNS, sampling.CANDIDATES = price, candidates
    assert tally.failed == 0, sink.failures
    assert not sink.failures or case.oom_at, sink.failures  # an OOM at batch 1 counts one
    assert sorted(sink.results) == sorted(requests)
    raced = getattr(drafter, "races", False)
    for i, out in sink.results.items():
        req = requests[i]
        assert out.error is None, (i, out.error)
        if req.temperature > 0 and req.seed is None:
            _keeps_to_its_request(req, out, lltok)
            continue
        want = reference(req, raced)
        if out.token_ids == want:
            continue
        prompt = encode_prompt(tiny_tokenizer, req, engine.context)
        assert req.temperature == 0 and _near_tie(target, prompt, want, out.token_ids), (
            f"request {i} ({case.drafter}, batch {case.batch}, share {case.share}): "
            f"{out.token_ids} != alone {want}")
        ties["ties"] += 1
    ties["examples"] += 1


def _keeps_to_its_request(req: Request, out, lltok) -> None:
    """An unseeded sampled row: any tokens, but within its limit, none past a stop string,
    and every token one its format allows (a finished one parses and validates)."""
    assert 0 < len(out.token_ids) <= req.max_new_tokens, (req.id, out.token_ids)
    assert out.finish_reason in ("stop", "length"), (req.id, out.finish_reason)
    assert not any(s in out.output for s in req.stop), (req.id, out.output, req.stop)
    fmt = req.response_format
    if fmt is None or fmt.type == "text":
        return
    matcher = llguidance.LLMatcher(lltok, grammar(fmt), log_level=0)
    assert matcher.consume_tokens(out.token_ids), (req.id, out.token_ids, matcher.get_error())
    if out.finish_reason == "stop":
        assert_shaped(fmt, out.output)


def _item(req: Request):
    from specq.worker.attempts import ChunkItem

    overrides = req.model_dump(exclude={"id", "prompt", "messages", "prompt_token_ids"})
    messages = None if req.messages is None else [m.model_dump() for m in req.messages]
    return ChunkItem(int(req.id), req.prompt, messages, overrides)
