"""The replay (bench/replay.py): a run stepped again from the target's greedy outputs, each
pass priced by a given price. Real tiny target and suffix drafter; no timing is measured."""

from __future__ import annotations

import pytest
import torch

from specq.bench.replay import (
    BUDGET,
    LEVEL,
    LIMIT,
    ORACLE,
    RATE,
    Price,
    Replayed,
    greedy_outputs,
    plain_run,
    replay,
)
from specq.worker.engine.suffix import SuffixDrafter

MAX_G = 6
PRICE = Price(plain=0.1, per_token=0.002, per_column=0.001)


def _job(seed: int, model, tokenizer) -> tuple[list[list[int]], list[list[int]]]:
    """12 prompts of a repeated random chunk, drawn from ``seed``, and their greedy outputs
    at batch 4."""
    gen = torch.Generator().manual_seed(seed)
    prompts = []
    for _ in range(12):
        base = torch.randint(3, 259, (int(torch.randint(3, 9, (1,), generator=gen)),),
                             generator=gen).tolist()
        prompts.append(base * 4)
    return prompts, greedy_outputs(model, tokenizer, prompts, 24, 4)


@pytest.fixture(scope="module")
def job(tiny_models, tiny_tokenizer):
    """12 prompts of a repeated chunk (prompt lookup and the job index find something),
    and the target's greedy outputs at batch 4."""
    return _job(3, tiny_models["target"], tiny_tokenizer)


def test_plain_decoding_is_a_pass_a_token_a_row(job):
    prompts, outputs = job
    r = replay(prompts, outputs, 4, SuffixDrafter, 0, PRICE)
    assert (r.carried, r.accepted) == (0, 0)
    assert r.seconds == pytest.approx(r.passes * PRICE.plain)
    # every row emits one token a pass after its first (the prefill's); four rows a pass
    after_first = sum(len(o) - 1 for o in outputs)
    assert -(-after_first // 4) <= r.passes <= after_first


def test_the_oracle_keeps_exactly_what_survives_and_saves_passes(job):
    prompts, outputs = job
    plain = replay(prompts, outputs, 4, SuffixDrafter, 0, PRICE)
    oracle = replay(prompts, outputs, 4, SuffixDrafter, ORACLE, PRICE, MAX_G)
    assert oracle.carried == oracle.accepted > 0
    assert oracle.passes < plain.passes
    assert oracle.seconds < plain.seconds


def test_the_budget_keeps_every_draft_when_drafts_are_free_and_none_when_dear(job):
    prompts, outputs = job
    every = replay(prompts, outputs, 4, SuffixDrafter, MAX_G, PRICE, MAX_G)
    free = replay(prompts, outputs, 4, SuffixDrafter, BUDGET,
                  Price(0.1, 0.0, per_row=0.01, batch=4), MAX_G)
    assert (free.passes, free.carried, free.accepted) == (every.passes, every.carried,
                                                          every.accepted)
    assert free.accepted < free.carried  # some drafts are wrong: the budget is not an oracle
    plain = replay(prompts, outputs, 4, SuffixDrafter, 0, PRICE)
    dear = replay(prompts, outputs, 4, SuffixDrafter, BUDGET, Price(0.1, 1.0), MAX_G)
    assert (dear.passes, dear.carried) == (plain.passes, 0)
    assert dear.seconds == pytest.approx(plain.seconds)


def test_a_plain_run_gives_its_outputs_and_the_prefill_within_its_wall_time(
        job, tiny_models, tiny_tokenizer):
    """What ``x run`` adds to both sides: the prefill a plain run of the prompts spent,
    part of the run's wall time; the outputs are the greedy ones the replay steps."""
    prompts, outputs = job
    again, prefill, wall = plain_run(tiny_models["target"], tiny_tokenizer, prompts, 24, 4)
    assert again == outputs
    assert 0 < prefill < wall


def test_a_draining_batch_verifies_less_for_the_time_it_saves(tiny_models, tiny_tokenizer):
    """Once no prompt waits, the budget (budget.drain) keeps only what takes time off the
    rest of the job: fewer drafts carried than at tokens per second to the end (RATE), for
    no more priced seconds, over several jobs. (One job of 12 short rows is a few lucky or
    unlucky drafts from either side: the drain keeps the longest row's drafts for the step
    they may save, a bet that pays in expectation, not in every job.)"""
    price = Price(0.1, 0.004, 0.001, 0.002, per_row=0.006, batch=4)
    carried = {RATE: 0, BUDGET: 0}
    seconds = {RATE: 0.0, BUDGET: 0.0}
    for seed in range(3, 9):
        prompts, outputs = _job(seed, tiny_models["target"], tiny_tokenizer)
        for keep in (RATE, BUDGET):
            r = replay(prompts, outputs, 4, SuffixDrafter, keep, price, MAX_G)
            carried[keep] += r.carried
            seconds[keep] += r.seconds
    assert carried[BUDGET] < carried[RATE]
    assert seconds[BUDGET] <= seconds[RATE]


def test_the_drain_told_limits_or_a_level_end_replays_the_true_ends_where_they_are_so(job):
    """LIMIT tells the drain each row's limit as its end, LEVEL every row as long as the
    longest: where the outputs all run to their limit, LIMIT is the drain told the truth
    (BUDGET), pass for pass; where they also start together (a batch as large as the job),
    so is LEVEL."""
    prompts, outputs = job
    long = [(p, o[:12]) for p, o in zip(prompts, outputs) if len(o) >= 12]
    assert len(long) >= 8
    prompts, cut = [p for p, _ in long], [o for _, o in long]
    price = Price(0.1, 0.001, 0.0005, per_row=0.002, batch=4)
    truth = replay(prompts, cut, 4, SuffixDrafter, BUDGET, price, MAX_G, limit=12)
    assert truth.carried > 0
    assert replay(prompts, cut, 4, SuffixDrafter, LIMIT, price, MAX_G, limit=12) == (
        Replayed(LIMIT, truth.passes, truth.seconds, truth.carried, truth.accepted))
    B = len(prompts)
    whole = Price(0.1, 0.001, 0.0005, per_row=0.002, batch=B)
    truth = replay(prompts, cut, B, SuffixDrafter, BUDGET, whole, MAX_G, limit=12)
    level = replay(prompts, cut, B, SuffixDrafter, LEVEL, whole, MAX_G, limit=12)
    assert (level.passes, level.seconds, level.carried) == (truth.passes, truth.seconds,
                                                            truth.carried)
