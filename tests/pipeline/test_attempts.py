"""Engine faults in the chunk task, in-process: transient until they repeat, nothing
poisoned, out-of-memory halves the batch, a poison item fails alone after max_attempts,
`retry` sends it back. Faults are injected (worker/bench/faults.py): a CUDA error cannot
happen on this CPU-only machine, so a raised torch.OutOfMemoryError stands in for one."""

from __future__ import annotations

import json

import pytest
from sqlalchemy import select

from specq.api import cli
from specq.configs.presets import get_preset
from specq.configs.settings import get_settings
from specq.db.models import Item, ItemStatus, JobStatus
from specq.worker.bench.faults import FaultPlan, install
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
