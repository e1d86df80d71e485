"""The `pdserve up` supervisor: backing services, migrations, restarts, stack.json, clean stop.

The supervised process here is a stand-in service (written to tmp_path, found through PYTHONPATH) that
records the environment it got, crashes on its first run and runs until SIGTERM afterwards, so these tests
exercise the supervisor alone, whatever the state of the real services.
"""

from __future__ import annotations

import asyncio
import json
import os
import textwrap
import uuid
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import asyncpg
import nats
import psutil
import pytest
from sqlalchemy.engine import make_url

from pdserve.nats_auth import read_users
from pdserve.process import is_alive
from pdserve.service_plan import ServiceSpec, role_url
from pdserve.stack_state import StackState, read_state, state_path
from pdserve.supervisor import Supervisor, parse_args

STAND_IN = textwrap.dedent(
    """
    import json, os, signal, sys, time
    from pathlib import Path

    seen = Path(os.environ["PDS_VAR_DIR"]) / (os.environ["PDS_WORKER_ID"] + ".runs")
    runs = seen.read_text().splitlines() if seen.exists() else []
    env = {k: v for k, v in os.environ.items() if k.startswith("PDS_")}
    seen.write_text("\\n".join([*runs, json.dumps(env)]))
    if not runs:
        sys.exit(3)  # the first run dies: the supervisor must restart it
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    while True:
        time.sleep(0.1)
    """
)


@pytest.fixture
def stand_in(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[ServiceSpec]:
    (tmp_path / "pds_stand_in.py").write_text(STAND_IN)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    return [
        ServiceSpec("decode-0", "pds_stand_in", "decode"),
        ServiceSpec("gateway", "pds_stand_in", "gateway"),
    ]


async def wait_for(predicate, timeout_s: float = 30.0, explain=lambda: "") -> None:
    for _ in range(int(timeout_s / 0.1)):
        if predicate():
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"condition not reached in {timeout_s} s {explain()}")


def explain_stack(var_dir: Path) -> str:
    """What the supervisor recorded and what each stand-in saw: the reason of a failed wait."""
    parts = [f"state: {read_state(var_dir)}"]
    for path in sorted(var_dir.glob("*.runs")) + sorted((var_dir / "log").glob("*.log")):
        parts.append(f"{path.name}: {path.read_text(errors='replace')[-2000:]!r}")
    return "\n".join(parts)


def restarted_and_running(var_dir: Path, names: list[str]) -> bool:
    """Every stand-in was restarted once by the supervisor and its second run has begun."""
    state = read_state(var_dir)
    return state is not None and all(
        n in state.services
        and state.services[n].restarts == 1
        and (var_dir / f"{n}.runs").exists()
        and len((var_dir / f"{n}.runs").read_text().splitlines()) == 2
        for n in names
    )


async def table_names(database_url: str) -> set[str]:
    dsn = make_url(database_url).set(drivername="postgresql").render_as_string(hide_password=False)
    conn = await asyncpg.connect(dsn)
    try:
        return {r["tablename"] for r in await conn.fetch("SELECT tablename FROM pg_tables")}
    finally:
        await conn.close()


async def run_stack(
    var_dir: Path,
    plan: list[ServiceSpec],
    while_running: Callable[[StackState], Awaitable[None]] | None = None,
) -> tuple[StackState, dict[str, list[dict]]]:
    """Run the supervisor until every stand-in was restarted once, call `while_running`, stop the stack and
    check that nothing it started is left. Returns the state while running and what each stand-in saw
    (its PDS_* environment) on each run."""
    supervisor = Supervisor(
        parse_args(["--var-dir", str(var_dir), "--model", "tiny", "--port", "18123"]), plan
    )
    running = asyncio.create_task(supervisor.run())
    try:
        await wait_for(lambda: running.done() or restarted_and_running(var_dir, [s.name for s in plan]),
                       explain=lambda: explain_stack(var_dir))
        assert not running.done(), f"supervisor exited early: {read_state(var_dir)}"
        state = read_state(var_dir)
        assert state is not None
        if while_running is not None:
            await while_running(state)
    finally:
        supervisor.stop()
        assert await asyncio.wait_for(running, 60) == 0
    runs = {
        s.name: [json.loads(line) for line in (var_dir / f"{s.name}.runs").read_text().splitlines()]
        for s in plan
    }
    assert not state_path(var_dir).exists()
    for svc in state.services.values():
        assert not is_alive(svc.ref)
    for server in state.servers.values():
        assert not psutil.pid_exists(server.pid)
    return state, runs


async def test_supervisor_runs_embedded_servers_migrates_restarts_a_dead_child_and_stops_everything(
    tmp_path: Path, stand_in: list[ServiceSpec], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PDS_NATS_URL", raising=False)
    monkeypatch.delenv("PDS_DATABASE_URL", raising=False)
    var_dir = tmp_path / "var"
    seen: dict[str, set[str]] = {}

    async def while_running(state: StackState) -> None:
        nc = await nats.connect(state.nats_url, **state.nats_admin_credentials())
        await nc.jetstream().account_info()  # JetStream is on
        await nc.close()
        with pytest.raises(Exception):  # noqa: B017 (nats-py raises its last connect error, whichever)
            await nats.connect(state.nats_url, max_reconnect_attempts=0, allow_reconnect=False,
                               connect_timeout=2)  # no user: refused
        seen["tables"] = await table_names(state.database_url)

    state, runs = await run_stack(var_dir, stand_in, while_running)

    assert set(state.servers) == {"nats", "postgres"}
    assert make_url(state.database_url).database == "pdserve"
    assert "alembic_version" in seen["tables"]
    assert [len(r) for r in runs.values()] == [2, 2]
    decode_env = runs["decode-0"][1]
    assert decode_env["PDS_WORKER_ID"] == "decode-0" and decode_env["PDS_ROLE"] == "decode"
    assert decode_env["PDS_NATS_URL"] == state.nats_url
    assert decode_env["PDS_DATABASE_URL"] == role_url(state.database_url, "pdserve_reader")
    assert runs["gateway"][1]["PDS_DATABASE_URL"] == role_url(state.database_url, "pdserve_gateway")
    # Each process connects as its own NATS user; its password is in the 0600 users file, not in its env.
    users_file = Path(state.nats_users_file)
    assert (decode_env["PDS_NATS_USER"], decode_env["PDS_NATS_USERS_FILE"]) == ("decode-0", str(users_file))
    assert "PDS_NATS_PASSWORD" not in decode_env and users_file.stat().st_mode & 0o777 == 0o600
    assert set(read_users(users_file)) == {"admin", "decode-0", "gateway"}
    assert decode_env["PDS_MODEL"] == "tiny" and Path(decode_env["PDS_VAR_DIR"]) == var_dir.resolve()
    assert "PDS_PORT" not in decode_env and runs["gateway"][1]["PDS_PORT"] == "18123"
    assert (var_dir / "log" / "decode-0.log").exists()


@pytest.fixture
def given_servers(
    monkeypatch: pytest.MonkeyPatch, nats_url: str, postgres_admin_url: str, run_id: str
) -> Iterator[str]:
    """`PDS_NATS_URL` / `PDS_DATABASE_URL` set to the test run's servers, with a database of this test's
    own that does not exist yet (dropped afterwards). Yields the database URL."""
    from pdserve.store.migrate import drop_database

    name = f"pdserve_stack_{run_id}_{uuid.uuid4().hex[:6]}"
    database_url = make_url(postgres_admin_url).set(database=name).render_as_string(hide_password=False)
    monkeypatch.setenv("PDS_NATS_URL", nats_url)
    monkeypatch.setenv("PDS_DATABASE_URL", database_url)
    yield database_url
    drop_database(postgres_admin_url, name)


async def test_supervisor_uses_given_servers_and_creates_the_database_if_absent(
    tmp_path: Path, stand_in: list[ServiceSpec], given_servers: str, nats_url: str
) -> None:
    database_url = given_servers
    state, runs = await run_stack(tmp_path / "var", stand_in[:1])
    assert state.servers == {}
    assert state.nats_url == nats_url and state.database_url == database_url
    assert runs["decode-0"][1]["PDS_DATABASE_URL"] == role_url(database_url, "pdserve_reader")
    assert "PDS_NATS_USER" not in runs["decode-0"][1] and not state.nats_users_file  # a given NATS: as is
    assert "alembic_version" in await table_names(database_url)  # migrated, not just created
    nc = await nats.connect(nats_url)  # the given server is left running
    await nc.close()


async def test_a_child_gone_before_its_pid_is_recorded_is_still_restarted(
    tmp_path: Path, stand_in: list[ServiceSpec], monkeypatch: pytest.MonkeyPatch, given_servers: str
) -> None:
    """The stand-in's first run exits at once; when it is reaped before the supervisor reads its creation
    time (psutil.NoSuchProcess — a race that a loaded machine wins), the supervisor still waits for its exit
    and restarts it, instead of losing the service."""
    from pdserve.process import ProcessRef

    original, children = ProcessRef.of, []

    def gone_on_first_child(pid: int) -> ProcessRef:
        if pid != os.getpid():
            children.append(pid)
            if len(children) == 1:
                raise psutil.NoSuchProcess(pid)
        return original(pid)

    monkeypatch.setattr(ProcessRef, "of", staticmethod(gone_on_first_child))
    _, runs = await run_stack(tmp_path / "var", stand_in[:1])
    assert len(children) >= 2 and len(runs["decode-0"]) == 2
