"""The retention sweep (api/retention.py, db/retention.py) on a fake clock, on SQLite and on a
PostgreSQL database of its own (a sweep two days ahead would empty every other test's
jobs): expired uploads go with their bytes, old results are emptied with their counters
kept (or deleted whole), batch outputs go, in batches of a few rows; what has not expired
stays."""

from __future__ import annotations

from datetime import timedelta, timezone

import pytest
from sqlalchemy import func, select

from specq.api.retention import sweep, upload_expiry
from specq.api.server.uploads import store_path
from specq.configs.settings import Settings
from specq.db import batches as store
from specq.db import repository as repo
from specq.db import retention, tenants
from specq.db.models import Chunk, DeletedFile, File, FilePart, Item, Job, utcnow
from specq.db.session import migrate, session_factory

from ..conftest import fresh_pg_database
from .conftest import counters, done, make_job


@pytest.fixture(params=["sqlite", "postgresql"])
def own_url(request, tmp_path):
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'specq.db'}"
        migrate(url)
        yield url
    else:
        with fresh_pg_database() as url:
            migrate(url)
            yield url


def settings_for(url, tmp_path, **over) -> Settings:
    return Settings(database_url=url, data_dir=tmp_path, broker_url="redis://127.0.0.1:1/0",
                    broker_timeout=0.2, **over)


def batch_of(s, tenant_id: int, job_id: int, name: str, files: str, **columns) -> int:
    """A batch of the job (batch_NAME) with its output and error files (file-outputFILES,
    file-errorFILES); its id."""
    b = store.add_batch(s, openai_id=f"batch_{name}", tenant_id=tenant_id, status="validating",
                        input_file_id="file-in", endpoint="/v1/completions",
                        completion_window="24h", expires_at=utcnow(), **columns)
    store.attach_job(s, batch_id=b.id, job_id=job_id)
    for kind in ("output", "error"):
        store.add_file(s, openai_id=f"file-{kind}{files}", tenant_id=tenant_id, kind=kind,
                       purpose="batch_output", filename=f"{kind}.jsonl", batch_id=b.id)
    return b.id


def test_an_upload_expires_as_it_says_or_by_the_operators_default(tmp_path):
    t0 = utcnow()
    s = Settings(data_dir=tmp_path)
    fields = {"expires_after[anchor]": "created_at", "expires_after[seconds]": "7200"}
    assert upload_expiry(fields, s, t0) == t0 + timedelta(hours=2)
    assert upload_expiry({}, s, t0) is None
    assert upload_expiry({}, s.model_copy(update={"retention_files": 60.0}), t0) == \
        t0 + timedelta(minutes=1)
    for bad, field in (({"expires_after[anchor]": "last_active_at",
                         "expires_after[seconds]": "7200"}, "anchor"),
                       ({"expires_after[anchor]": "created_at",
                         "expires_after[seconds]": "60"}, "seconds"),
                       ({"expires_after[anchor]": "created_at",
                         "expires_after[seconds]": "1.5e4"}, "seconds"),
                       ({"expires_after[anchor]": "created_at",  # fullwidth digits
                         "expires_after[seconds]": "\uff17\uff12\uff10\uff10"}, "seconds"),
                       ({"expires_after[anchor]": "created_at"}, "seconds")):
        with pytest.raises(ValueError, match=f"expires_after.{field}"):
            upload_expiry(bad, s, t0)


def test_expired_files_go_with_their_bytes_and_the_rest_stays(own_url, tmp_path):
    settings = settings_for(own_url, tmp_path, retention_sweep_rows=2)
    sessions = session_factory(own_url)
    now = utcnow()
    settings.files_dir.mkdir(parents=True)
    with sessions.begin() as s:
        tid = tenants.authenticate(s, key=tenants.create_key(s, tenant="t")).tenant_id
        for i in range(5):  # five that expire in an hour, on disk; sweeps of two rows each
            store.add_file(s, openai_id=f"file-old{i}", tenant_id=tid, kind="input",
                           purpose="batch", filename="a.jsonl", bytes=3, lines=1,
                           stored_in="directory", expires_at=now + timedelta(hours=1))
            store_path(settings.files_dir, f"file-old{i}").write_bytes(b"{}\n")
        kept = store.add_file(s, openai_id="file-kept", tenant_id=tid, kind="input",
                              purpose="batch", filename="b.jsonl", bytes=3, lines=1,
                              stored_in="directory")
        store_path(settings.files_dir, "file-kept").write_bytes(b"{}\n")
        parts = store.add_file(s, openai_id="file-parts", tenant_id=tid, kind="input",
                               purpose="batch", filename="c.jsonl", bytes=6, lines=2,
                               stored_in="database", expires_at=now + timedelta(days=2))
        store.add_part(s, file_id=parts.id, part=0, data=b"{}\n{}\n")
    assert sweep(settings, now=now + timedelta(minutes=59)).files == 0
    report = sweep(settings, now=now + timedelta(hours=1, seconds=1))
    assert (report.files, report.file_bytes) == (5, 15)
    with sessions() as s:
        assert set(s.scalars(select(File.openai_id))) == {"file-kept", "file-parts"}
    assert sorted(p.name for p in settings.files_dir.iterdir()) == ["file-kept.jsonl"]
    assert sweep(settings, now=now + timedelta(days=3)).files == 1
    with sessions() as s:
        assert s.scalar(select(func.count()).select_from(FilePart)) == 0
        assert list(s.scalars(select(File.id))) == [kept.id]


def test_old_results_are_emptied_their_counters_kept_and_new_ones_stay(own_url, tmp_path):
    sessions = session_factory(own_url)
    old = make_job(sessions, name="old", n=5, outcomes=[
        done(i, counters([2, 1], 3, 6, [0, 0, 3], 4, 5, 0.1, 0.2), 0.0, 1.0)
        for i in range(5)])
    running = make_job(sessions, name="running", n=2)  # queued: never swept
    with sessions() as s:
        ended = repo.get_job(s, job_id=old.id).finished_at
        before = repo.job_figures(s, job_ids=[old.id])[0]
    settings = settings_for(own_url, tmp_path, retention_results=86400.0,
                            retention_sweep_rows=2)
    assert sweep(settings, now=ended + timedelta(hours=23)).jobs_emptied == 0
    report = sweep(settings, now=ended + timedelta(days=2))
    assert (report.jobs_emptied, report.items_emptied) == (1, 5)
    with sessions() as s:
        items = list(repo.iter_items(s, job_id=old.id))
        after = repo.job_figures(s, job_ids=[old.id])[0]
        assert repo.get_job(s, job_id=old.id).swept_at is not None
        assert all(it.prompt is None and it.output is None for it in
                   repo.iter_items(s, job_id=old.id))
        assert [it.prompt for it in repo.iter_items(s, job_id=running.id)] == ["p0", "p1"]
    assert [it.accepted for it in items] == [3] * 5 and len(items) == 5
    assert {k: after[k] for k in ("completed", "accepted", "proposed", "acceptance_rate")} == \
        {k: before[k] for k in ("completed", "accepted", "proposed", "acceptance_rate")}
    assert sweep(settings, now=ended + timedelta(days=3)).jobs_emptied == 0  # once


def test_without_metrics_kept_an_old_job_and_its_batch_outputs_go_whole(own_url, tmp_path):
    sessions = session_factory(own_url)
    job = make_job(sessions, name="gone", n=3, outcomes=[
        done(i, counters([1], 1, 2, [0, 1], 2, 2, 0.1, 0.1), 0.0, 1.0) for i in range(3)])
    other = make_job(sessions, name="batch-job", n=1, outcomes=[
        done(0, counters([1], 1, 2, [0, 1], 2, 2, 0.1, 0.1), 0.0, 1.0)])
    with sessions.begin() as s:
        tid = tenants.authenticate(s, key=tenants.create_key(s, tenant="b")).tenant_id
        batch_of(s, tid, other.id, "old", files="")
    with sessions() as s:
        ended = max(repo.get_job(s, job_id=j).finished_at for j in (job.id, other.id))
    outputs_only = settings_for(own_url, tmp_path, retention_outputs=3600.0)
    report = sweep(outputs_only, now=ended + timedelta(hours=2))
    assert (report.outputs, report.jobs_emptied) == (2, 1)  # the batch's job only
    with sessions() as s:
        assert s.scalar(select(func.count()).select_from(File)) == 0
        assert repo.get_job(s, job_id=job.id).swept_at is None
    whole = settings_for(own_url, tmp_path, retention_results=60.0,
                         retention_keep_metrics=False, retention_sweep_rows=2)
    report = sweep(whole, now=ended + timedelta(hours=2))
    # the batch's job, emptied by the first sweep (its metrics kept then), goes whole too:
    # without metrics kept, no finished job past its retention stays
    assert (report.jobs_deleted, report.items_deleted) == (2, 4)
    with sessions() as s:
        for gone in (job.id, other.id):
            assert s.get(Job, gone) is None
            assert s.scalar(select(func.count()).select_from(Item)
                            .where(Item.job_id == gone)) == 0
            assert s.scalar(select(func.count()).select_from(Chunk)
                            .where(Chunk.job_id == gone)) == 0
    assert sweep(whole, now=ended + timedelta(hours=3)).jobs_deleted == 0


def test_old_webhook_deliveries_go_once_made_or_given_up(own_url, tmp_path):
    from specq.db import webhooks
    from specq.db.models import WebhookAttempt, WebhookDelivery

    sessions = session_factory(own_url)
    with sessions.begin() as s:
        webhooks.add_endpoint(s, url="http://127.0.0.1:9/", tenant_id=None,
                              allow_private=True, allow_http=True)
    for name in ("a", "b", "c"):
        make_job(sessions, name=name, n=1, cancel=True)  # three job.cancelled events
    with sessions.begin() as s:
        ids = sorted(d.id for d in webhooks.claim_due(s, owner="t", hold=60, limit=10))
        for i, status in zip(ids, ("delivered", "failed")):  # the third stays pending
            webhooks.record(s, delivery_id=i, owner="t", seconds=0.1, backoff=1,
                            backoff_max=1, retry_for=0 if status == "failed" else 9,
                            status_code=200 if status == "delivered" else 500, error=None)
    settings = settings_for(own_url, tmp_path, retention_webhooks=86400.0,
                            retention_sweep_rows=1)
    assert sweep(settings, now=utcnow() + timedelta(hours=23)).deliveries == 0
    assert sweep(settings, now=utcnow() + timedelta(days=2)).deliveries == 2
    with sessions() as s:
        assert list(s.scalars(select(WebhookDelivery.status))) == ["pending"]
        assert s.scalar(select(func.count()).select_from(WebhookAttempt)) == 0


def test_a_batchs_outputs_expire_as_its_create_asked(own_url, tmp_path):
    """output_expires_after: a finished batch's output and error files get expires_at, its
    job's end plus the seconds asked, and go once it passed; another batch's stay."""
    sessions = session_factory(own_url)
    jobs = [make_job(sessions, name=f"b{i}", n=1, outcomes=[
        done(0, counters([1], 1, 2, [0, 1], 2, 2, 0.1, 0.1), 0.0, 1.0)]) for i in range(2)]
    with sessions.begin() as s:
        tid = tenants.authenticate(s, key=tenants.create_key(s, tenant="x")).tenant_id
        for i, (job, asked) in enumerate(zip(jobs, (3600, None))):
            batch_of(s, tid, job.id, str(i), files=str(i), output_expires_after=asked)
    with sessions() as s:
        ended = repo.get_job(s, job_id=jobs[0].id).finished_at
    settings = settings_for(own_url, tmp_path, retention_sweep_rows=1)
    assert sweep(settings, now=ended + timedelta(minutes=59)).outputs == 0
    with sessions() as s:
        expiry = {f.openai_id: f.expires_at for f in s.scalars(select(File))}
    want = ended if ended.tzinfo else ended.replace(tzinfo=timezone.utc)
    for name in ("file-output0", "file-error0"):
        got = expiry[name] if expiry[name].tzinfo else expiry[name].replace(tzinfo=timezone.utc)
        assert got == want + timedelta(hours=1)
    assert expiry["file-output1"] is None and expiry["file-error1"] is None
    report = sweep(settings, now=ended + timedelta(minutes=61))
    assert (report.outputs, report.files) == (2, 0)
    with sessions() as s:
        assert sorted(s.scalars(select(File.openai_id))) == ["file-error1", "file-output1"]


def test_a_batchs_outputs_go_with_its_results(own_url, tmp_path):
    """SPECQ_RETENTION_RESULTS alone (no outputs retention) empties a batch's job too: its
    output and error files, made from those items, go with them rather than be served
    with blank answers."""
    sessions = session_factory(own_url)
    job = make_job(sessions, name="bj", n=2, outcomes=[
        done(i, counters([1], 1, 2, [0, 1], 2, 2, 0.1, 0.1), 0.0, 1.0) for i in range(2)])
    with sessions.begin() as s:
        tid = tenants.authenticate(s, key=tenants.create_key(s, tenant="r")).tenant_id
        batch = batch_of(s, tid, job.id, "r", files="r")
    with sessions() as s:
        ended = repo.get_job(s, job_id=job.id).finished_at
    report = sweep(settings_for(own_url, tmp_path, retention_results=60.0),
                   now=ended + timedelta(hours=1))
    assert (report.jobs_emptied, report.outputs) == (1, 2)
    with sessions() as s:
        assert s.scalar(select(func.count()).select_from(File)
                        .where(File.batch_id == batch)) == 0


def test_bytes_no_row_names_go_once_an_hour_old(own_url, tmp_path):
    """A sweep stopped between a row's deletion and its bytes' (or a server that died
    before an upload's row committed) leaves bytes no row names: the next sweep deletes
    them once they are an hour old; named ones and young ones stay."""
    import os
    import time

    settings = settings_for(own_url, tmp_path)
    settings.files_dir.mkdir(parents=True)
    sessions = session_factory(own_url)
    with sessions.begin() as s:
        tid = tenants.authenticate(s, key=tenants.create_key(s, tenant="s")).tenant_id
        store.add_file(s, openai_id="file-named", tenant_id=tid, kind="input",
                       purpose="batch", filename="a.jsonl", bytes=3, lines=1,
                       stored_in="directory")
    old = time.time() - 7200
    for name in ("file-named", "file-stray", "file-young"):
        store_path(settings.files_dir, name).write_bytes(b"{}\n")
        if name != "file-young":
            os.utime(store_path(settings.files_dir, name), (old, old))
    sweep(settings)
    assert sorted(p.name for p in settings.files_dir.iterdir()) == [
        "file-named.jsonl", "file-young.jsonl"]


def test_a_listing_pages_on_after_its_cursors_file_is_deleted(own_url, tmp_path):
    """The SDKs page with the last id they were given: a loop that deletes every file it
    lists asks for the page after a deleted file. Its place is kept (deleted_files) and
    the listing goes on, newest first or oldest first, until the sweep forgets it."""
    settings = settings_for(own_url, tmp_path, retention_sweep_rows=2)
    sessions = session_factory(own_url)
    with sessions.begin() as s:
        tid = tenants.authenticate(s, key=tenants.create_key(s, tenant="t")).tenant_id
        other = tenants.authenticate(s, key=tenants.create_key(s, tenant="u")).tenant_id
    for ascending, name in ((False, "n"), (True, "a")):
        with sessions.begin() as s:
            for i in range(7):
                store.add_file(s, openai_id=f"file-{name}{i}", tenant_id=tid, kind="input",
                               purpose="batch", filename="a.jsonl", bytes=3, lines=1,
                               stored_in="database")
        seen, after = [], None
        while True:  # what a delete-all loop over the SDK's auto-pagination does
            with sessions.begin() as s:
                page, more = store.list_files(s, tenant_id=tid, after=after, limit=3,
                                              ascending=ascending)
                retention.delete_files(s, file_ids=[f.id for f in page])
            seen += [f.openai_id for f in page]
            if not more:
                break
            after = page[-1].openai_id
        made = [f"file-{name}{i}" for i in range(7)]
        assert seen == (made if ascending else made[::-1])
        with sessions() as s:
            assert store.list_files(s, tenant_id=tid, after=None, limit=3)[0] == []
    with sessions() as s:  # a deleted file's id is its tenant's only
        with pytest.raises(KeyError):
            store.list_files(s, tenant_id=other, after="file-n3", limit=3)
        assert store.list_files(s, tenant_id=tid, after="file-n3", limit=3) == ([], False)
    now = utcnow()
    sweep(settings, now=now + timedelta(seconds=retention.DELETED_FILES_KEPT - 60))
    with sessions() as s:
        assert store.list_files(s, tenant_id=tid, after="file-n3", limit=3) == ([], False)
    sweep(settings, now=now + timedelta(seconds=retention.DELETED_FILES_KEPT + 60))
    with sessions() as s:
        assert s.scalar(select(func.count()).select_from(DeletedFile)) == 0
        with pytest.raises(KeyError):
            store.list_files(s, tenant_id=tid, after="file-n3", limit=3)


def test_two_deletes_of_one_file_at_once_keep_it_once(own_url, tmp_path):
    """A client's retry deleting a file its first request is deleting: the second waits for
    the first, finds no row, and neither fails on the kept id."""
    import threading

    sessions = session_factory(own_url)
    with sessions.begin() as s:
        tid = tenants.authenticate(s, key=tenants.create_key(s, tenant="t")).tenant_id
        f = store.add_file(s, openai_id="file-twice", tenant_id=tid, kind="input",
                           purpose="batch", filename="a.jsonl", bytes=3, lines=1,
                           stored_in="database")
    first = sessions()
    first.begin()
    assert retention.delete_files(first, file_ids=[f.id]) == 1  # its transaction still open
    second: list[int | BaseException] = []

    def delete_again() -> None:
        try:
            with sessions.begin() as s:
                second.append(retention.delete_files(s, file_ids=[f.id]))
        except BaseException as exc:  # noqa: BLE001 (the test reports it)
            second.append(exc)

    thread = threading.Thread(target=delete_again)
    thread.start()
    thread.join(0.5)  # (on PostgreSQL it waits on the row; on SQLite on the write lock)
    first.commit()
    first.close()
    thread.join(60)
    assert second == [0]
    with sessions() as s:
        assert [d.seq for d in s.scalars(select(DeletedFile))] == [f.id]
