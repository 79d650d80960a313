"""The engine's time profile (worker/engine/profile.py): every second of generate in one
phase, the phases adding up to the loop's wall time, a caller's callback kept apart."""

from __future__ import annotations

import time

import pytest

from specq.worker.engine import profile as profile_mod
from specq.worker.engine.drafters import DraftModel
from specq.worker.engine.profile import PHASES, Profile
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


def test_laps_book_each_interval_once_and_add_up_to_the_span(clock):
    p = Profile()
    p.lap("verify")  # before start: nothing (a calibration's steps)
    p.start()
    clock.now += 2
    p.lap("propose")
    clock.now += 3
    p.lap("verify")
    clock.now += 1
    p.lap("verify")
    p.stop()
    clock.now += 50
    p.lap("host")  # after stop: nothing
    assert p.seconds["propose"] == 2 and p.seconds["verify"] == 4
    assert p.total() == 6 and p.seconds["host"] == 0
    assert p.shares()["verify"] == pytest.approx(4 / 6)


def test_an_aside_books_its_block_and_leaves_it_out_of_the_lap_around_it(clock):
    p = Profile()
    p.start()
    clock.now += 1
    with p.aside("results"):
        clock.now += 5
    clock.now += 1
    p.lap("upkeep")
    assert p.seconds["results"] == 5 and p.seconds["upkeep"] == 2
    assert p.total() == 7  # the span from start to the lap, each second once


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
    assert engine.profile.total() <= wall  # the laps are inside generate's wall time
    # a second generate adds to the same profile; reset starts again
    before = engine.profile.total()
    engine.generate(requests[:2])
    assert engine.profile.total() > before
    engine.profile.reset()
    assert engine.profile.total() == 0
