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

A key may carry limits of its own (`KeyLimits`, migration 0005): a request rate, enforced by the gateway's
token bucket per key (`gateway/rate_limits.py`, 429 `rate_limit_exceeded`), and a request body size (413
`request_too_large`, below the gateway's own `max_body_bytes`). A change of limits applies within
`api_key_cache_s` too.
"""

from __future__ import annotations

import hashlib
import ipaddress
import secrets
import time
from dataclasses import dataclass, field
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
    sa.Column("requests_per_minute", sa.Float),
    sa.Column("burst", sa.Integer),
    sa.Column("max_request_bytes", sa.Integer),
)


@dataclass(frozen=True)
class KeyLimits:
    """A key's own limits; None is none of its own. `requests_per_minute` (> 0) refills its token bucket,
    which holds at most `burst` requests (≥ 1; default: a minute's worth, `ceil(requests_per_minute)`);
    `max_request_bytes` (≥ 1) caps a request body. Raises ValueError on a value out of range."""

    requests_per_minute: float | None = None
    burst: int | None = None
    max_request_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.requests_per_minute is not None and not self.requests_per_minute > 0:
            raise ValueError(f"requests_per_minute must be > 0, got {self.requests_per_minute}")
        if self.burst is not None and self.burst < 1:
            raise ValueError(f"burst must be >= 1, got {self.burst}")
        if self.max_request_bytes is not None and self.max_request_bytes < 1:
            raise ValueError(f"max_request_bytes must be >= 1, got {self.max_request_bytes}")

    def columns(self) -> dict[str, Any]:
        return {"requests_per_minute": self.requests_per_minute, "burst": self.burst,
                "max_request_bytes": self.max_request_bytes}


@dataclass(frozen=True)
class ApiKey:
    """A live key as the gateway knows it (never the key itself)."""

    key_id: str
    name: str
    limits: KeyLimits = field(default_factory=KeyLimits)


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


async def create_key(db: AsyncEngine, name: str, limits: KeyLimits | None = None) -> tuple[str, str]:
    """Store a new key named `name` with `limits` (none by default); returns `(key_id, key)` — the only
    time the key is known."""
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    key_id = new_id()
    async with db.begin() as conn:
        await conn.execute(api_keys.insert().values(key_id=key_id, name=name, key_sha256=digest(key),
                                                    prefix=key[:12], created_at=datetime.now(UTC),
                                                    **(limits or KeyLimits()).columns()))
    return key_id, key


async def set_limits(db: AsyncEngine, key_id: str, limits: KeyLimits) -> bool:
    """Replace the limits of key `key_id` with `limits`. False when there is no such key."""
    async with db.begin() as conn:
        done = await conn.execute(api_keys.update().where(api_keys.c.key_id == key_id)
                                  .values(**limits.columns()))
    return done.rowcount > 0


async def get_limits(db: AsyncEngine, key_id: str) -> KeyLimits | None:
    """The limits of key `key_id`; None when there is no such key."""
    q = sa.select(api_keys.c.requests_per_minute, api_keys.c.burst, api_keys.c.max_request_bytes) \
        .where(api_keys.c.key_id == key_id)
    async with db.connect() as conn:
        row = (await conn.execute(q)).mappings().first()
    return None if row is None else KeyLimits(**row)


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
    """Every key's id, name, first 12 characters, creation and revocation time and limits (never the
    hash)."""
    q = sa.select(api_keys.c.key_id, api_keys.c.name, api_keys.c.prefix, api_keys.c.created_at,
                  api_keys.c.revoked_at, api_keys.c.requests_per_minute, api_keys.c.burst,
                  api_keys.c.max_request_bytes).order_by(api_keys.c.created_at)
    async with db.connect() as conn:
        return [dict(r) for r in (await conn.execute(q)).mappings()]


class KeyCheck:
    """`await check(authorization_header)` returns the live key it names (`ApiKey`, with its limits) and
    raises `APIError` 401 otherwise (503 when the store cannot be read). Answers are cached `cache_s`
    seconds per key."""

    def __init__(self, db: AsyncEngine | None, cache_s: float) -> None:
        self.db = db
        self.cache_s = cache_s
        self._cache: dict[str, tuple[ApiKey | None, float]] = {}

    async def check(self, authorization: str | None) -> ApiKey:
        scheme, _, token = (authorization or "").strip().partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise _unauthorized("You didn't provide an API key. Send `Authorization: Bearer <key>` "
                                "(create one with `pdserve keys create`).")
        key = await self._live(digest(token))
        if key is None:
            shown = token[:8] + "…" if len(token) > 8 else "…"
            raise _unauthorized(f"Incorrect API key provided: {shown}")
        return key

    async def _live(self, key_sha256: str) -> ApiKey | None:
        now = time.monotonic()
        hit = self._cache.get(key_sha256)
        if hit is not None and now - hit[1] < self.cache_s:
            return hit[0]
        if self.db is None:
            raise APIError(503, "API keys are required but no key store is configured.",
                           code="key_store_unavailable")
        c = api_keys.c
        q = sa.select(c.key_id, c.name, c.requests_per_minute, c.burst, c.max_request_bytes) \
            .where(c.key_sha256 == key_sha256, c.revoked_at.is_(None))
        try:
            async with self.db.connect() as conn:
                row = (await conn.execute(q)).mappings().first()
        except Exception as e:  # Postgres down: cannot tell, so refuse for now
            raise APIError(503, f"The key store cannot be read now: {type(e).__name__}",
                           code="key_store_unavailable", headers={"Retry-After": "1"}) from e
        if len(self._cache) > 10_000:
            self._cache.clear()
        live = None if row is None else ApiKey(
            row["key_id"], row["name"],
            KeyLimits(row["requests_per_minute"], row["burst"], row["max_request_bytes"]))
        self._cache[key_sha256] = (live, now)
        return live


def _unauthorized(message: str) -> APIError:
    return APIError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
