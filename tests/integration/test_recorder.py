"""The recorder against real NATS JetStream and Postgres: every event once, in stream order, with its
projection; replay reproduces the projection; outages of the recorder or of Postgres lose nothing."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime

import pytest
import sqlalchemy as sa
from prometheus_client import REGISTRY
from sqlalchemy.util import await_only

from pdserve.bus import Bus
from pdserve.cli import replay
from pdserve.config import CommonSettings, RecorderSettings
from pdserve.events import Event
from pdserve.ids import new_id
from pdserve.store.projection import fold
from pdserve.store.queries import (
    lifecycle,
    lifecycle_records,
    make_db,
    rebuild_projections,
    request_row,
    request_snapshot,
    unfinished_requests,
)
from pdserve.store.recorder import Recorder, caught_up
from pdserve.store.tables import events, requests
from tests.unit.test_projection import full_lifecycle, migrated_lifecycle

UNREACHABLE_DB = "postgresql+asyncpg://postgres@127.0.0.1:1/nowhere"


@pytest.fixture(scope="module")
def own_settings(isolated_settings) -> CommonSettings:
    """A database, stream and subject prefix of this module's own: its replays rebuild every projection
    of the database, which must hold no other module's events (test_router_report, test_advise write
    theirs into the run's shared one)."""
    return isolated_settings("recorder")


@pytest.fixture(scope="module")
async def db(own_settings: CommonSettings) -> AsyncIterator:
    e = make_db(own_settings.database_url)
    yield e
    await e.dispose()


@pytest.fixture(scope="module")
async def bus(own_settings: CommonSettings) -> AsyncIterator[Bus]:
    b = await Bus.connect(own_settings, "test-recorder")
    yield b
    await b.close()


@pytest.fixture(scope="module")
def recorder_settings(own_settings: CommonSettings) -> RecorderSettings:
    # A small batch so a test's events span several transactions.
    return RecorderSettings(**own_settings.model_dump(), batch_size=7, fetch_timeout_s=0.1)


async def publish(bus: Bus, event: Event, msg_id: str | None = None) -> None:
    """Publish as `Bus.emit` does, awaited so the stream order is the call order."""
    await bus.js.publish(bus.subjects.event(event.request_id, event.type), event.model_dump_json().encode(),
                         headers={"Nats-Msg-Id": msg_id or event.event_id})


async def run_recorder(bus: Bus, db, settings: RecorderSettings):
    stop = asyncio.Event()
    task = asyncio.create_task(Recorder(bus, db, settings).run(stop))
    return stop, task


async def wait_recorded(bus: Bus, timeout_s: float = 20.0) -> None:
    """Until Postgres holds every event published so far."""
    async with asyncio.timeout(timeout_s):
        while not await caught_up(bus):
            await asyncio.sleep(0.05)


async def record_all(bus: Bus, db, settings: RecorderSettings) -> None:
    """Run a recorder until Postgres holds every event published so far, then stop it."""
    stop, task = await run_recorder(bus, db, settings)
    try:
        await wait_recorded(bus)
    finally:
        stop.set()
        await task


async def stored_rows(db, request_ids: list[str]) -> list[dict]:
    async with db.connect() as conn:
        q = sa.select(events).where(events.c.request_id.in_(request_ids)).order_by(events.c.stream_seq)
        return [dict(r) for r in (await conn.execute(q)).mappings()]


async def projection_snapshot(db) -> list[dict]:
    async with db.connect() as conn:
        q = sa.select(requests).order_by(requests.c.request_id)
        return [dict(r) for r in (await conn.execute(q)).mappings()]


async def test_every_event_is_recorded_once_in_stream_order_with_its_projection(
    bus, db, recorder_settings
):
    rids = [new_id() for _ in range(3)]
    lives = {rid: full_lifecycle(rid) for rid in rids}
    # Interleave the three requests, as concurrent requests interleave on the stream.
    for step in range(len(lives[rids[0]])):
        for rid in rids:
            await publish(bus, lives[rid][step])
    unknown = Event(request_id=rids[0], type="KVMigrated", service="decode", payload={"to": "decode-2"})
    await publish(bus, unknown)
    await publish(bus, lives[rids[1]][0])  # same Nats-Msg-Id: JetStream drops it
    await publish(bus, lives[rids[2]][4], msg_id=new_id())  # past the dedup window: stored twice in JetStream
    await publish(bus, lives[rids[2]][0], msg_id=new_id())
    await bus.js.publish(bus.subjects.event(rids[0], "Garbage"), b"not an event")  # terminated, not blocking

    await record_all(bus, db, recorder_settings)

    rows = await stored_rows(db, rids)
    expected_ids = {e.event_id for life in lives.values() for e in life} | {unknown.event_id}
    assert sorted(r["event_id"] for r in rows) == sorted(expected_ids)
    seqs = [r["stream_seq"] for r in rows]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    for rid in rids:
        recorded = await lifecycle(db, rid)
        want = lives[rid] + ([unknown] if rid == rids[0] else [])
        assert [e.event_id for e in recorded] == [e.event_id for e in want]
        assert recorded == [e.model_copy(update={"ts": r.ts, "seq": i})  # seq: the per-request rank, on read
                            for i, (e, r) in enumerate(zip(want, recorded, strict=True), start=1)]
        assert all(abs(e.ts - r.ts) < 1e-6 for e, r in zip(want, recorded, strict=True))
        row = await request_row(db, rid)
        assert row == fold(await lifecycle_records(db, rid))
        assert row["state"] == "completed" and row["completion_tokens"] == 8 and row["cached_tokens"] == 16


async def test_replay_twice_gives_the_projection_the_recorder_wrote(bus, db, recorder_settings):
    rid, migrating, recovering = new_id(), new_id(), new_id()
    for event in full_lifecycle(rid)[:7]:
        await publish(bus, event)
    for event in migrated_lifecycle(migrating)[:11]:
        await publish(bus, event)
    for event in migrated_lifecycle(recovering)[:13]:
        await publish(bus, event)
    await record_all(bus, db, recorder_settings)

    live = await projection_snapshot(db)
    assert (await request_row(db, rid))["state"] == "prefilling"
    assert (await request_row(db, migrating))["state"] == "migrating"
    assert (await request_row(db, recovering))["state"] == "recovering"
    assert rid in {r["request_id"] for r in await unfinished_requests(db)}
    n = await rebuild_projections(db)
    first = await projection_snapshot(db)
    assert n == len(first) == len(live) >= 1
    assert await rebuild_projections(db) == n
    assert await projection_snapshot(db) == first == live


async def test_replay_since_recomputes_only_requests_with_recent_events(bus, db, recorder_settings):
    rid = new_id()
    for event in full_lifecycle(rid, t0=time.time() + 3600):  # the newest events in the table
        await publish(bus, event)
    await record_all(bus, db, recorder_settings)
    everything = await projection_snapshot(db)
    since = datetime.fromtimestamp(time.time() + 1800, UTC)
    assert await rebuild_projections(db, since=since) == 1
    assert await projection_snapshot(db) == everything


async def test_an_older_event_committed_after_newer_ones_still_folds_in_stream_order(
    bus, db, recorder_settings
):
    rid = new_id()
    life = full_lifecycle(rid)
    for event in life:
        await publish(bus, event)
    durable = f"test-{rid[-12:]}"
    sub = await bus.js.pull_subscribe(bus.subjects.event(rid, "*"), durable=durable,
                                      stream=recorder_settings.events_stream)
    msgs = await sub.fetch(len(life), timeout=5)
    recorder = Recorder(bus, db, recorder_settings, durable=durable)
    await recorder.record(msgs[6:])
    await recorder.record(msgs[:6])  # as if a crashed recorder's batch were redelivered late
    await sub.unsubscribe()
    await bus.js.delete_consumer(recorder_settings.events_stream, durable)
    row = await request_row(db, rid)
    assert row == fold((i + 1, e) for i, e in enumerate(life)) | {"last_stream_seq": row["last_stream_seq"]}
    assert row["state"] == "completed" and row["received_at"] is not None


async def test_events_published_while_the_recorder_is_stopped_are_recorded_when_it_starts(
    bus, db, recorder_settings
):
    rid = new_id()
    life = full_lifecycle(rid)
    stop, task = await run_recorder(bus, db, recorder_settings)
    for event in life[:4]:
        await publish(bus, event)
    await wait_recorded(bus)
    stop.set()
    await task
    assert (await request_row(db, rid))["state"] == "reserved"

    for event in life[4:]:
        await publish(bus, event)
    assert len(await lifecycle(db, rid)) == 4  # nobody records while stopped

    await record_all(bus, db, recorder_settings)
    assert [e.event_id for e in await lifecycle(db, rid)] == [e.event_id for e in life]
    assert (await request_row(db, rid))["state"] == "completed"


async def test_events_wait_unacked_in_jetstream_while_postgres_is_unreachable(bus, db, recorder_settings):
    rid = new_id()
    life = full_lifecycle(rid)
    for event in life:
        await publish(bus, event)

    dead = make_db(UNREACHABLE_DB)
    stop, task = await run_recorder(bus, dead, recorder_settings)
    await asyncio.sleep(1.0)
    lag = REGISTRY.get_sample_value("pdserve:events_recorder_lag_seconds")
    info = await bus.js.consumer_info(recorder_settings.events_stream, "pdserve-recorder")
    stop.set()
    await task
    await dead.dispose()
    assert lag > 0
    assert info.num_ack_pending + info.num_pending >= len(life)
    assert await lifecycle(db, rid) == []

    await record_all(bus, db, recorder_settings)
    assert [e.event_id for e in await lifecycle(db, rid)] == [e.event_id for e in life]
    assert (await request_row(db, rid))["state"] == "completed"


async def test_recording_resumes_after_its_consumer_is_deleted(bus, db, recorder_settings):
    rid = new_id()
    life = full_lifecycle(rid)
    stop = asyncio.Event()
    recorder = Recorder(bus, db, recorder_settings, consumer_check_s=0.2)
    task = asyncio.create_task(recorder.run(stop))
    try:
        await publish(bus, life[0])
        await wait_recorded(bus)
        await bus.js.delete_consumer(recorder_settings.events_stream, "pdserve-recorder")
        for event in life[1:]:
            await publish(bus, event)
        await wait_recorded(bus)  # False until the recorder binds a new consumer and replays the stream
    finally:
        stop.set()
        await task
    assert [e.event_id for e in await lifecycle(db, rid)] == [e.event_id for e in life]
    assert (await request_row(db, rid))["state"] == "completed"


async def test_a_request_read_while_its_events_commit_is_one_snapshot(bus, db, recorder_settings):
    """The recorder commits a batch's events and its projection row together; `GET /v1/requests/{id}`
    and `pdserve replay --request` read both. Here the whole lifecycle commits between the reader's two
    statements: read apart they gave a complete lifecycle beside no row (seen in a CI run once batches
    lingered 0.25 s)."""
    rid = new_id()
    for event in full_lifecycle(rid):
        await publish(bus, event)
    reader = make_db(db.url.render_as_string(hide_password=False))
    seen: list[str] = []

    def commit_between(conn, cursor, statement, parameters, context, executemany) -> None:
        seen.append(statement)
        if "FROM events" in statement and not any("FROM events" in q for q in seen[:-1]):
            # the row was read, the events are next: record the whole lifecycle now
            await_only(record_all(bus, db, recorder_settings))

    sa.event.listen(reader.sync_engine, "before_cursor_execute", commit_between)
    try:
        row, records = await request_snapshot(reader, rid)
    finally:
        await reader.dispose()
    assert [("FROM requests" in q, "FROM events" in q) for q in seen] == [(True, False), (False, True)]
    assert (row, records) == (None, [])  # the snapshot predates the commit: neither half of it
    row, records = await request_snapshot(db, rid)
    assert row is not None and row == fold(records) and row["state"] == "completed"


async def test_unknown_or_malformed_request_ids_have_no_lifecycle(db):
    assert await lifecycle(db, new_id()) == []
    assert await lifecycle(db, "not-a-uuid") == []
    assert await request_row(db, "not-a-uuid") is None


async def _pdserve(*args: str) -> tuple[int, str]:
    """The real `pdserve` entry point in a child process: exit status and output."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "pdserve.cli.main", *args, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT, env={**os.environ, "COLUMNS": "200"})
    out, _ = await proc.communicate()
    return proc.returncode, out.decode()


async def _replay(capsys, *args: str) -> tuple[int, str]:
    """`pdserve replay` in this process (in a thread: it runs its own event loop)."""
    parser = argparse.ArgumentParser()
    replay.add_parsers(parser.add_subparsers())
    parsed = parser.parse_args(["replay", *args])
    capsys.readouterr()
    code = await asyncio.to_thread(parsed.func, parsed)
    return code, capsys.readouterr().out


async def test_replay_command_prints_a_lifecycle_in_stream_order_and_rebuilds(
    bus, db, recorder_settings, tmp_path, monkeypatch, capsys
):
    database_url = recorder_settings.database_url
    rid = new_id()
    life = full_lifecycle(rid)
    for event in life:
        await publish(bus, event)
    await record_all(bus, db, recorder_settings)
    before = await projection_snapshot(db)

    code, out = await _pdserve("replay", "--request", rid, "--database-url", database_url)
    assert code == 0, out
    lines = [ln for ln in out.splitlines() if any(f" {e.type} " in ln for e in life)]
    assert [next(e.type for e in life if f" {e.type} " in ln) for ln in lines] == [e.type for e in life]
    assert "state completed (length)" in out and "TTFT 236.0 ms" in out

    # No flag, no environment: the URL comes from the running stack's var/run/stack.json.
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "stack.json").write_text(json.dumps({
        "supervisor_pid": 1, "supervisor_create_time": 0.0, "mode": "disaggregated", "model": "tiny",
        "var_dir": str(tmp_path), "nats_url": bus.settings.nats_url, "database_url": database_url,
        "gateway_url": "http://127.0.0.1:8000"}))
    monkeypatch.setenv("PDS_VAR_DIR", str(tmp_path))
    monkeypatch.delenv("PDS_DATABASE_URL", raising=False)
    code, out = await _replay(capsys)
    assert code == 0, out
    assert f"rebuilt {len(before)} request rows" in out
    assert await projection_snapshot(db) == before

    code, out = await _replay(capsys, "--request", new_id(), "--database-url", database_url)
    assert code == 1 and "no events recorded" in out
    code, out = await _replay(capsys, "--database-url", UNREACHABLE_DB)
    assert code == 2 and "cannot read the event store" in out
