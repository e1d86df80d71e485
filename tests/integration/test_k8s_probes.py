"""The commands deploy/k8s's pods run as probes and init containers, against real servers:
`pdserve ready --heartbeat` hears a worker's own heartbeat as that worker's NATS user (and that user hears
no other worker's), and `pdserve migrate --wait` tells a migrated database from one that is not, reading
as a service role."""

from __future__ import annotations

import asyncio

import nats
import pytest

from pdserve.cli.main import main as pdserve
from pdserve.cli.readiness import heartbeating
from pdserve.embedded import free_port, start_nats
from pdserve.messages import Subjects
from pdserve.nats_auth import stack_users, write_server_config
from pdserve.service_plan import role_url, service_plan
from pdserve.store.migrate import create_database, current_revision, drop_database, head_revision


@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("probe-nats")
    users = {u.name: u for u in stack_users([(s.name, s.role) for s in service_plan("disaggregated")], "pp")}
    write_server_config(tmp / "auth.conf", users.values())
    server = start_nats(tmp / "js", port=free_port(), config_path=tmp / "auth.conf")
    try:
        yield server.url, users
    finally:
        server.stop()


async def test_a_worker_hears_its_own_heartbeat_and_no_other(secured):
    url, users = secured
    beating = await nats.connect(url, user="decode-0", password=users["decode-0"].password)
    stop = asyncio.Event()

    async def beat() -> None:
        while not stop.is_set():
            await beating.publish("pp.heartbeat.decode-0", b"{}")
            await asyncio.sleep(0.1)

    task = asyncio.create_task(beat())
    try:
        subjects = Subjects("pp")

        def as_user(name: str, worker: str) -> set[str]:
            creds = {"user": name, "password": users[name].password}
            return heartbeating(url, subjects, [worker], window_s=1.0, credentials=creds)

        assert await asyncio.to_thread(as_user, "decode-0", "decode-0") == {"decode-0"}
        assert await asyncio.to_thread(as_user, "prefill-0", "decode-0") == set()  # not its own: refused
        assert await asyncio.to_thread(as_user, "prefill-0", "prefill-0") == set()  # not beating
    finally:
        stop.set()
        await task
        await beating.close()


def test_pdserve_ready_exits_by_what_it_heard(secured, monkeypatch):
    url, users = secured
    monkeypatch.setenv("PDS_NATS_URL", url)
    monkeypatch.setenv("PDS_SUBJECT_PREFIX", "pp")
    monkeypatch.setenv("PDS_NATS_USER", "prefill-0")
    monkeypatch.setenv("PDS_NATS_PASSWORD", users["prefill-0"].password)
    monkeypatch.setenv("PDS_WORKER_ID", "prefill-0")
    assert pdserve(["ready", "--heartbeat", "--window", "0.5"]) == 1  # nobody beats as prefill-0
    monkeypatch.delenv("PDS_WORKER_ID")
    assert pdserve(["ready", "--heartbeat"]) == 2


def test_migrate_wait_tells_a_migrated_database_from_an_empty_one(database_url, postgres_admin_url, run_id):
    reader = role_url(database_url, "pdserve_reader")
    assert current_revision(reader) == head_revision()
    assert pdserve(["migrate", "--wait", "--timeout", "0", "--database-url", reader]) == 0
    empty = create_database(postgres_admin_url, f"pdserve_test_{run_id}_empty")
    try:
        assert current_revision(empty) is None
        assert pdserve(["migrate", "--wait", "--timeout", "0", "--database-url", empty]) == 1
    finally:
        drop_database(postgres_admin_url, f"pdserve_test_{run_id}_empty")
