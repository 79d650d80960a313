"""Tenants and their API keys: who may use the HTTP door, and whose files and batches are
whose. Keyword-only functions over a Session, like db/repository.py.

A key is 32 random bytes (256 bits) in URL-safe text behind the prefix ``sk-specq-``. Only
its SHA-256 is stored: a secret that cannot be guessed needs no slow hash, and a key is
found by its hash through a unique index, then compared in constant time. The key's first
characters are kept to tell keys apart in `specq keys list`; the key itself is shown once,
when it is made.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from specq.db.models import ApiKey, Tenant, utcnow
from specq.db.session import changed
from specq.schema.errors import NotFound

KEY_PREFIX = "sk-specq-"
SHOWN = len(KEY_PREFIX) + 6  # characters of a key `specq keys list` shows


def key_hash(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()


@dataclass(frozen=True)
class Caller:
    """Who sent a request: the tenant and the key it used."""

    tenant_id: int
    tenant: str
    key_id: int


def create_key(session: Session, *, tenant: str) -> str:
    """A new key for ``tenant`` (made if new); returns the key, which is stored hashed."""
    row = session.scalar(select(Tenant).where(Tenant.name == tenant))
    if row is None:
        row = Tenant(name=tenant)
        session.add(row)
        session.flush()
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    session.add(ApiKey(tenant_id=row.id, key_hash=key_hash(key), prefix=key[:SHOWN]))
    session.flush()
    return key


def authenticate(session: Session, *, key: str) -> Caller | None:
    """The caller a live key belongs to; None for an unknown or revoked key."""
    digest = key_hash(key)
    found = session.execute(
        select(ApiKey.id, ApiKey.key_hash, ApiKey.revoked_at, Tenant.id, Tenant.name)
        .join(Tenant, Tenant.id == ApiKey.tenant_id).where(ApiKey.key_hash == digest)
    ).first()
    if found is None or not hmac.compare_digest(found[1], digest) or found[2] is not None:
        return None
    return Caller(tenant_id=found[3], tenant=found[4], key_id=found[0])


@dataclass(frozen=True)
class KeyInfo:
    tenant: str
    prefix: str
    created_at: datetime
    revoked_at: datetime | None


def list_keys(session: Session) -> list[KeyInfo]:
    rows = session.execute(
        select(Tenant.name, ApiKey.prefix, ApiKey.created_at, ApiKey.revoked_at)
        .join(Tenant, Tenant.id == ApiKey.tenant_id).order_by(Tenant.name, ApiKey.id))
    return [KeyInfo(*r) for r in rows]


def revoke(session: Session, *, tenant: str, prefix: str | None = None) -> int:
    """Revoke the tenant's live keys (only the one shown as ``prefix`` if given); returns
    how many. KeyError for an unknown tenant."""
    tenant_id = session.scalar(select(Tenant.id).where(Tenant.name == tenant))
    if tenant_id is None:
        raise NotFound(f"tenant {tenant!r}: not found")
    stmt = update(ApiKey).where(ApiKey.tenant_id == tenant_id, ApiKey.revoked_at.is_(None))
    if prefix is not None:
        stmt = stmt.where(ApiKey.prefix == prefix)
    return changed(session.execute(stmt.values(revoked_at=utcnow())))


def tenant_names(session: Session) -> list[str]:
    return list(session.scalars(select(Tenant.name).order_by(func.lower(Tenant.name))))
