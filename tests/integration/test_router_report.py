"""`pdserve report routing` and `pdserve replay --routing` on a synthetic event log in Postgres."""

from __future__ import annotations

import argparse
import json
import random
import time
from datetime import UTC, datetime

import pytest

from pdserve.cli import main as cli
from pdserve.cli.report import load_report
from pdserve.engine.block_hash import hash_blocks
from pdserve.events import Event, PrefillCompleted, RequestReceived, RequestRouted
from pdserve.ids import new_id
from pdserve.messages import CandidateCost, Role
from pdserve.routing.log import routed_requests
from pdserve.routing.replay import logged_config, replay_routing
from pdserve.store.queries import make_db
from pdserve.store.rows import event_row
from pdserve.store.tables import events

T0 = time.time() + 30 * 86400  # a window no other test writes into
WORKERS = ("prefill-0", "prefill-1", "prefill-2")
# (replica, prompt tokens, predicted cached, best cached any worker held, actual cached, active per worker)
LOG = [
    ("prefill-0", 100, 0, 0, 0, (0, 0, 0)),
    ("prefill-1", 100, 0, 64, 0, (1, 0, 0)),
    ("prefill-0", 200, 64, 64, 64, (0, 1, 0)),
    ("prefill-2", 120, 96, 96, 80, (2, 1, 0)),
    ("prefill-0", 80, 48, 48, 48, (1, 1, 1)),
]
TIER_SPLIT = {3: {"pool": 48, "offload": 32}}  # LOG[3]: 80 cached tokens, 32 of them from offload


def synthetic_log() -> list[Event]:
    out = []
    for i, (replica, prompt, predicted, best, actual, active) in enumerate(LOG):
        rid, t = new_id(), T0 + i
        cands = [
            CandidateCost(worker_id=w, role=Role.PREFILL, cost=1.0, active_requests=a, kv_usage=0.0)
            for w, a in zip(WORKERS, active, strict=True)
        ]
        out += [
            Event.of(
                rid,
                RequestReceived(
                    model="tiny",
                    endpoint="/v1/completions",
                    num_prompt_tokens=prompt,
                    max_tokens=4,
                    stream=False,
                ),
                service="gateway",
            ).model_copy(update={"ts": t}),
            Event.of(
                rid,
                RequestRouted(
                    mode="disaggregated",
                    prefill_worker_id=replica,
                    decode_worker_id="decode-0",
                    candidates=cands,
                    predicted_cached_tokens=predicted,
                    best_cached_tokens=best,
                    route_s=0.001,
                    policy="kv",
                    block_size=16,
                    prompt_block_hashes=hash_blocks(list(range(prompt)), 16),
                ),
                service="coordinator",
            ).model_copy(update={"ts": t + 0.01}),
            Event.of(
                rid,
                PrefillCompleted(
                    prefill_worker_id=replica,
                    transfer_id="x",
                    first_token_id=1,
                    num_cached_tokens=actual,
                    # one request's hit came partly from its worker's offload tier; the others record no
                    # split (as events before tiers existed): all pool
                    cached_tokens_by_tier=TIER_SPLIT.get(i, {}),
                    num_computed_tokens=prompt - actual,
                    kv_bytes=1,
                    prefill_s=0.001 * (prompt - actual),
                ),
                service="prefill",
                worker_id=replica,
            ).model_copy(update={"ts": t + 0.2}),
        ]
    unfinished = new_id()
    out.append(
        Event.of(
            unfinished,
            RequestRouted(
                mode="disaggregated",
                prefill_worker_id="prefill-1",
                decode_worker_id="decode-0",
                candidates=[],
                predicted_cached_tokens=0,
                best_cached_tokens=0,
                route_s=0.001,
            ),
            service="coordinator",
        ).model_copy(update={"ts": T0 + 10})
    )
    return out


@pytest.fixture(scope="module")
async def logged(database_url: str) -> str:
    db = make_db(database_url)
    base = 10**12 + random.randrange(10**9)
    async with db.begin() as conn:
        await conn.execute(events.insert(), [event_row(e, base + i) for i, e in enumerate(synthetic_log())])
    await db.dispose()
    return database_url


WINDOW = (datetime.fromtimestamp(T0 - 1, UTC), datetime.fromtimestamp(T0 + 60, UTC))


async def test_report_gives_hit_rate_per_replica_against_the_ceiling(logged):
    report = await load_report(logged, *WINDOW)
    assert (report.requests, report.unfinished) == (5, 1)
    assert report.prompt_tokens == 600 and report.cached_tokens == 192 and report.ceiling_tokens == 272
    assert report.gap_tokens == 64 + 16
    assert report.prediction_exact == pytest.approx(4 / 5)
    assert report.prediction_mae_tokens == pytest.approx(16 / 5)
    rows = {r.replica: r for r in report.replicas}
    assert (rows["prefill-0"].requests, rows["prefill-0"].cached_tokens, rows["prefill-0"].prompt_tokens) == (
        3,
        112,
        380,
    )
    assert rows["prefill-1"].hit_rate == 0 and rows["prefill-1"].ceiling_hit_rate == pytest.approx(0.64)
    assert report.max_min_requests == 3.0
    assert rows["prefill-0"].mean_active_requests == pytest.approx(4 / 5)
    assert report.policies == {"kv": 5} and report.modes == {"disaggregated": 5}


async def test_report_splits_the_hit_rate_by_tier(logged):
    report = await load_report(logged, *WINDOW)
    assert report.cached_tokens_by_tier == {"offload": 32, "pool": 160}
    assert report.hit_rate_by_tier == pytest.approx({"offload": 32 / 600, "pool": 160 / 600})
    assert sum(report.hit_rate_by_tier.values()) == pytest.approx(report.hit_rate)
    rows = {r.replica: r for r in report.replicas}
    assert rows["prefill-2"].cached_tokens_by_tier == {"offload": 32, "pool": 48}
    assert rows["prefill-1"].cached_tokens_by_tier == {}


async def test_report_window_excludes_requests_routed_outside_it(logged):
    since = datetime.fromtimestamp(T0 + 2.5, UTC)
    report = await load_report(logged, since, WINDOW[1])
    assert report.requests == 2 and report.prompt_tokens == 200


def test_report_command_prints_json(logged, capsys):
    assert (
        cli.main(
            [
                "report",
                "routing",
                "--database-url",
                logged,
                "--json",
                "--since",
                WINDOW[0].isoformat(),
                "--until",
                WINDOW[1].isoformat(),
            ]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert out["requests"] == 5 and out["of_ceiling"] == pytest.approx(192 / 272)
    assert out["hit_rate_by_tier"] == pytest.approx({"offload": 32 / 600, "pool": 160 / 600})


async def test_replay_re_decides_the_logged_requests_with_each_policy(logged):
    db = make_db(logged)
    try:
        reqs = await routed_requests(db, *WINDOW)
    finally:
        await db.dispose()
    config = logged_config(reqs, None, capacity_blocks=64)
    assert config.num_prefill_workers == 3 and config.block_size == 16
    from pdserve.config import RouterSettings

    results = replay_routing(
        reqs,
        [
            ("kv", RouterSettings(policy="kv")),
            ("kv cache only", RouterSettings(policy="kv", balance_weight=0.0)),
            ("round_robin", RouterSettings(policy="round_robin")),
        ],
        config,
    )
    kv, kv_cache_only, rr = (r.summary for r in results)
    # Every prompt starts with the same tokens: without the balance term the kv router keeps them all on
    # one warm worker; with it, it trades some of the hit for spreading five requests over three workers.
    assert kv["requests"] == kv_cache_only["requests"] == rr["requests"] == 5
    assert kv_cache_only["of_ceiling"] == pytest.approx(1.0)
    assert kv_cache_only["max_min_requests"] == float("inf")  # one worker took all five
    assert kv["hit_rate"] > rr["hit_rate"] and kv["of_ceiling"] > rr["of_ceiling"]


def test_replay_routing_command_runs_and_rejects_unknown_policies(logged, capsys):
    assert (
        cli.main(
            [
                "replay",
                "--routing",
                "--policy",
                "kv,random",
                "--weights",
                "overlap=2",
                "--database-url",
                logged,
                "--since",
                WINDOW[0].isoformat(),
            ]
        )
        == 0
    )
    assert "kv" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli.main(["replay", "--routing", "--policy", "fastest", "--database-url", logged])
    with pytest.raises(argparse.ArgumentTypeError):
        from pdserve.cli.routing_replay import parse_weights

        parse_weights("speed=3")
