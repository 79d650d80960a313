"""Tenants and keys (db/tenants.py) and the tenant checks of db/batches.py, on SQLite and
PostgreSQL."""

from __future__ import annotations

from datetime import timedelta

import pytest
from sqlalchemy import select

from specq.db import batches as store
from specq.db import tenants
from specq.db.models import ApiKey, utcnow


def test_a_key_is_stored_hashed_and_found_until_revoked(sessions):
    with sessions.begin() as s:
        key = tenants.create_key(s, tenant="acme")
        other = tenants.create_key(s, tenant="acme")  # a second key of the same tenant
    assert key.startswith(tenants.KEY_PREFIX) and len(key) > 50 and key != other
    with sessions() as s:
        stored = s.scalars(select(ApiKey.key_hash)).all()
        assert key not in stored and tenants.key_hash(key) in stored
        who = tenants.authenticate(s, key=key)
        assert who.tenant == "acme" and tenants.authenticate(s, key=other).tenant_id == \
            who.tenant_id
        assert tenants.authenticate(s, key=key + "x") is None
        listed = tenants.list_keys(s)
    assert [k.prefix for k in listed if k.tenant == "acme"] == [key[:tenants.SHOWN],
                                                                 other[:tenants.SHOWN]]
    with sessions.begin() as s:
        assert tenants.revoke(s, tenant="acme", prefix=key[:tenants.SHOWN]) == 1
    with sessions() as s:
        assert tenants.authenticate(s, key=key) is None
        assert tenants.authenticate(s, key=other) is not None
    with sessions.begin() as s:
        assert tenants.revoke(s, tenant="acme") == 1
        with pytest.raises(KeyError):
            tenants.revoke(s, tenant="nobody")


def test_a_tenant_reads_only_its_own_files_and_batches(sessions):
    with sessions.begin() as s:
        a = tenants.authenticate(s, key=tenants.create_key(s, tenant="a"))
        b = tenants.authenticate(s, key=tenants.create_key(s, tenant="b"))
        f = store.add_file(s, openai_id="file-x", tenant_id=a.tenant_id, kind="input",
                           purpose="batch", filename="x.jsonl", bytes=3, lines=1)
        made = [store.add_batch(s, openai_id=f"batch_{i}", tenant_id=a.tenant_id,
                                status="validating", input_file_id=f.openai_id,
                                endpoint="/v1/completions", completion_window="24h",
                                expires_at=utcnow() + timedelta(hours=1)) for i in range(3)]
    with sessions() as s:
        assert store.get_file(s, tenant_id=b.tenant_id, openai_id="file-x") is None
        assert store.get_file(s, tenant_id=a.tenant_id, openai_id="file-x").id == f.id
        assert store.get_batch(s, tenant_id=b.tenant_id, openai_id="batch_0") is None
        assert store.list_batches(s, tenant_id=b.tenant_id, after=None, limit=10) == ([], False)
        page, more = store.list_batches(s, tenant_id=a.tenant_id, after=None, limit=2)
        assert [x.openai_id for x in page] == ["batch_2", "batch_1"] and more
        page, more = store.list_batches(s, tenant_id=a.tenant_id, after="batch_1", limit=2)
        assert [x.openai_id for x in page] == ["batch_0"] and not more
        with pytest.raises(KeyError):  # another tenant's id is no place to page from
            store.list_batches(s, tenant_id=b.tenant_id, after="batch_1", limit=2)
        # batches still validating count their input's lines: no job holds them yet
        assert store.unfinished_items(s, tenant_id=a.tenant_id) == 3
        assert store.unfinished_items(s, tenant_id=b.tenant_id) == 0
    assert len(made) == 3
