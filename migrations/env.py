"""Alembic environment: runs migrations over the async engine the services use (asyncpg).

The URL is `config.attributes["url"]` when called from `pdserve.store.migrate.upgrade`, else the
`PDS_DATABASE_URL` environment variable (the `alembic` command line). No `fileConfig` here: a library call
must not reconfigure the logging of the process that made it.
"""

from __future__ import annotations

import asyncio
import os

from alembic import context
from sqlalchemy import pool
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import create_async_engine

from pdserve.store.tables import metadata

config = context.config


def _url() -> str:
    url = config.attributes.get("url") or os.environ.get("PDS_DATABASE_URL")
    if not url:
        raise RuntimeError("no database URL: "
                           "pass one to pdserve.store.migrate.upgrade or set PDS_DATABASE_URL")
    return url


def _include_object(obj, name, type_, reflected, compare_to) -> bool:
    # Autogenerate would drop tables it does not know (docs/architecture.md §10); only compare ours.
    return not (type_ == "table" and reflected and compare_to is None)


def _configure(connection: Connection | None = None, url: str | None = None) -> None:
    context.configure(
        connection=connection,
        url=url,
        target_metadata=metadata,
        include_object=_include_object,
        compare_type=True,
        literal_binds=connection is None,
    )


def run_migrations_offline() -> None:
    _configure(url=_url())
    with context.begin_transaction():
        context.run_migrations()


def _run_sync(connection: Connection) -> None:
    _configure(connection=connection)
    with context.begin_transaction():
        context.run_migrations()


async def run_migrations_online() -> None:
    engine = create_async_engine(_url(), poolclass=pool.NullPool)
    try:
        async with engine.connect() as connection:
            await connection.run_sync(_run_sync)
            await connection.commit()
    finally:
        await engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    asyncio.run(run_migrations_online())
