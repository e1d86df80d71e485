"""`pdserve sim --replay`: the completed requests of an event store (Postgres) become the simulator's
workload — arrival times from `received_at`, lengths from the `requests` projection, prompt block hashes
from `RequestRouted` — and a shared prefix in the log is a prefix-cache hit in the simulation."""

from __future__ import annotations

import asyncio
import random
import time
from datetime import UTC, datetime

import pytest

from pdserve.engine.block_hash import hash_blocks
from pdserve.events import Event, RequestRouted
from pdserve.ids import new_id
from pdserve.sim.cluster import simulate
from pdserve.sim.replay import replay_requests
from pdserve.store.queries import make_db
from pdserve.store.rows import event_row
from pdserve.store.tables import events, requests
from tests.unit.test_sim import colocated

T0 = time.time() + 40 * 86400  # in a database of this module's own (`own_database_url` below)
PROMPT = list(range(1000, 1100))  # every logged request has this prompt: 6 full shared blocks


async def _log(url: str) -> list[str]:
    db = make_db(url)
    ids, rows, evs = [], [], []
    for i in range(3):
        rid = new_id()
        ids.append(rid)
        received = datetime.fromtimestamp(T0 + 2 * i, UTC)
        rows.append(
            {
                "request_id": rid,
                "state": "completed",
                "model": "tiny",
                "mode": "colocated",
                "prompt_tokens": len(PROMPT),
                "completion_tokens": 4 + i,
                "received_at": received,
                "finished_at": received,
                "last_stream_seq": 0,
            }
        )
        evs.append(
            Event.of(
                rid,
                RequestRouted(
                    mode="colocated",
                    prefill_worker_id="unified-0",
                    decode_worker_id="unified-0",
                    candidates=[],
                    predicted_cached_tokens=0,
                    best_cached_tokens=0,
                    route_s=0.001,
                    policy="kv",
                    block_size=16,
                    prompt_block_hashes=hash_blocks(PROMPT, 16),
                ),
                service="coordinator",
            ).model_copy(update={"ts": T0 + 2 * i})
        )
    base = 10**12 + random.randrange(10**9)
    async with db.begin() as conn:
        await conn.execute(requests.insert(), rows)
        await conn.execute(events.insert(), [event_row(e, base + k) for k, e in enumerate(evs)])
    await db.dispose()
    return ids


@pytest.fixture(scope="module")
def own_database_url(isolated_settings) -> str:
    """A database of this module's own: a replay reads every completed request of its window."""
    return isolated_settings("sim_replay").database_url


def test_replay_reads_arrivals_lengths_and_block_hashes(own_database_url):
    asyncio.run(_log(own_database_url))
    reqs = replay_requests(own_database_url, datetime.fromtimestamp(T0 - 1, UTC))
    assert [r.arrival_s for r in reqs] == pytest.approx([0.0, 2.0, 4.0])
    assert [(r.prompt_len, r.output_len) for r in reqs] == [(100, 4), (100, 5), (100, 6)]
    assert all(r.block_hashes == tuple(hash_blocks(PROMPT, 16)) for r in reqs)
    result = simulate(colocated(), reqs)
    assert list(result.cached_tokens) == [0, 96, 96]


def test_replay_of_an_empty_window_says_so(own_database_url):
    with pytest.raises(ValueError, match="no completed request"):
        replay_requests(own_database_url, datetime.fromtimestamp(T0 + 3600, UTC))
