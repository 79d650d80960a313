"""The engine's time profile (worker/engine/profile.py): every second of generate in one
phase, the phases adding up to the loop's wall time, a caller's callback kept apart."""

from __future__ import annotations

import time

import pytest

from specq.worker.engine import profile as profile_mod
from specq.worker.engine.drafters import DraftModel
from specq.worker.engine.profile import PHASES, Profile, Stopwatch
from specq.worker.engine.speculative import SpeculativeEngine


class FakeClock:
    """perf_counter that moves only when told."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture()
def clock(monkeypatch):
    fake = FakeClock()
    monkeypatch.setattr(profile_mod.time, "perf_counter", fake)
    return fake


def test_phases_book_each_second_once_to_the_innermost_and_add_up_to_the_loop(clock):
    p = Profile()
    with p.phase("verify"):  # outside a loop: nothing (a calibration's passes)
        clock.now += 7
    with p.loop():
        clock.now += 1  # the loop's own: host
        with p.phase("propose"):
            clock.now += 2
            with p.phase("mask"):  # nested: its seconds are its own, not propose's
                clock.now += 3
            clock.now += 1
        with p.phase("verify"):
            clock.now += 4
        with p.phase("verify"):
            clock.now += 1
    clock.now += 50
    with p.phase("host"):  # after the loop: nothing
        clock.now += 1
    assert p.seconds["propose"] == 3 and p.seconds["mask"] == 3
    assert p.seconds["verify"] == 5 and p.seconds["host"] == 1
    assert p.total() == 12  # the loop's span, each second once
    assert p.shares()["verify"] == pytest.approx(5 / 12)


def test_a_phase_left_by_an_exception_still_books_its_seconds(clock):
    p = Profile()
    with pytest.raises(RuntimeError), p.loop(), p.phase("accept"):
        clock.now += 2
        raise RuntimeError("the step failed")
    assert p.seconds["accept"] == 2 and p.total() == 2
    with p.phase("accept"):  # the loop ended with it
        clock.now += 5
    assert p.total() == 2


def test_a_stopwatch_counts_nested_blocks_once_and_paused_blocks_not_at_all(clock):
    watch = Stopwatch()
    with watch:
        clock.now += 1
        with watch:  # inside another block: counted by the outer one
            clock.now += 2
            with watch.paused():  # work on another's behalf
                clock.now += 10
        clock.now += 1
    clock.now += 100  # outside every block
    with watch.paused():  # outside a block: nothing to leave out
        clock.now += 1
    with watch:
        clock.now += 3
    assert watch.seconds == 7
    watch.reset()
    assert watch.seconds == 0


def test_generate_books_every_phase_and_the_callback_apart(tiny_models, tiny_tokenizer,
                                                           make_requests):
    engine = SpeculativeEngine(tiny_models["target"], tiny_tokenizer,
                               DraftModel(tiny_models["near"]), max_batch_size=4,
                               draft_length=3, adaptive=False)
    requests = make_requests(10, seed=3, max_new=24)
    pause = 0.02

    def on_result(_result) -> None:
        time.sleep(pause)

    t0 = time.perf_counter()
    engine.generate(requests, on_result=on_result)
    wall = time.perf_counter() - t0
    seconds = engine.profile.seconds
    assert set(seconds) == set(PHASES)
    for phase in ("admit", "propose", "verify", "accept", "upkeep", "host"):
        assert seconds[phase] > 0, phase
    # sleep lasts at least its time, so the callbacks' phase holds at least this much
    assert seconds["results"] >= pause * len(requests)
    assert engine.profile.total() <= wall  # the phases are inside generate's wall time
    # a second generate adds to the same profile; reset starts again
    before = engine.profile.total()
    engine.generate(requests[:2])
    assert engine.profile.total() > before
    engine.profile.reset()
    assert engine.profile.total() == 0
