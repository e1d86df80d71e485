"""`pdserve keys create|revoke|list`: the gateway's API keys (pdserve.gateway.keys) in the event store's
database (`--database-url`, else $PDS_DATABASE_URL, else the running `pdserve up` stack's, else the
default; as `pdserve replay` finds it).

    pdserve keys create --name ci        prints the new key once (only its SHA-256 is stored)
    pdserve keys create --name ci --rpm 60 --burst 10 --max-request-bytes 65536
                                         with limits of its own: 429 past its rate, 413 past its size
    pdserve keys limit <key_id> --rpm 120    change a key's limits (0 removes one); others unchanged
    pdserve keys list                    id, name, first characters, created, revoked, limits
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
from pdserve.gateway.keys import KeyLimits, create_key, get_limits, list_keys, revoke_key, set_limits
from pdserve.gateway.rate_limits import burst_of
from pdserve.store.queries import make_db

console = make_console(soft_wrap=True)


def _limits_text(limits: KeyLimits) -> str:
    parts = []
    if (rpm := limits.requests_per_minute) is not None:
        parts.append(f"{rpm:g}/min burst {burst_of(rpm, limits.burst)}")
    if limits.max_request_bytes is not None:
        parts.append(f"≤ {limits.max_request_bytes} B")
    return ", ".join(parts) or "none"


def _changed(old: KeyLimits, args: argparse.Namespace) -> KeyLimits:
    """`old` with each limit the command line names replaced (0: removed)."""
    def pick(given, before):  # noqa: ANN001, ANN202 (float or int alike)
        return before if given is None else (None if given == 0 else given)

    return KeyLimits(pick(args.rpm, old.requests_per_minute), pick(args.burst, old.burst),
                     pick(args.max_request_bytes, old.max_request_bytes))


async def _run(args: argparse.Namespace, url: str) -> int:
    db = make_db(url)
    try:
        if args.keys_command == "create":
            limits = _changed(KeyLimits(), args)
            key_id, key = await create_key(db, args.name, limits)
            console.print(f"key id {key_id} ({args.name}; limits: {_limits_text(limits)}); "
                          "the key, shown this once:")
            console.print(key, markup=False)
            return 0
        if args.keys_command == "limit":
            old = await get_limits(db, args.key_id)
            if old is None:
                console.print(f"[red]no key with id {args.key_id}[/red]")
                return 1
            new = _changed(old, args)
            await set_limits(db, args.key_id, new)
            console.print(f"limits of {args.key_id}: {_limits_text(new)} (the gateway "
                          "applies them within PDS_API_KEY_CACHE_S)")
            return 0
        if args.keys_command == "revoke":
            if not await revoke_key(db, args.key_id):
                console.print(f"[red]no key with id {args.key_id}[/red]")
                return 1
            console.print(f"revoked {args.key_id}")
            return 0
        table = Table("key id", "name", "starts", "created (UTC)", "revoked (UTC)", "limits",
                      header_style="bold")
        for k in await list_keys(db):
            limits = KeyLimits(k["requests_per_minute"], k["burst"], k["max_request_bytes"])
            table.add_row(k["key_id"], k["name"], k["prefix"] + "…", f"{k['created_at']:%Y-%m-%d %H:%M:%S}",
                          f"{k['revoked_at']:%Y-%m-%d %H:%M:%S}" if k["revoked_at"] else "",
                          _limits_text(limits))
        console.print(table)
        return 0
    finally:
        await db.dispose()


def run(args: argparse.Namespace) -> int:
    """Exit status: 0 done, 1 no such key (revoke, limit), 2 the database could not be reached or a limit
    is out of range."""
    url = resolve_database_url(args.database_url, args.var_dir)
    try:
        return asyncio.run(_run(args, url))
    except ValueError as e:
        console.print(f"[red]{e}[/red]")
        return 2
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
    limit = sub.add_parser("limit", help="Change a key's limits (those named; 0 removes one).")
    limit.add_argument("key_id")
    for p_ in (create, limit):
        p_.add_argument("--rpm", type=float, default=None,
                        help="Requests per minute (a token bucket per key; past it 429 rate_limit_exceeded).")
        p_.add_argument("--burst", type=int, default=None,
                        help="Requests the bucket holds at most (default: a minute's worth, ceil(rpm)).")
        p_.add_argument("--max-request-bytes", type=int, default=None,
                        help="Largest request body for this key (past it 413; the gateway's own holds).")
    revoke = sub.add_parser("revoke", help="Revoke a key by its id.")
    revoke.add_argument("key_id")
    sub.add_parser("list", help="Every key, revoked ones included (never the key).")
    p.set_defaults(func=run)
