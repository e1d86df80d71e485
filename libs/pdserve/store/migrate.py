"""Create, drop and migrate event-store databases (Alembic; docs/architecture.md §7: the app never creates
tables).

All three are synchronous so a test fixture, `pdserve up` or a shell can call them; each runs its async
work on a private event loop in a worker thread, so they also work when called from inside a running
loop. URLs are SQLAlchemy asyncpg URLs, e.g. `postgresql+asyncpg://postgres@127.0.0.1:5432/pdserve`.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

import sqlalchemy as sa
from alembic import command
from alembic.config import Config
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.pool import NullPool

# libs/pdserve/store/migrate.py → repository root → migrations/alembic.ini
ALEMBIC_INI = Path(__file__).resolve().parents[3] / "migrations" / "alembic.ini"

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")
T = TypeVar("T")


def _in_thread(fn: Callable[[], T]) -> T:
    # asyncio.run (ours and Alembic's env.py) refuses to start inside a running loop; a thread has none.
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(fn).result()


def _run(make: Callable[[], Awaitable[T]]) -> T:
    async def main() -> T:
        return await make()

    return _in_thread(lambda: asyncio.run(main()))


def _check_name(name: str) -> str:
    if not _NAME.match(name):
        raise ValueError(f"database name {name!r}: letters, digits and _ only, at most 63 characters")
    return name


async def _admin(admin_url: str, statements: list[str], exists_check: str | None = None) -> None:
    # CREATE/DROP DATABASE cannot run inside a transaction block.
    db = create_async_engine(admin_url, isolation_level="AUTOCOMMIT", poolclass=NullPool)
    try:
        async with db.connect() as conn:
            if exists_check is not None:
                found = await conn.scalar(sa.text("SELECT 1 FROM pg_database WHERE datname = :n"),
                                          {"n": exists_check})
                if found:
                    return
            for stmt in statements:
                await conn.execute(sa.text(stmt))
    finally:
        await db.dispose()


def database_url(admin_url: str, name: str) -> str:
    """`admin_url` with its database replaced by `name` (password kept)."""
    return make_url(admin_url).set(database=name).render_as_string(hide_password=False)


def create_database(admin_url: str, name: str) -> str:
    """Create database `name` on the server of `admin_url` (connecting to the admin URL's own database)
    unless it already exists; return its URL. Raises ValueError on an unsafe name and
    `sqlalchemy.exc.DBAPIError` / `OSError` when the server refuses or cannot be reached."""
    _check_name(name)
    _run(lambda: _admin(admin_url, [f'CREATE DATABASE "{name}"'], exists_check=name))
    return database_url(admin_url, name)


def drop_database(admin_url: str, name: str) -> None:
    """Drop database `name` if it exists, closing its open connections first (`WITH (FORCE)`,
    PostgreSQL ≥ 13). Raises like `create_database`."""
    _check_name(name)
    _run(lambda: _admin(admin_url, [f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)']))


def alembic_config(url: str) -> Config:
    """The Alembic config of `migrations/`, loaded by path, targeting `url`. The URL travels as a config
    attribute, not through the ini file (whose interpolation would mangle a '%' in a password)."""
    cfg = Config(str(ALEMBIC_INI))
    cfg.attributes["url"] = url
    return cfg


def upgrade(url: str, revision: str = "head") -> None:
    """Migrate the database at `url` to `revision` (default: the newest). Idempotent."""
    _in_thread(lambda: command.upgrade(alembic_config(url), revision))


def downgrade(url: str, revision: str = "base") -> None:
    """Migrate the database at `url` down to `revision` (default: empty)."""
    _in_thread(lambda: command.downgrade(alembic_config(url), revision))


def head_revision() -> str:
    """The newest revision of `migrations/` (what `upgrade` migrates to)."""
    from alembic.script import ScriptDirectory

    head = ScriptDirectory.from_config(alembic_config("")).get_current_head()
    assert head is not None, "migrations/ holds no revision"
    return head


def current_revision(url: str) -> str | None:
    """The revision the database at `url` is at; None when it has no `alembic_version` yet. Reads only
    (any service role may: migration 0004 grants SELECT on it). Raises `sqlalchemy.exc.DBAPIError` /
    `OSError` when the server refuses or cannot be reached."""

    async def read() -> str | None:
        db = create_async_engine(url, poolclass=NullPool)
        try:
            async with db.connect() as conn:
                exists = await conn.scalar(sa.text("SELECT to_regclass('alembic_version') IS NOT NULL"))
                if not exists:
                    return None
                return await conn.scalar(sa.text("SELECT version_num FROM alembic_version"))
        finally:
            await db.dispose()

    return _run(read)
