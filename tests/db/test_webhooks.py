"""Webhook endpoints and the outbox (db/webhooks.py), on SQLite and PostgreSQL: events are
written in the transaction that ends a batch or a job, for the endpoints that want them,
and the official openai SDK verifies what specq signs. Refused targets:
schema/addresses.py."""

from __future__ import annotations

import json
import time
from datetime import timedelta

import pytest
from sqlalchemy import func, select

from specq.broker.webhooks import headers
from specq.db import batches as store
from specq.db import repository as repo
from specq.db import tenants, webhooks
from specq.db.models import ItemStatus, JobStatus, WebhookDelivery, utcnow
from specq.db.outcomes import Outcome
from specq.schema.addresses import TargetError, check_url

from .conftest import make_job

LOCAL = {"allow_private": True, "allow_http": True}


@pytest.mark.parametrize("url", [
    "https://127.0.0.1/hook", "https://localhost:8443/", "https://10.1.2.3/", "https://[::1]/",
    "https://169.254.169.254/latest/meta-data", "https://192.168.0.7/", "https://100.64.0.1/",
    "https://[::ffff:127.0.0.1]/", "https://2130706433/", "https://0x7f.1/", "https://0.0.0.0/",
    "https://224.0.0.1/",
    # IPv6 forms carrying a private IPv4 address: NAT64, 6to4, IPv4-compatible and
    # -translated; NAT64's local-use prefix
    "https://[64:ff9b::7f00:1]/", "https://[2002:7f00:1::]/", "https://[::7f00:1]/",
    "https://[::ffff:0:a00:5]/", "https://[64:ff9b:1::808:808]/",
])
def test_a_private_or_loopback_target_is_refused_unless_the_operator_allows_it(url):
    with pytest.raises(TargetError, match="non-public|does not resolve"):
        check_url(url)
    if "0x7f" not in url and "224." not in url:  # (names the resolver may not read)
        check_url(url, allow_private=True)


@pytest.mark.parametrize("url, why", [
    ("http://93.184.216.34/", "must be https"), ("ftp://93.184.216.34/", "scheme"),
    ("https://user:pw@93.184.216.34/", "user or password"), ("https:///nohost", "no host"),
    ("https://93.184.216.34/a b", "spaces"), ("", "empty"), ("https://x/" + "a" * 2000, "longer"),
    ("https://93.184.216.34:99999/", "not a URL"), ("https://93.184.216.34/#x", "fragment"),
])
def test_a_malformed_target_is_refused_naming_why(url, why):
    with pytest.raises(TargetError, match=why):
        check_url(url)


def test_a_public_address_is_taken():
    for carried in ("[64:ff9b::5db8:d822]", "[2002:5db8:d822::]"):  # 93.184.216.34 within
        assert check_url(f"https://{carried}/").port == 443
    target = check_url("https://93.184.216.34:8443/hooks?x=1")
    assert (target.host, target.port, target.path) == ("93.184.216.34", 8443, "/hooks?x=1")
    assert check_url("http://93.184.216.34/", allow_http=True).port == 80


def test_an_endpoint_shows_its_secret_once_and_is_refused_a_bad_url(sessions):
    with sessions.begin() as s:
        tenants.create_key(s, tenant="hooked")
        tid = webhooks.tenant_id_of(s, tenant="hooked")
        info, secret = webhooks.add_endpoint(s, url="http://127.0.0.1:9/h", tenant_id=tid,
                                             name="mine", **LOCAL)
        with pytest.raises(TargetError):
            webhooks.add_endpoint(s, url="http://127.0.0.1:9/h", tenant_id=tid)
        with pytest.raises(ValueError, match="job.completed"):
            webhooks.add_endpoint(s, url="http://127.0.0.1:9/h", tenant_id=tid,
                                  event_types=["job.completed"], **LOCAL)
        with pytest.raises(KeyError, match="nobody"):
            webhooks.tenant_id_of(s, tenant="nobody")
    assert secret.startswith("whsec_") and len(secret) > 40
    assert info.event_types == list(webhooks.BATCH_EVENTS) and info.tenant == "hooked"
    with sessions() as s:
        listed, more = webhooks.list_endpoints(s, tenant_id=tid)
    assert [e.id for e in listed] == [info.id] and not more
    assert secret not in json.dumps(listed[0].as_object()) and listed[0].secret_hint.endswith(
        "...")
    with sessions.begin() as s:
        assert not webhooks.remove_endpoint(s, openai_id=info.id, tenant_id=tid + 1000)
        assert webhooks.remove_endpoint(s, openai_id=info.id, tenant_id=tid)
        assert webhooks.get_endpoint(s, openai_id=info.id) is None


def _bodies(sessions, **where) -> list[dict]:
    with sessions() as s:
        stmt = select(WebhookDelivery.body).order_by(WebhookDelivery.id)
        for k, v in where.items():
            stmt = stmt.where(getattr(WebhookDelivery, k) == v)
        return [json.loads(b) for b in s.scalars(stmt)]


def _operator(sessions, **kw):
    with sessions.begin() as s:
        info, secret = webhooks.add_endpoint(s, url="http://127.0.0.1:9/ops", tenant_id=None,
                                             **LOCAL, **kw)
    return info, secret


def test_a_job_that_ends_writes_its_event_in_the_same_transaction(sessions):
    with sessions() as s:
        before = s.scalar(select(func.count()).select_from(WebhookDelivery))
    quiet = make_job(sessions, name="nobody-listens", n=2, outcomes=[
        Outcome(i, ItemStatus.completed, output="x") for i in range(2)])
    with sessions() as s:  # no endpoint yet: nothing stored
        assert s.scalar(select(func.count()).select_from(WebhookDelivery)) == before
    info, _ = _operator(sessions, event_types=["job.completed", "job.cancelled"])
    try:
        job = make_job(sessions, name="told", n=3, schedule="nightly", outcomes=[
            Outcome(0, ItemStatus.completed, output="a"), Outcome(1, ItemStatus.completed,
                                                                  output="b"),
            Outcome.failure(2, "boom")])
        assert job.status == JobStatus.completed
        # a settling rolled back takes its event with it; a second settling writes none
        late = make_job(sessions, name="late", n=1)
        with sessions.begin() as s:
            repo.start_job(s, job_id=late.id)
            repo.write_outcomes(s, job_id=late.id, outcomes=[
                Outcome(0, ItemStatus.completed, output="z")])
        s = sessions()
        repo.settle_job(s, job_id=late.id)
        assert s.scalar(select(func.count()).select_from(WebhookDelivery)
                        .where(WebhookDelivery.body.contains(f'"id":{late.id},'))) == 1
        s.rollback()
        s.close()
        with sessions.begin() as s:
            assert repo.settle_job(s, job_id=late.id) == JobStatus.completed
        with sessions.begin() as s:
            assert repo.settle_job(s, job_id=late.id) == JobStatus.completed
        cancelled = make_job(sessions, name="stopped", n=2, cancel=True)
        bodies = _bodies(sessions, type="job.completed") + _bodies(sessions, type="job.cancelled")
        mine = {b["data"]["id"]: b for b in bodies if b["data"]["id"] in
                (job.id, late.id, cancelled.id, quiet.id)}
        assert sorted(mine) == sorted([job.id, late.id, cancelled.id])
        told = mine[job.id]
        assert told["type"] == "job.completed" and told["object"] == "event"
        assert told["id"].startswith("evt_") and told["data"]["request_counts"] == {
            "total": 3, "pending": 0, "completed": 2, "failed": 1, "cancelled": 0}
        assert told["data"]["synthesis"] == {"spec": "spec", "schedule": "nightly"}
        assert mine[cancelled.id]["data"]["status"] == "cancelled"
        assert len([b for b in bodies if b["data"]["id"] == late.id]) == 1
    finally:
        with sessions.begin() as s:
            webhooks.remove_endpoint(s, openai_id=info.id)


def _batch(sessions, tenant_id: int, name: str, job_id: int | None, **columns):
    with sessions.begin() as s:
        b = store.add_batch(s, openai_id=f"batch_{name}", tenant_id=tenant_id,
                            status="validating", input_file_id="file-x",
                            endpoint="/v1/completions", completion_window="24h",
                            expires_at=utcnow() + timedelta(hours=1), metadata_={"k": name},
                            **columns)
        if job_id is not None:
            store.attach_job(s, batch_id=b.id, job_id=job_id)
        return b.id


def test_batch_events_reach_their_tenant_and_the_openai_sdk_verifies_them(sessions):
    openai = pytest.importorskip("openai")
    with sessions.begin() as s:
        tenants.create_key(s, tenant="sdk")
        tenants.create_key(s, tenant="other")
        tid = webhooks.tenant_id_of(s, tenant="sdk")
        other = webhooks.tenant_id_of(s, tenant="other")
        ep, secret = webhooks.add_endpoint(s, url="http://127.0.0.1:9/sdk", tenant_id=tid,
                                           **LOCAL)
        elsewhere, _ = webhooks.add_endpoint(s, url="http://127.0.0.1:9/o", tenant_id=other,
                                             **LOCAL)
    try:
        done = make_job(sessions, name="b-done", n=2)
        _batch(sessions, tid, "done", done.id)
        with sessions.begin() as s:
            repo.start_job(s, job_id=done.id)
            repo.write_outcomes(s, job_id=done.id, outcomes=[
                Outcome(0, ItemStatus.completed, output="a"), Outcome.failure(1, "bad")])
            repo.settle_job(s, job_id=done.id)
        expired = make_job(sessions, name="b-expired", n=2)
        expired_id = _batch(sessions, tid, "expired", expired.id)
        with sessions.begin() as s:  # the window ends (api/server/batches.py: expire)
            assert store.mark(s, batch_id=expired_id, column="expired_at")
            repo.request_cancel(s, job_id=expired.id)
        stopped = make_job(sessions, name="b-stopped", n=1)
        _batch(sessions, tid, "stopped", stopped.id)
        with sessions.begin() as s:
            repo.request_cancel(s, job_id=stopped.id)
        failed_id = _batch(sessions, tid, "failed", None)
        with sessions.begin() as s:
            store.fail_batch(s, batch_id=failed_id, errors=[{"line": 3, "message": "no"}])
        early = make_job(sessions, name="b-early", n=1, outcomes=[
            Outcome(0, ItemStatus.completed, output="quick")])  # ends before its batch knows
        _batch(sessions, tid, "early", early.id)
        got = {b["data"]["id"]: b for b in _bodies(sessions)
               if b["data"].get("id", "") in ("batch_done", "batch_expired", "batch_stopped",
                                              "batch_failed", "batch_early")}
        assert {k: v["type"] for k, v in got.items()} == {
            "batch_done": "batch.completed", "batch_expired": "batch.expired",
            "batch_stopped": "batch.cancelled", "batch_failed": "batch.failed",
            "batch_early": "batch.completed"}
        data = got["batch_done"]["data"]
        assert data["request_counts"] == {"total": 2, "completed": 1, "failed": 1}
        assert data["metadata"] == {"k": "done"} and data["specq"]["job_id"] == done.id
        assert got["batch_failed"]["data"]["errors"] == [{"line": 3, "message": "no"}]
        with sessions() as s:  # the other tenant's endpoint was told nothing
            endpoint_of = dict(s.execute(select(WebhookDelivery.event_id,
                                                WebhookDelivery.endpoint_id)).all())
            ids = {e.id: e for e in webhooks.list_endpoints(s)[0]}
        assert ids[elsewhere.id].deliveries["pending"] == 0
        assert ids[ep.id].deliveries["pending"] >= 5
        assert len({endpoint_of[b["id"]] for b in got.values()}) == 1

        # what a sender posts, the openai SDK unwraps with the endpoint's secret
        with sessions() as s:
            body = s.scalar(select(WebhookDelivery.body)
                            .where(WebhookDelivery.event_id == got["batch_done"]["id"]))
        sdk = openai.OpenAI(api_key="unused", webhook_secret=secret)
        event = sdk.webhooks.unwrap(body, headers(secret, got["batch_done"]["id"], body))
        assert type(event).__name__ == "BatchCompletedWebhookEvent"
        assert event.data.id == "batch_done" and event.id == got["batch_done"]["id"]
        with pytest.raises(openai.InvalidWebhookSignatureError):
            sdk.webhooks.verify_signature(body.replace("batch_done", "batch_xxxx"),
                                          headers(secret, got["batch_done"]["id"], body))
        with pytest.raises(openai.InvalidWebhookSignatureError):  # another endpoint's secret
            sdk.webhooks.verify_signature(body, headers(webhooks.new_secret(),
                                                        got["batch_done"]["id"], body))
    finally:
        with sessions.begin() as s:
            webhooks.remove_endpoint(s, openai_id=ep.id)
            webhooks.remove_endpoint(s, openai_id=elsewhere.id)


def test_a_rotated_secret_signs_alone_or_beside_the_old_one_for_a_while(sessions):
    openai = pytest.importorskip("openai")
    info, old = _operator(sessions)
    try:
        with sessions.begin() as s:
            assert webhooks.update_endpoint(s, openai_id=info.id, name="renamed",
                                            event_types=["job.cancelled"]).name == "renamed"
            with pytest.raises(TargetError):
                webhooks.update_endpoint(s, openai_id=info.id, url="https://10.0.0.1/")
            _, kept = webhooks.rotate_secret(s, openai_id=info.id, keep_old_for=3600)
        make_job(sessions, name="rotated", n=1, cancel=True)
        sdk = openai.OpenAI(api_key="unused")

        def signed_with(**candidates: str) -> dict[str, bool]:
            time.sleep(0.01)  # the last claim's lease (1 ms) has run out
            with sessions.begin() as s:
                (due,) = [d for d in webhooks.claim_due(s, owner="t", hold=0.001, limit=100)
                          if d.url.endswith("/ops")]
            head = headers(due.secrets, due.event_id, due.body)
            ok = {}
            for name, secret in candidates.items():
                try:
                    sdk.webhooks.verify_signature(due.body, head, secret=secret)
                    ok[name] = True
                except openai.InvalidWebhookSignatureError:
                    ok[name] = False
            return ok

        assert signed_with(old=old, kept=kept) == {"old": True, "kept": True}
        with sessions.begin() as s:
            _, new = webhooks.rotate_secret(s, openai_id=info.id)  # the old ones dropped now
        assert signed_with(old=old, kept=kept, new=new) == {"old": False, "kept": False,
                                                           "new": True}
    finally:
        with sessions.begin() as s:
            webhooks.remove_endpoint(s, openai_id=info.id)
