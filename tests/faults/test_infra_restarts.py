"""Postgres stopped for 30 s under load, and the NATS server restarted under load, each on a stack of its own
whose server is an embedded one this test can stop and start (pdserve.embedded)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator

import pytest

from pdserve.embedded import free_port, start_nats, start_postgres
from pdserve.store.migrate import create_database, upgrade
from tests.e2e.stack import Stack
from tests.faults.load import PROMPTS, check_results, expected_outputs, recorded_lifecycles, run_load

pytestmark = [pytest.mark.faults, pytest.mark.slow]
MAX_TOKENS = 48
PG_DOWN_S = 30.0


@pytest.fixture
def own_postgres(tmp_path) -> Iterator[dict]:
    """An embedded Postgres with a migrated database; `restart()` and `stop()` control it."""
    data_dir = tmp_path / "pg"
    state = {"server": start_postgres(data_dir)}
    state["url"] = create_database(state["server"].url, "pdserve_faults")
    upgrade(state["url"])
    state["start"] = lambda: state.__setitem__("server", start_postgres(data_dir))
    yield state
    state["server"].stop()


async def _published_and_recorded(stack: Stack, store) -> tuple[int, int]:
    """(events in the JetStream stream, rows in the events table)."""
    import sqlalchemy as sa

    db, bus = store
    info = await bus.js.stream_info(stack.settings.events_stream)
    async with db.connect() as conn:
        rows = (await conn.execute(sa.text("SELECT count(*) FROM events"))).scalar_one()
    return info.state.messages, rows


async def test_postgres_down_30s_under_load_loses_no_event_and_serving_goes_on(
    settings, own_postgres, tmp_path, reference, fault_env
):
    from pdserve.bus import Bus
    from pdserve.store.queries import make_db

    stack_settings = settings.model_copy(
        update={
            "database_url": own_postgres["url"],
            "subject_prefix": f"{settings.subject_prefix}pg",
            "events_stream": f"{settings.events_stream}_pg",
        }
    )
    stack = Stack(stack_settings, tmp_path / "stack").start()
    outage: dict[str, float] = {}
    try:

        def fault() -> None:
            outage["start"] = time.time()
            own_postgres["server"].stop()
            time.sleep(PG_DOWN_S)
            own_postgres["start"]()
            outage["end"] = time.time()

        prompts = PROMPTS * 3
        pg = threading.Thread(target=fault)

        def load() -> list:
            return run_load(stack.url, prompts, MAX_TOKENS, pg.start, stagger_s=1.0, during_at=2)

        results = await asyncio.to_thread(load)
        await asyncio.to_thread(pg.join)
        db = make_db(own_postgres["url"])
        bus = await Bus.connect(stack_settings, "fault-test")
        try:
            store = (db, bus)
            lifecycles = await recorded_lifecycles(store, [r.request_id for r in results], timeout_s=120)
            check_results(results, expected_outputs(reference, prompts, MAX_TOKENS), reference[1], lifecycles)
            published, recorded = await _published_and_recorded(stack, store)
        finally:
            await bus.close()
            await db.dispose()
    finally:
        stack.stop()
    assert published == recorded
    # Serving never paused: requests admitted while Postgres was down completed (their streams ended).
    during = [r for r in results if outage["start"] < lifecycles[r.request_id][0].ts < outage["end"]]
    assert len(during) >= 10


@pytest.fixture
def own_nats(tmp_path) -> Iterator[dict]:
    store_dir, port = tmp_path / "nats", free_port()
    state = {"server": start_nats(store_dir, port)}
    state["restart"] = lambda: (
        state["server"].stop(),
        state.__setitem__("server", start_nats(store_dir, port)),
    )
    yield state
    state["server"].stop()


async def test_nats_restarted_under_load_services_reconnect_and_in_flight_requests_end(
    isolated_settings, own_nats, tmp_path, fault_env
):
    stack_settings = isolated_settings("natsrestart").model_copy(update={"nats_url": own_nats["server"].url})
    stack = Stack(stack_settings, tmp_path / "stack").start()
    try:
        results = await asyncio.to_thread(run_load, stack.url, PROMPTS, 160, own_nats["restart"], 8)
        for r in results:  # every request ended: completed, or failed with a reason
            assert r.finish_reason == "length" or r.error, r
        stack.wait_ready(60)  # every service is back on the restarted server
    finally:
        stack.stop()
