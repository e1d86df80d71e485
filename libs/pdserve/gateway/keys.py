"""API keys: OpenAI's `Authorization: Bearer <key>` at the gateway.

A key is `pds-` + 43 URL-safe random characters (256 bits), shown once by `pdserve keys create`; Postgres
keeps only its SHA-256 (`api_keys`, migration 0003; a table of its own, so the recorder stays the only
writer of `events`). A key that is not found, or revoked, is a 401 in OpenAI's shape (code
`invalid_api_key`). SHA-256 and not a slow password hash: the key has 256 bits of entropy, so a fast hash
gives nothing to brute force, and every request checks one.

When keys are required (`PDS_API_KEYS`): `required` always; `off` never; `auto` (the default) unless the
gateway listens on loopback only (the embedded `make up` stack, reachable from this machine alone). The
gateway reads the table (cached `api_key_cache_s` seconds per key, so a revoked key stops working within
that); `pdserve keys` writes it.
"""

from __future__ import annotations

import hashlib
import ipaddress
import secrets
import time
from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql
from sqlalchemy.ext.asyncio import AsyncEngine

from pdserve.gateway.errors import APIError
from pdserve.ids import new_id

KEY_PREFIX = "pds-"
MODES = ("auto", "required", "off")

api_keys = sa.Table(
    "api_keys", sa.MetaData(),
    sa.Column("key_id", postgresql.UUID(as_uuid=False), primary_key=True),
    sa.Column("name", sa.Text, nullable=False),
    sa.Column("key_sha256", sa.Text, nullable=False, unique=True),
    sa.Column("prefix", sa.Text, nullable=False),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    sa.Column("revoked_at", sa.DateTime(timezone=True)),
)


def digest(key: str) -> str:
    """The stored form of `key`: SHA-256 of its UTF-8, hex."""
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()


def keys_required(mode: str, host: str) -> bool:
    """Whether a gateway bound to `host` checks keys under `mode` (auto | required | off). Raises
    ValueError for another mode."""
    if mode not in MODES:
        raise ValueError(f"api_keys {mode!r}: expected one of {MODES}")
    if mode != "auto":
        return mode == "required"
    if host == "localhost":
        return False
    try:
        return not ipaddress.ip_address(host).is_loopback
    except ValueError:
        return True  # a host name: it may resolve to anything


async def create_key(db: AsyncEngine, name: str) -> tuple[str, str]:
    """Store a new key named `name`; returns `(key_id, key)` — the only time the key is known."""
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    key_id = new_id()
    async with db.begin() as conn:
        await conn.execute(api_keys.insert().values(key_id=key_id, name=name, key_sha256=digest(key),
                                                    prefix=key[:12], created_at=datetime.now(UTC)))
    return key_id, key


async def revoke_key(db: AsyncEngine, key_id: str) -> bool:
    """Revoke the key `key_id` (idempotent). False when there is no such key."""
    async with db.begin() as conn:
        found = await conn.execute(sa.select(api_keys.c.key_id).where(api_keys.c.key_id == key_id))
        if found.first() is None:
            return False
        await conn.execute(api_keys.update().where(api_keys.c.key_id == key_id,
                                                   api_keys.c.revoked_at.is_(None))
                           .values(revoked_at=datetime.now(UTC)))
    return True


async def list_keys(db: AsyncEngine) -> list[dict[str, Any]]:
    """Every key's id, name, first 12 characters, creation and revocation time (never the hash)."""
    q = sa.select(api_keys.c.key_id, api_keys.c.name, api_keys.c.prefix, api_keys.c.created_at,
                  api_keys.c.revoked_at).order_by(api_keys.c.created_at)
    async with db.connect() as conn:
        return [dict(r) for r in (await conn.execute(q)).mappings()]


class KeyCheck:
    """`await check(authorization_header)` raises `APIError` 401 unless it names a live key (503 when the
    store cannot be read). Answers are cached `cache_s` seconds per key."""

    def __init__(self, db: AsyncEngine | None, cache_s: float) -> None:
        self.db = db
        self.cache_s = cache_s
        self._cache: dict[str, tuple[bool, float]] = {}

    async def check(self, authorization: str | None) -> None:
        scheme, _, token = (authorization or "").strip().partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise _unauthorized("You didn't provide an API key. Send `Authorization: Bearer <key>` "
                                "(create one with `pdserve keys create`).")
        if not await self._live(digest(token)):
            shown = token[:8] + "…" if len(token) > 8 else "…"
            raise _unauthorized(f"Incorrect API key provided: {shown}")

    async def _live(self, key_sha256: str) -> bool:
        now = time.monotonic()
        hit = self._cache.get(key_sha256)
        if hit is not None and now - hit[1] < self.cache_s:
            return hit[0]
        if self.db is None:
            raise APIError(503, "API keys are required but no key store is configured.",
                           code="key_store_unavailable")
        q = sa.select(api_keys.c.key_id).where(api_keys.c.key_sha256 == key_sha256,
                                               api_keys.c.revoked_at.is_(None))
        try:
            async with self.db.connect() as conn:
                live = (await conn.execute(q)).first() is not None
        except Exception as e:  # Postgres down: cannot tell, so refuse for now
            raise APIError(503, f"The key store cannot be read now: {type(e).__name__}",
                           code="key_store_unavailable", headers={"Retry-After": "1"}) from e
        if len(self._cache) > 10_000:
            self._cache.clear()
        self._cache[key_sha256] = (live, now)
        return live


def _unauthorized(message: str) -> APIError:
    return APIError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
