"""Engine faults in the chunk task, in-process: transient until they repeat, nothing
poisoned, out-of-memory halves the batch, a poison item fails alone after max_attempts,
`retry` sends it back. Faults are injected (bench/faults.py): a CUDA error cannot
happen on this CPU-only machine, so a raised torch.OutOfMemoryError stands in for one."""

from __future__ import annotations

import json

import pytest
from sqlalchemy import select

from specq.api import cli
from specq.bench.faults import FaultPlan, install
from specq.configs.presets import get_preset
from specq.configs.settings import get_settings
from specq.db.models import Item, ItemStatus, JobStatus
from specq.worker.device import DeviceLost
from specq.worker.pairs import load_pair
from specq.worker.tasks import run_chunk, run_inline

PROMPTS = [f"Fix the grammar of sentence {i}: he go to school every days" for i in range(12)]


@pytest.fixture(scope="module")
def fast(settings):
    return settings.model_copy(update={"retry_backoff": 0.05, "retry_backoff_max": 0.2,
                                       "flush_every": 0.1})


@pytest.fixture(scope="module", params=["tiny", "tiny-lookup"])
def engine(request, settings):
    """A draft-model pair and a prompt-lookup pair, batch 8."""
    return request.param, load_pair(get_preset(request.param), settings).engine(max_batch_size=8)


@pytest.fixture
def faults(tmp_path):
    """faults(oom=.., error=.., device=.., poison=..): the engine fails as asked."""
    path = tmp_path / "faults.json"
    version = [0]

    def ask(**plan):
        version[0] += 1
        path.write_text(json.dumps({"version": version[0], **plan}))

    undo = install(FaultPlan(path))
    yield ask
    undo()


def _tokens(client, job):
    with client.sessions() as s:
        return s.execute(select(Item.index, Item.token_ids, Item.status, Item.attempts,
                                Item.writes, Item.error)
                         .where(Item.job_id == job.id).order_by(Item.index)).all()


def _run(client, fast, engine, job):
    pair, eng = engine
    run_inline(sessions=client.sessions, engine=eng, pair=pair, job_id=job.id, progress=False,
               settings=fast)


def test_faults_are_retried_and_leave_the_output_exact(client, fast, engine, faults):
    pair, _ = engine
    clean = client.submit(PROMPTS, pair=pair, enqueue=False, max_new_tokens=12, chunk_size=6)
    _run(client, fast, engine, clean)
    faults(oom=2, error=2)
    faulty = client.submit(PROMPTS, pair=pair, enqueue=False, max_new_tokens=12, chunk_size=6)
    _run(client, fast, engine, faulty)
    after = client.submit(PROMPTS, pair=pair, enqueue=False, max_new_tokens=12, chunk_size=6)
    _run(client, fast, engine, after)  # the next job on the same engine: nothing poisoned

    want = [r.token_ids for r in _tokens(client, clean)]
    for job in (faulty, after):
        rows = _tokens(client, job)
        assert [r.status for r in rows] == [ItemStatus.completed.value] * len(PROMPTS)
        assert [r.token_ids for r in rows] == want  # greedy: exactly the fault-free output
        assert all(r.writes == 1 for r in rows)
        assert job.status(check_workers=False).status == JobStatus.completed.value
    attempts = [r.attempts for r in _tokens(client, faulty)]
    assert sum(attempts) == 2  # each error counted once, against the item it struck
    assert sum(r.attempts for r in _tokens(client, after)) == 0


def test_out_of_memory_halves_the_batch_then_restores_it(client, fast, engine, faults):
    pair, eng = engine
    sizes = []
    generate = eng.generate

    def spy(requests, **kw):
        sizes.append(eng.max_batch_size)
        return generate(requests, **kw)

    eng.generate = spy
    try:
        faults(oom=2)
        job = client.submit(PROMPTS[:8], pair=pair, enqueue=False, max_new_tokens=8,
                            chunk_size=8)
        report = run_chunk(sessions=client.sessions, engine=eng, pair=pair, job_id=job.id,
                           start=0, end=8, hostname="h", settings=fast)
    finally:
        del eng.generate
    assert sizes == [8, 4, 2]  # two out-of-memory errors: 8 -> 4 -> 2 rows
    assert eng.max_batch_size == 8  # restored for the next chunk
    assert (report.written, report.failed, report.faults) == (8, 0, 2)
    assert all(r.attempts == 0 and r.status == "completed" for r in _tokens(client, job))


def test_a_poison_item_fails_alone_after_max_attempts_and_retry_sends_it_back(
        client, fast, engine, faults, monkeypatch, env_for, capsys):
    pair, _ = engine
    prompts = list(PROMPTS[:7])
    prompts[3] = "POISON in this prompt makes every step fail"
    faults(poison="POISON")
    job = client.submit(prompts, pair=pair, enqueue=False, max_new_tokens=8, chunk_size=7)
    _run(client, fast, engine, job)
    rows = _tokens(client, job)
    assert [r.status for r in rows] == ["completed"] * 3 + ["failed"] + ["completed"] * 3
    assert rows[3].attempts == fast.max_attempts == 3
    assert "injected fault (poison)" in rows[3].error
    assert all(r.attempts <= 1 for r in rows[:3] + rows[4:])  # batch-mates ran on, alone
    state = job.status(check_workers=False)
    assert (state.status, state.completed, state.failed) == ("completed", 6, 1)
    before = [r.token_ids for r in rows]

    # `specq retry JOB`: the failed item goes back to pending, its attempts kept
    for k, v in env_for(client.settings).items():
        monkeypatch.setenv(k, v)
    get_settings.cache_clear()
    try:
        assert cli.main(["retry", str(job.id)]) == 0
    finally:
        get_settings.cache_clear()
    assert "1 failed items back to pending" in capsys.readouterr().err
    state = job.status(check_workers=False)
    assert (state.status, state.pending, state.failed, state.completed) == (
        "in_progress", 1, 0, 6)
    assert _tokens(client, job)[3].attempts == 3
    _run(client, fast, engine, job)  # still poisoned: fails again after 3 more attempts
    rows = _tokens(client, job)
    assert (rows[3].status, rows[3].attempts, rows[3].writes) == ("failed", 6, 1)
    assert job.status(check_workers=False).status == "completed"
    assert [r.token_ids for r in rows] == before  # the others were not generated again


def test_a_lost_device_is_raised_after_finished_outcomes_are_written(client, fast, engine,
                                                                      faults):
    pair, eng = engine
    job = client.submit(PROMPTS[:4], pair=pair, enqueue=False, max_new_tokens=6, chunk_size=4)
    faults(device=1)
    with pytest.raises(DeviceLost):
        run_chunk(sessions=client.sessions, engine=eng, pair=pair, job_id=job.id, start=0,
                  end=4, hostname="h", settings=fast)
    rows = _tokens(client, job)
    assert all(r.status == "pending" and r.attempts == 0 for r in rows)  # nothing failed
    report = run_chunk(sessions=client.sessions, engine=eng, pair=pair, job_id=job.id,
                       start=0, end=4, hostname="h2", settings=fast)  # its lease was released
    assert (report.written, report.job_status) == (4, "completed")


def test_a_poison_that_loses_the_device_fails_alone_across_restarts(client, fast, engine,
                                                                    faults):
    """An input whose batch loses the device (a CUDA illegal access on one prompt): each
    run raises DeviceLost (the worker would exit for its supervisor). The items in flight
    count a crash; alone, the culprit counts attempts until it fails, with an error that
    says how many workers it crashed; every batch-mate completes, each written once."""
    pair, eng = engine
    prompts = list(PROMPTS[:6])
    prompts[2] = "POISON that loses the device"
    faults(poison="POISON", poison_kind="device")
    job = client.submit(prompts, pair=pair, enqueue=False, max_new_tokens=6, chunk_size=6)
    lost = 0
    for run in range(10):  # each run stands for a restarted worker
        try:
            report = run_chunk(sessions=client.sessions, engine=eng, pair=pair, job_id=job.id,
                               start=0, end=6, hostname=f"h{run}", settings=fast)
        except DeviceLost:
            lost += 1
            continue
        break
    assert report.job_status == "completed"
    rows = _tokens(client, job)
    assert [r.status for r in rows] == ["completed"] * 2 + ["failed"] + ["completed"] * 3
    assert all(r.writes == 1 for r in rows)
    assert lost == 1 + fast.max_attempts  # once in the batch, then alone until it fails
    assert rows[2].error.startswith(f"killed or crashed its worker {lost} times (last alone")
    assert "illegal memory access" in rows[2].error
    state = job.status(check_workers=False)
    assert (state.engine_faults, state.items_isolated) == (lost, len(prompts) - 1)


SYSTEMS = ["You rewrite product descriptions for a catalogue in plain words.",
           "You are a support agent: answer the customer's ticket politely.",
           "Extract the city and the name from the sentence, as JSON.",
           "Write one quiz question about the topic, with four options."]


def test_a_job_over_four_shared_system_prompts_runs_whole_batches_and_exact(client, fast,
                                                                            engine):
    """64 chat prompts over four system prompts, through the job path: no fault, no item
    alone, every step of the batch full while work waits, prefixes shared, and each output
    the target's own greedy output for that prompt alone."""
    from specq.worker.engine.drafters import NoDraft
    from specq.worker.engine.speculative import SpeculativeEngine

    pair, eng = engine
    lines = [{"messages": [{"role": "system", "content": SYSTEMS[i % 4]},
                           {"role": "user", "content": f"item {i}: a {['red', 'big'][i % 2]} "
                                                       f"chair from {i * 7 % 13}"}]}
             for i in range(64)]
    job = client.submit(lines, pair=pair, enqueue=False, max_new_tokens=6, chunk_size=64)
    rows_per_step: list[int] = []
    eng.on_step = lambda step: rows_per_step.append(len(step.accepted))
    served = eng.prefixes.served
    try:
        _run(client, fast, engine, job)
    finally:
        eng.on_step = None
    state = job.status(check_workers=False)
    assert (state.completed, state.engine_faults, state.items_isolated) == (64, 0, 0)
    assert eng.prefixes.served > served  # the system prompts were prefilled once each
    # the batch stays full (refills wait for admit_group free rows; a lone one for a second
    # while a row is sure to end within a few steps) until the queue runs dry; then it only
    # drains
    floor = eng.max_batch_size - max(eng.admit_group, 2) + 1
    full = next((k for k, n in enumerate(rows_per_step) if n < floor), len(rows_per_step))
    assert full >= len(rows_per_step) - 8, rows_per_step
    assert sorted(rows_per_step[full:], reverse=True) == rows_per_step[full:], rows_per_step
    alone = SpeculativeEngine(eng.target, eng.tokenizer, NoDraft(), max_batch_size=1,
                              share_prefixes=False)
    from specq.schema.generation import Request

    want = [alone.generate([Request(id=i, max_new_tokens=6, **line)])[0].token_ids
            for i, line in enumerate(lines)]
    assert [r.token_ids for r in _tokens(client, job)] == want
