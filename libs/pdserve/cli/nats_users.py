"""`pdserve nats-users`: the per-service NATS users of a stack that `pdserve up` does not own — compose's
and Kubernetes' (docs/architecture.md §9). Writes `<out>/nats-users.json` ({user: password}, the services'
`PDS_NATS_USERS_FILE`) and `<out>/nats-auth.conf` (the nats-server authorization to start with `-c`), both
mode 0600. Passwords already in the users file are kept, so running it again (every `docker compose up`)
does not lock out running services; users not named are dropped.

    pdserve nats-users --out /var/lib/pdserve-auth recorder:recorder router:router ... gateway:gateway
    pdserve nats-users --mode disaggregated --kubernetes --out deploy/k8s/overlays/disaggregated/secrets

`--mode` takes the processes from `pdserve.service_plan` (with `--prefill` / `--decode` / `--routers`).
`--kubernetes` also writes what deploy/k8s's overlays generate their Secrets from, so that no pod holds
another's password: `nats-passwords.env` (`<service>=<password>` for each non-worker process, each pod
reads only its own key), `nats-workers.json` (the workers' passwords only: a StatefulSet's pods share one
Secret) and `grafana.env` (Grafana's admin password, kept across runs like the users').
"""

from __future__ import annotations

import argparse
import secrets
from pathlib import Path

from pdserve.nats_auth import (
    ADMIN,
    WORKER_ROLES,
    NatsUser,
    permissions,
    read_users,
    stack_users,
    write_private,
    write_server_config,
    write_users,
)
from pdserve.service_plan import MODES, service_plan


def _process(text: str) -> tuple[str, str]:
    name, sep, role = text.partition(":")
    if not sep or not name or not role:
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME:ROLE, e.g. decode-0:decode")
    return name, role


def add_parsers(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("nats-users",
                              help="Write per-service NATS users and the server's authorization.")
    p.add_argument("processes", nargs="*", type=_process,
                   help="NAME:ROLE of each process (its PDS_WORKER_ID:PDS_ROLE); or --mode")
    p.add_argument("--mode", choices=MODES, help="The processes of this mode's service plan instead.")
    p.add_argument("--prefill", type=int, default=1, help="With --mode: prefill workers (default 1).")
    p.add_argument("--decode", type=int, default=1, help="With --mode: decode workers (default 1).")
    p.add_argument("--routers", type=int, default=0,
                   help="With --mode: router services (default 0; deploy/k8s/components/router runs one).")
    p.add_argument("--out", type=Path, required=True, help="Folder for nats-users.json and nats-auth.conf.")
    p.add_argument("--prefix", default="pds", help="The stack's subject prefix (PDS_SUBJECT_PREFIX).")
    p.add_argument("--stream", default="PDS_EVENTS", help="The stack's events stream (PDS_EVENTS_STREAM).")
    p.add_argument("--kubernetes", action="store_true",
                   help="Also write the files deploy/k8s's overlays make their Secrets from.")
    p.set_defaults(func=run)


def _kept(path: Path, key: str) -> str | None:
    """The value of `key=` in an env file written before, if any."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return None
    return next((line.split("=", 1)[1] for line in lines if line.startswith(f"{key}=")), None)


def run(args: argparse.Namespace) -> int:
    processes: list[tuple[str, str]] = list(args.processes)
    if args.mode:
        processes += [(s.name, s.role)
                      for s in service_plan(args.mode, args.prefill, args.decode, n_routers=args.routers)]
    if not processes:
        print("pdserve nats-users: name NAME:ROLE processes or --mode")
        return 2
    users_file = args.out / "nats-users.json"
    try:
        known = read_users(users_file)
    except (OSError, ValueError):
        known = {}
    fresh = {u.name: u for u in stack_users(processes, args.prefix, args.stream)}
    users = [NatsUser(ADMIN, known.get(ADMIN, fresh[ADMIN].password), None)]
    users += [NatsUser(name, known.get(name, fresh[name].password),
                       permissions(name, role, args.prefix, args.stream))
              for name, role in processes]
    write_users(users_file, users)
    write_server_config(args.out / "nats-auth.conf", users)
    print(f"{len(users)} NATS users in {users_file}")
    if args.kubernetes:
        roles = dict(processes)
        services = [u for u in users if u.name != ADMIN and roles[u.name] not in WORKER_ROLES]
        workers = [u for u in users if u.name != ADMIN and roles[u.name] in WORKER_ROLES]
        write_private(args.out / "nats-passwords.env", "".join(f"{u.name}={u.password}\n" for u in services))
        write_users(args.out / "nats-workers.json", workers)
        grafana = args.out / "grafana.env"
        write_private(grafana, f"password={_kept(grafana, 'password') or secrets.token_urlsafe(24)}\n")
        print(f"Kubernetes Secrets' sources in {args.out}: nats-passwords.env, nats-workers.json, "
              "grafana.env")
    return 0
