"""A run told to stop (its lease given up or lost, its job cancelled) stops generating
within one engine step, not when its batch's next item ends: the device does no work that
the run's writes could no longer keep (worker/attempts.py)."""

from __future__ import annotations

import pytest

from specq.configs.settings import Settings
from specq.worker.attempts import ChunkItem, Stopped, generate_with_retries
from specq.worker.engine.drafters import PromptLookup
from specq.worker.engine.speculative import SpeculativeEngine


class TellingRun:
    """A run whose keeper gives the lease up after ``steps`` engine steps."""

    def __init__(self, steps: int) -> None:
        self.steps, self.seen, self.outcomes = steps, 0, []

    def step(self, _step) -> None:  # the engine's on_step
        self.seen += 1

    def should_stop(self) -> bool:
        return self.seen >= self.steps

    def put(self, outcome) -> None:
        self.outcomes.append(outcome)

    def launch(self, indices: list[int], generation: int) -> None: ...

    def failed(self, indices, error, generation=None) -> None:
        raise AssertionError(error)

    def out_of_memory(self, error: str) -> None: ...

    def crashed(self, indices, why: str) -> None:
        raise AssertionError(why)


def test_a_run_told_to_stop_stops_within_a_step(tiny_models, tiny_tokenizer):
    engine = SpeculativeEngine(tiny_models["target"], tiny_tokenizer, PromptLookup(),
                               max_batch_size=4, adaptive=False)
    run = TellingRun(steps=3)
    engine.on_step = run.step
    items = [ChunkItem(index=i, prompt=f"a long story {i}", messages=None,
                       params={"max_new_tokens": 200}) for i in range(3)]
    with pytest.raises(Stopped):
        generate_with_retries(engine, items, {}, "test", run, Settings())
    assert run.seen == 3 and run.outcomes == []  # no fourth step, nothing ended
