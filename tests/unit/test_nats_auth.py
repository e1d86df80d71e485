"""pdserve.nats_auth and `pdserve nats-users`: every lifecycle event type is some service's to emit (else
its publish would be refused), and regenerating a stack's users keeps the passwords services already have."""

from __future__ import annotations

import json

from pdserve.cli.main import main
from pdserve.events import PAYLOAD_TYPES
from pdserve.nats_auth import ADMIN, EMITS, read_users


def test_every_event_type_has_an_emitter() -> None:
    emitted = {t for types in EMITS.values() for t in types}
    assert emitted == set(PAYLOAD_TYPES)


def test_nats_users_keeps_known_passwords_and_writes_private_files(tmp_path, capsys) -> None:
    args = ["nats-users", "--out", str(tmp_path), "--prefix", "pq", "decode-0:decode"]
    assert main([*args, "gateway:gateway"]) == 0
    first = read_users(tmp_path / "nats-users.json")
    assert set(first) == {ADMIN, "decode-0", "gateway"} and len(set(first.values())) == 3
    assert main([*args, "router:router"]) == 0
    second = read_users(tmp_path / "nats-users.json")
    assert second[ADMIN] == first[ADMIN] and second["decode-0"] == first["decode-0"]
    assert set(second) == {ADMIN, "decode-0", "router"}  # gateway dropped: not named
    for name in ("nats-users.json", "nats-auth.conf"):
        assert (tmp_path / name).stat().st_mode & 0o777 == 0o600
    config = json.loads((tmp_path / "nats-auth.conf").read_text().removeprefix("authorization "))
    decode = next(u for u in config["users"] if u["user"] == "decode-0")
    assert "pq.heartbeat.decode-0" in decode["permissions"]["publish"]["allow"]
    assert not any(s.startswith("pq.coord.") for s in decode["permissions"]["publish"]["allow"])
