"""`pdserve nats-users`: the per-service NATS users of a stack that `pdserve up` does not own — compose's
(docs/architecture.md §9). Writes `<out>/nats-users.json` ({user: password}, the services'
`PDS_NATS_USERS_FILE`) and `<out>/nats-auth.conf` (the nats-server authorization to start with `-c`), both
mode 0600. Passwords already in the users file are kept, so running it again (every `docker compose up`)
does not lock out running services; users not named are dropped.

    pdserve nats-users --out /var/lib/pdserve-auth recorder:recorder router:router ... gateway:gateway
"""

from __future__ import annotations

import argparse
from pathlib import Path

from pdserve.nats_auth import (
    ADMIN,
    NatsUser,
    permissions,
    read_users,
    stack_users,
    write_server_config,
    write_users,
)


def _process(text: str) -> tuple[str, str]:
    name, sep, role = text.partition(":")
    if not sep or not name or not role:
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME:ROLE, e.g. decode-0:decode")
    return name, role


def add_parsers(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("nats-users",
                              help="Write per-service NATS users and the server's authorization.")
    p.add_argument("processes", nargs="+", type=_process,
                   help="NAME:ROLE of each process (its PDS_WORKER_ID:PDS_ROLE)")
    p.add_argument("--out", type=Path, required=True, help="Folder for nats-users.json and nats-auth.conf.")
    p.add_argument("--prefix", default="pds", help="The stack's subject prefix (PDS_SUBJECT_PREFIX).")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    users_file = args.out / "nats-users.json"
    try:
        known = read_users(users_file)
    except (OSError, ValueError):
        known = {}
    fresh = {u.name: u for u in stack_users(args.processes, args.prefix)}
    users = [NatsUser(ADMIN, known.get(ADMIN, fresh[ADMIN].password), None)]
    users += [NatsUser(name, known.get(name, fresh[name].password), permissions(name, role, args.prefix))
              for name, role in args.processes]
    write_users(users_file, users)
    write_server_config(args.out / "nats-auth.conf", users)
    print(f"{len(users)} NATS users in {users_file}")
    return 0
