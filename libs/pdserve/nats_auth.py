"""Least privilege on NATS: one user per process of a stack, each allowed only the subjects its service
uses (docs/architecture.md §9). A worker publishes its own heartbeat, KV events, digest and finish report,
token chunks and the event types workers emit — never a coordinator command (`<prefix>.coord.*`) nor
another worker's subjects; the gateway never touches worker subjects; only the recorder consumes the
events stream with acks. `admin` (the CLI, the supervisor) may do anything.

`stack_users` makes the users of a plan with fresh random passwords; `server_config` is the nats-server
`authorization` block for them; `write_users` / `read_users` keep them in a 0600 JSON file under var/
(never in the repository). Services connect as `PDS_NATS_USER` with `PDS_NATS_PASSWORD`, or with the
password that `PDS_NATS_USERS_FILE` holds for that user.
"""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdserve.messages import Subjects

ADMIN = "admin"
WORKER_ROLES = ("prefill", "decode", "unified")
# The lifecycle event types each kind of service emits (`Bus.emit`): its only event subjects.
EMITS: dict[str, tuple[str, ...]] = {
    "gateway": ("RequestReceived", "RequestFailed"),
    "coordinator": ("RequestRouted", "DecodeReserved", "AdmissionDeferred", "RequestMigrated",
                    "RequestRecovered", "RequestTakenOver", "RequestCompleted", "RequestFailed",
                    "RequestAborted"),
    "worker": ("PrefillStarted", "PrefillCompleted", "TransferCompleted", "ChecksumMismatch", "DecodeStarted",
               "TokensCommitted"),
    "router": (),
    "recorder": (),
}
COMMANDS = ("reserve", "prefill", "start", "release")  # what the coordinator sends a worker
# JetStream API every service uses (Bus.connect makes sure the events stream exists), and what reading the
# stream through a consumer takes (the gateway's and coordinator's journal reads, the recorder's pulls).
JS_CONNECT = ("$JS.API.INFO", "$JS.API.STREAM.INFO.*", "$JS.API.STREAM.CREATE.*")
JS_READ = ("$JS.API.CONSUMER.>", "$JS.API.STREAM.MSG.GET.*", "$JS.API.DIRECT.GET.>", "$JS.ACK.>")
INBOX = "_INBOX.>"  # replies to this connection's requests (nats-py's default inbox prefix)
KV_WRITE = "$KV.>"  # writes to JetStream KV: the coordinators' request leases (lifecycle/ownership.py)


def kind_of(role: str) -> str:
    """The permission kind of a `PDS_ROLE`: a worker role is "worker", a service is its own name."""
    if role in WORKER_ROLES:
        return "worker"
    if role not in EMITS:
        raise ValueError(f"no NATS permissions for role {role!r}")
    return role


def permissions(name: str, role: str, prefix: str) -> dict[str, Any]:
    """nats-server permissions of process `name` (a worker's id) with `role`, on subjects under `prefix`.
    Replies to requests it receives are allowed (`allow_responses`)."""
    s = Subjects(prefix)
    kind = kind_of(role)
    pub: list[str] = [*JS_CONNECT, *(s.event("*", t) for t in EMITS[kind])]
    sub: list[str] = [INBOX]
    if kind == "worker":
        pub += [s.heartbeat(name), s.kv_events(name), s.kv_digest(name), s.finished(name), s.tokens("*")]
        sub += [f"{prefix}.worker.{name}.*"]
    elif kind == "gateway":
        pub += [s.submit, s.abort, *JS_READ]
        sub += [s.tokens("*"), s.event("*", "*"), s.heartbeat()]
    elif kind == "coordinator":
        pub += [s.route, *(s.worker("*", c) for c in COMMANDS), s.tokens("*"), *JS_READ,  # type: ignore[arg-type]
                KV_WRITE]
        sub += [s.submit, s.abort, s.finished(), s.heartbeat(), s.tokens("*")]
    elif kind == "router":
        pub += [s.incompatible(), s.booked]
        sub += [s.route, s.booked, s.heartbeat(), s.kv_events(), s.kv_digest(), s.all_events]
    elif kind == "recorder":
        pub += [*JS_READ]
    return {"publish": {"allow": pub}, "subscribe": {"allow": sub}, "allow_responses": True}


@dataclass(frozen=True)
class NatsUser:
    name: str
    password: str
    permissions: dict[str, Any] | None  # None: everything (admin)


def stack_users(processes: Iterable[tuple[str, str]], prefix: str) -> list[NatsUser]:
    """`admin` plus one user per (name, role) process, each with a fresh 32-byte random password."""
    users = [NatsUser(ADMIN, secrets.token_urlsafe(32), None)]
    users += [NatsUser(name, secrets.token_urlsafe(32), permissions(name, role, prefix))
              for name, role in processes]
    return users


def server_config(users: Iterable[NatsUser]) -> str:
    """The nats-server configuration block (its format takes JSON values) authorizing exactly `users`."""
    entries = []
    for u in users:
        entry: dict[str, Any] = {"user": u.name, "password": u.password}
        if u.permissions is not None:
            entry["permissions"] = u.permissions
        entries.append(entry)
    return "authorization " + json.dumps({"users": entries}, indent=2) + "\n"


def _write_private(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(path, 0o600)


def write_users(path: Path, users: Iterable[NatsUser]) -> None:
    """{user: password} as JSON in `path`, readable by its owner only."""
    _write_private(path, json.dumps({u.name: u.password for u in users}, indent=2) + "\n")


def write_server_config(path: Path, users: Iterable[NatsUser]) -> None:
    _write_private(path, server_config(users))


def read_users(path: Path) -> dict[str, str]:
    """The {user: password} a `write_users` file holds. Raises OSError / ValueError when unreadable."""
    return dict(json.loads(Path(path).read_text()))


def password_of(user: str, users_file: Path) -> str:
    """`user`'s password in `users_file`. Raises KeyError when it has none."""
    users = read_users(users_file)
    if user not in users:
        raise KeyError(f"NATS user {user!r} is not in {users_file}")
    return users[user]
