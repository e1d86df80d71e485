"""`pdserve keys create|revoke|list`: the gateway's API keys (pdserve.gateway.keys) in the event store's
database (`--database-url`, else $PDS_DATABASE_URL, else the running `pdserve up` stack's, else the
default; as `pdserve replay` finds it).

    pdserve keys create --name ci        prints the new key once (only its SHA-256 is stored)
    pdserve keys list                    id, name, first characters, created, revoked
    pdserve keys revoke <key_id>         the gateway refuses it within PDS_API_KEY_CACHE_S seconds
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

from rich.table import Table
from sqlalchemy.exc import DBAPIError

from pdserve.cli.output import make_console
from pdserve.cli.replay import resolve_database_url
from pdserve.gateway.keys import create_key, list_keys, revoke_key
from pdserve.store.queries import make_db

console = make_console(soft_wrap=True)


async def _run(args: argparse.Namespace, url: str) -> int:
    db = make_db(url)
    try:
        if args.keys_command == "create":
            key_id, key = await create_key(db, args.name)
            console.print(f"key id {key_id} ({args.name}); the key, shown this once:")
            console.print(key, markup=False)
            return 0
        if args.keys_command == "revoke":
            if not await revoke_key(db, args.key_id):
                console.print(f"[red]no key with id {args.key_id}[/red]")
                return 1
            console.print(f"revoked {args.key_id}")
            return 0
        table = Table("key id", "name", "starts", "created (UTC)", "revoked (UTC)", header_style="bold")
        for k in await list_keys(db):
            table.add_row(k["key_id"], k["name"], k["prefix"] + "…", f"{k['created_at']:%Y-%m-%d %H:%M:%S}",
                          f"{k['revoked_at']:%Y-%m-%d %H:%M:%S}" if k["revoked_at"] else "")
        console.print(table)
        return 0
    finally:
        await db.dispose()


def run(args: argparse.Namespace) -> int:
    """Exit status: 0 done, 1 no such key (revoke), 2 the database could not be reached."""
    url = resolve_database_url(args.database_url, args.var_dir)
    try:
        return asyncio.run(_run(args, url))
    except (DBAPIError, OSError) as e:
        console.print(f"[red]cannot reach the key store at {url}: {type(e).__name__}: {e}[/red]")
        return 2


def add_parsers(subparsers: argparse._SubParsersAction) -> None:
    """Register `keys create|revoke|list` on the `pdserve` command line."""
    p = subparsers.add_parser("keys", help="Create, revoke and list the gateway's API keys.")
    p.add_argument("--database-url", default=None, help="SQLAlchemy asyncpg URL (default: as `replay`).")
    p.add_argument("--var-dir", type=Path, default=None, help="Where to look for run/stack.json.")
    sub = p.add_subparsers(dest="keys_command", required=True)
    create = sub.add_parser("create", help="Make a key and print it (once).")
    create.add_argument("--name", required=True, help="Who or what the key is for.")
    revoke = sub.add_parser("revoke", help="Revoke a key by its id.")
    revoke.add_argument("key_id")
    sub.add_parser("list", help="Every key, revoked ones included (never the key).")
    p.set_defaults(func=run)
