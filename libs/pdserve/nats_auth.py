"""Least privilege on NATS: one user per process of a stack, each allowed only the subjects its service
uses (docs/architecture.md §9). A worker publishes its own heartbeat, KV events, digest and finish report,
token chunks and the event types workers emit — never a coordinator command (`<prefix>.coord.*`) nor
another worker's subjects; the gateway never touches worker subjects; on JetStream each may use only the
API subjects it needs, on the events stream only: the recorder its durable consumer (pull, ack), the
gateway and coordinator ephemeral ack-less consumers (their journal reads), workers and the router none
beyond looking the stream up. `admin` (the CLI, the supervisor) may do anything.

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
    # RequestReceived: stored from the gateway's Submit before the coordinator accepts it
    "coordinator": ("RequestReceived", "RequestRouted", "DecodeReserved", "AdmissionDeferred",
                    "RequestMigrated", "RequestRecovered", "RequestTakenOver", "RequestCompleted",
                    "RequestFailed", "RequestAborted"),
    # DecodeReserved: a local placement's, reserved by its prefill command (workers/prefill.py)
    "worker": ("DecodeReserved", "PrefillStarted", "PrefillCompleted", "TransferCompleted",
               "ChecksumMismatch", "DecodeStarted", "TokensCommitted"),
    "router": (),
    "recorder": (),
}
COMMANDS = ("reserve", "prefill", "start", "release")  # what the coordinator sends a worker
RECORDER_DURABLE = "pdserve-recorder"  # pdserve.store.recorder.DURABLE: the one consumer that acks
INBOX = "_INBOX.>"  # replies to this connection's requests (nats-py's default inbox prefix)


def placer_publishes(s: Subjects) -> list[str]:
    """What a placer (routing/live.py: the router service's, or a coordinator's own) publishes: its
    bookings and incompatibility reports."""
    return [s.incompatible(), s.booked]


def placer_hears(s: Subjects) -> list[str]:
    """What a placer hears: peers' bookings, heartbeats, KV events and digests, lifecycle events."""
    return [s.booked, s.heartbeat(), s.kv_events(), s.kv_digest(), s.all_events]


def js_connect(stream: str) -> list[str]:
    """The JetStream API every service uses, on the events stream only: `Bus.connect` looks the stream up
    and creates it when absent (publishing an event needs no API subject: the event's own, acked on the
    inbox)."""
    return [f"$JS.API.STREAM.INFO.{stream}", f"$JS.API.STREAM.CREATE.{stream}"]


def js_journal(stream: str) -> tuple[list[str], list[str]]:
    """(allow, deny) of a journal reader (`lifecycle/journal.py: read_stream`, the gateway's and
    coordinator's): it makes ephemeral ack-less consumers (named by nats-py, so any name but the
    recorder's), asks their info and pulls from them, and reads the recorder's consumer info (its ack
    floor). It may not pull, ack, make or delete the recorder's consumer, nor delete anything."""
    api = "$JS.API.CONSUMER"
    allow = [f"{api}.CREATE.{stream}.*.>", f"{api}.INFO.{stream}.*", f"{api}.MSG.NEXT.{stream}.*"]
    deny = [f"{api}.CREATE.{stream}.{RECORDER_DURABLE}.>", f"{api}.MSG.NEXT.{stream}.{RECORDER_DURABLE}"]
    return allow, deny


def js_recorder(stream: str) -> list[str]:
    """The recorder's JetStream API: its durable consumer only — make it (nats-py's legacy durable
    subject, or the named form), ask its info, pull from it, ack what it committed."""
    api, d = "$JS.API.CONSUMER", RECORDER_DURABLE
    return [f"{api}.DURABLE.CREATE.{stream}.{d}", f"{api}.CREATE.{stream}.{d}",
            f"{api}.CREATE.{stream}.{d}.>",
            f"{api}.INFO.{stream}.{d}", f"{api}.MSG.NEXT.{stream}.{d}", f"$JS.ACK.{stream}.{d}.>"]


def lease_bucket(stream: str) -> str:
    """The JetStream KV bucket of the request leases of the events stream `stream`: one per stack."""
    return f"{stream}_LEASES"


def js_leases(stream: str) -> list[str]:
    """The coordinators' JetStream API on their lease bucket only (`CoordinatorSettings.lease_bucket`,
    `<stream>_LEASES`, lifecycle/ownership.py): the bucket is the stream `KV_<bucket>` — look it up, create
    it, read a key (direct or message get), list keys (an ephemeral consumer), and put or delete keys
    (`$KV.<bucket>.>`). No other bucket or stream."""
    bucket = lease_bucket(stream)
    kv = f"KV_{bucket}"
    api = "$JS.API"
    return [f"{api}.STREAM.INFO.{kv}", f"{api}.STREAM.CREATE.{kv}", f"{api}.STREAM.MSG.GET.{kv}",
            f"{api}.DIRECT.GET.{kv}", f"{api}.DIRECT.GET.{kv}.>", f"{api}.CONSUMER.CREATE.{kv}",
            f"{api}.CONSUMER.CREATE.{kv}.>", f"{api}.CONSUMER.INFO.{kv}.*", f"{api}.CONSUMER.MSG.NEXT.{kv}.*",
            f"{api}.CONSUMER.DELETE.{kv}.*", f"$KV.{bucket}.>"]


def kind_of(role: str) -> str:
    """The permission kind of a `PDS_ROLE`: a worker role is "worker", a service is its own name."""
    if role in WORKER_ROLES:
        return "worker"
    if role not in EMITS:
        raise ValueError(f"no NATS permissions for role {role!r}")
    return role


def permissions(name: str, role: str, prefix: str, stream: str = "PDS_EVENTS") -> dict[str, Any]:
    """nats-server permissions of process `name` (a worker's id) with `role`, on subjects under `prefix`
    and the events stream `stream` (`PDS_EVENTS_STREAM`). Replies to requests it receives are allowed
    (`allow_responses`). JetStream: every service may look up and create the events stream; only the
    recorder consumes it with acks; the gateway and coordinator read it through ephemeral ack-less
    consumers; workers and the router only publish."""
    s = Subjects(prefix)
    kind = kind_of(role)
    pub: list[str] = [*js_connect(stream), *(s.event("*", t) for t in EMITS[kind])]
    pub_deny: list[str] = []
    sub: list[str] = [INBOX]
    if kind == "worker":
        pub += [s.heartbeat(name), s.kv_events(name), s.kv_digest(name), s.finished(name), s.tokens("*")]
        sub += [f"{prefix}.worker.{name}.*", s.heartbeat(name)]  # its own heartbeat: `pdserve ready`
    elif kind == "gateway":
        allow, pub_deny = js_journal(stream)
        pub += [s.submit, s.abort, *allow]
        sub += [s.tokens("*"), s.event("*", "*"), s.heartbeat()]
    elif kind == "coordinator":
        allow, pub_deny = js_journal(stream)
        pub += [s.route, *(s.worker("*", c) for c in COMMANDS), s.tokens("*"), *allow,  # type: ignore[arg-type]
                *js_leases(stream), *placer_publishes(s)]
        sub += [s.submit, s.abort, s.finished(), s.tokens("*"), *placer_hears(s)]
    elif kind == "router":
        pub += placer_publishes(s)
        sub += [s.route, *placer_hears(s)]
    elif kind == "recorder":
        pub += js_recorder(stream)
    publish: dict[str, list[str]] = {"allow": pub}
    if pub_deny:
        publish["deny"] = pub_deny
    return {"publish": publish, "subscribe": {"allow": sub}, "allow_responses": True}


@dataclass(frozen=True)
class NatsUser:
    name: str
    password: str
    permissions: dict[str, Any] | None  # None: everything (admin)


def stack_users(processes: Iterable[tuple[str, str]], prefix: str,
                stream: str = "PDS_EVENTS") -> list[NatsUser]:
    """`admin` plus one user per (name, role) process, each with a fresh 32-byte random password and the
    permissions of `permissions(name, role, prefix, stream)`."""
    users = [NatsUser(ADMIN, secrets.token_urlsafe(32), None)]
    users += [NatsUser(name, secrets.token_urlsafe(32), permissions(name, role, prefix, stream))
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


def write_private(path: Path, text: str) -> None:
    """Write `text` to `path` (parents made), readable by its owner only (mode 0600)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(path, 0o600)


def write_users(path: Path, users: Iterable[NatsUser]) -> None:
    """{user: password} as JSON in `path`, readable by its owner only."""
    write_private(path, json.dumps({u.name: u.password for u in users}, indent=2) + "\n")


def write_server_config(path: Path, users: Iterable[NatsUser]) -> None:
    write_private(path, server_config(users))


def read_users(path: Path) -> dict[str, str]:
    """The {user: password} a `write_users` file holds. Raises OSError / ValueError when unreadable."""
    return dict(json.loads(Path(path).read_text()))


def password_of(user: str, users_file: Path) -> str:
    """`user`'s password in `users_file`. Raises KeyError when it has none."""
    users = read_users(users_file)
    if user not in users:
        raise KeyError(f"NATS user {user!r} is not in {users_file}")
    return users[user]
