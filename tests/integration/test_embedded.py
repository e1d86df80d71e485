"""The embedded servers `pdserve up` and the test fixtures fall back to: real nats-server and PostgreSQL."""

from __future__ import annotations

import socket
from pathlib import Path

import asyncpg
import nats
import psutil
import pytest
from sqlalchemy.engine import make_url

import pdserve.embedded as embedded
from pdserve.embedded import start_nats, start_postgres


def _asyncpg_dsn(sqlalchemy_url: str) -> str:
    return make_url(sqlalchemy_url).set(drivername="postgresql").render_as_string(hide_password=False)


async def test_embedded_nats_serves_jetstream_and_keeps_streams_across_restart(tmp_path: Path) -> None:
    server = start_nats(tmp_path / "js")
    try:
        nc = await nats.connect(server.url)
        js = nc.jetstream()
        await js.add_stream(name="EMBEDDED", subjects=["embedded.>"])
        ack = await js.publish("embedded.a", b"kv", headers={"Nats-Msg-Id": "e1"})
        duplicate = await js.publish("embedded.a", b"kv", headers={"Nats-Msg-Id": "e1"})
        await nc.close()
        assert ack.seq == 1 and duplicate.duplicate
    finally:
        server.stop()
    assert not psutil.pid_exists(server.pid)

    again = start_nats(tmp_path / "js")
    try:
        nc = await nats.connect(again.url)
        msg = await nc.jetstream().get_msg("EMBEDDED", 1)
        await nc.close()
        assert msg.data == b"kv"
    finally:
        again.stop()


async def test_embedded_nats_moves_to_a_free_port_when_the_default_is_taken(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        taken = squatter.getsockname()[1]
        monkeypatch.setattr(embedded, "NATS_DEFAULT_PORT", taken)
        server = start_nats(tmp_path / "js")
        try:
            assert not server.url.endswith(f":{taken}")
            assert f"port {taken} is in use" in server.note
            nc = await nats.connect(server.url)
            assert nc.is_connected
            await nc.close()
        finally:
            server.stop()


async def test_embedded_postgres_answers_on_its_unix_socket_and_stops(tmp_path: Path) -> None:
    server = start_postgres(tmp_path / "pg")
    try:
        url = make_url(server.url)
        assert url.drivername == "postgresql+asyncpg" and url.database == "postgres" and url.host is None
        assert Path(url.query["host"]).is_dir()
        conn = await asyncpg.connect(_asyncpg_dsn(server.url))
        try:
            await conn.execute("CREATE DATABASE embedded_check")
            names = await conn.fetch("SELECT datname FROM pg_database")
            user = await conn.fetchval("SELECT current_user")
        finally:
            await conn.close()
        assert "embedded_check" in {r["datname"] for r in names}
        assert user == "postgres"
    finally:
        server.stop()
    assert not psutil.pid_exists(server.pid)
    with pytest.raises((OSError, asyncpg.PostgresError)):
        await asyncpg.connect(_asyncpg_dsn(server.url), timeout=2)
