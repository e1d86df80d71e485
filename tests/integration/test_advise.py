"""`pdserve advise` on a scripted event log in Postgres: four workloads, each in its own time window, give
their stage and the exact numbers behind it (RAG on a colocated pool → 3, chat → 1 "not yet", admission
pressure → 2, shared-prefix traffic round-robined over 4 prefill replicas → 4)."""

from __future__ import annotations

import dataclasses
import json
import random
import time
from datetime import UTC, datetime
from pathlib import Path

import pytest

from pdserve.advise.decide import advise
from pdserve.advise.evidence import load_events, measure, measured
from pdserve.advise.whatif import GAIN
from pdserve.cli import main as cli
from pdserve.cli.advise import model_spec
from pdserve.engine.block_hash import hash_blocks
from pdserve.events import (
    AdmissionDeferred,
    Event,
    PrefillCompleted,
    RequestCompleted,
    RequestReceived,
    RequestRouted,
    TokensCommitted,
    TransferCompleted,
    TTFTBreakdown,
)
from pdserve.hardware.links import link
from pdserve.ids import new_id
from pdserve.store.queries import make_db
from pdserve.store.rows import event_row
from pdserve.store.tables import events

T0 = time.time() + 40 * 86400  # windows no other test writes into
RAG, CHAT, CAPACITY, AGENTIC = (T0 + 100 * k for k in range(4))
ROOT = Path(__file__).resolve().parents[2]
SHM = link("UCX shared memory (this machine)")
PREFIX = list(range(1000, 1448))  # 448 tokens = 28 blocks of 16, shared by every agentic request


def _ev(rid, payload, t, service="coordinator", worker=None):
    return Event.of(rid, payload, service=service, worker_id=worker).model_copy(update={"ts": t})


def _request(
    t,
    prompt,
    completion,
    mode,
    prefill_worker,
    decode_worker,
    prefill_s,
    stall_window=None,
    deferred=False,
    prefill=None,
    transfer=None,
    hashes=(),
    queue_s=0.0,
):
    """One request's events: received, (deferred), routed, (prefill, transfer), commits of 16 tokens
    20 ms apart per token (window `stall_window` at 100 ms per token), completed (TTFT: `queue_s` +
    `prefill_s` + 2 ms of route and reserve; e2e 2 s, or TTFT + 1.5 s when that is later)."""
    rid = new_id()
    out = [
        _ev(
            rid,
            RequestReceived(
                model="m",
                endpoint="/v1/completions",
                num_prompt_tokens=prompt,
                max_tokens=completion,
                stream=True,
            ),
            t,
            "gateway",
        )
    ]
    if deferred:
        out.append(_ev(rid, AdmissionDeferred(decode_worker_id=decode_worker, reason="full"), t + 0.001))
    out.append(
        _ev(
            rid,
            RequestRouted(
                mode=mode,
                prefill_worker_id=prefill_worker,
                decode_worker_id=decode_worker,
                candidates=[],
                route_s=0.001,
                policy=(prefill or {}).get("policy", "kv"),
                block_size=16 if hashes else 0,
                prompt_block_hashes=hashes,
                best_cached_tokens=(prefill or {}).get("best", 0),
            ),
            t + 0.002,
        )
    )
    if prefill is not None:
        out.append(
            _ev(
                rid,
                PrefillCompleted(
                    prefill_worker_id=prefill_worker,
                    transfer_id="x",
                    first_token_id=1,
                    num_cached_tokens=prefill["cached"],
                    num_computed_tokens=prompt - prefill["cached"],
                    kv_bytes=prompt * 512,
                    prefill_s=prefill_s,
                    **({"cached_tokens_by_tier": prefill["tiers"]} if "tiers" in prefill else {}),
                ),
                t + 0.1,
                "prefill",
                prefill_worker,
            )
        )
    if transfer is not None:
        out.append(
            _ev(
                rid,
                TransferCompleted(
                    transfer_id="x",
                    transport="ucxx",
                    kv_bytes=transfer[0],
                    num_layers=2,
                    transfer_s=transfer[1],
                    checksum_ok=True,
                ),
                t + 0.1,
                "decode",
                decode_worker,
            )
        )
    ts, left, k = t + 1.0, completion, 0
    while left > 0:
        n = min(16, left)
        if k:
            ts += n * (0.1 if k == stall_window else 0.02)
        out.append(
            _ev(
                rid,
                TokensCommitted(start_index=completion - left, token_ids=[7] * n),
                ts,
                "decode",
                decode_worker,
            )
        )
        left, k = left - n, k + 1
    ttft = TTFTBreakdown(
        queue_s=queue_s,
        route_s=0.001,
        reserve_s=0.001,
        prefill_s=prefill_s,
        exposed_transfer_s=0.0,
        first_token_s=0.0,
        ttft_s=queue_s + prefill_s + 0.002,
    )
    out.append(
        _ev(
            rid,
            RequestCompleted(
                finish_reason="length",
                prompt_tokens=prompt,
                completion_tokens=completion,
                ttft=ttft,
                e2e_s=max(2.0, ttft.ttft_s + 1.5),
            ),
            ts + 0.01,
        )
    )
    return out


def scripted_log() -> list[Event]:
    log = []
    for i in range(5):  # RAG, 10:1 on two colocated unified workers; one window of request 0 stalls, and
        # the last three queued 2 s behind the prefills before them: their TTFT misses the 2 s SLO
        log += _request(
            RAG + i,
            1000,
            100,
            "colocated",
            f"unified-{i % 2}",
            f"unified-{i % 2}",
            0.5,
            stall_window=3 if i == 0 else None,
            queue_s=2.0 if i >= 2 else 0.0,
        )
    for i in range(4):  # chat, 1:20 on one unified worker, steady ITL
        log += _request(CHAT + i, 50, 1000, "colocated", "unified-0", "unified-0", 0.05)
    for i in range(4):  # admission pressure: half the requests waited for KV
        log += _request(
            CAPACITY + i, 200, 20, "colocated", "unified-0", "unified-0", 0.1, deferred=i % 2 == 0
        )
    for i in range(8):  # agentic: a 448-token shared prefix, round robin over 4 prefill replicas
        hashes = hash_blocks(PREFIX + [5000 + 64 * i + j for j in range(64)], 16)
        cached = 448 if i >= 4 else 0
        pre = {"cached": cached, "best": 448 if i else 0, "policy": "round_robin"}
        if i == 7:
            pre["tiers"] = {"pool": 320, "offload": 128}
        log += _request(
            AGENTIC + i,
            512,
            4,
            "disaggregated",
            f"prefill-{i % 4}",
            "decode-0",
            0.05,
            prefill=pre,
            transfer=(512 * 512, 0.002),
            hashes=hashes,
        )
    return log


@pytest.fixture(scope="module")
def own_database_url(isolated_settings) -> str:
    """A database of this module's own: advise reads every request of its windows."""
    return isolated_settings("advise").database_url


@pytest.fixture(scope="module")
async def logged(own_database_url: str) -> str:
    db = make_db(own_database_url)
    base = 2 * 10**12 + random.randrange(10**9)
    async with db.begin() as conn:
        await conn.execute(events.insert(), [event_row(e, base + i) for i, e in enumerate(scripted_log())])
    await db.dispose()
    return own_database_url


async def _evidence(url: str, t0: float, slo_ms=None):
    """The measurements of the scripted section that starts at `t0`."""
    db = make_db(url)
    try:
        evts = await load_events(
            db, datetime.fromtimestamp(t0 - 1, UTC), datetime.fromtimestamp(t0 + 50, UTC)
        )
    finally:
        await db.dispose()
    return measure(evts, slo_ms=slo_ms)


def _decide(ev, model: str):
    return advise(ev, model_spec(model, None, None), SHM, 2, 12e9, "test: 12 GB")


async def _advice(url: str, t0: float, model: str, slo_ms=None):
    return _decide(await _evidence(url, t0, slo_ms), model)


async def test_rag_on_a_colocated_pool_with_interference_is_stage_3(logged):
    a = await _advice(logged, RAG, "smollm2")
    m = {k: v.value for k, v in a.measurements.items()}
    assert (a.stage, a.requests, a.completed, a.modes) == (3, 5, 5, {"colocated": 5})
    assert [v.status for v in a.stages] == [
        "baseline",
        "not yet",
        "warranted",
        "unknown",
    ]  # 2 replicas, no hits logged
    # ITL from the commit windows: 29 at 20 ms, one at 100 ms; p99 interpolated between them
    assert m["itl_p50_ms"] == pytest.approx(20.0, rel=1e-4)
    assert m["itl_p99_ms"] == pytest.approx(20 + 80 * 0.71, rel=1e-4)
    assert m["itl_p99_over_p50"] == pytest.approx(3.84, rel=1e-4)
    assert m["prompt_to_output_ratio"] == 10.0
    assert m["kv_bytes_p95_estimated"] == 1000 * 46080  # SmolLM2 fp32: 30 layers × 2 × 3 heads × 64 × 4 B
    assert m["transfer_s_p95_on_link"] == pytest.approx(46.08e6 / 4.15e9 + 1e-6)
    assert m["prefill_s_p95"] == 0.5
    assert m["slo_attainment"] == 2 / 5  # three TTFTs of 2.502 s over the default 2 s SLO
    assert m["weight_duplication_share"] == pytest.approx(538_060_032 / 24e9)
    assert (
        a.measurements["preemptions"].value is None and "not an event" in a.measurements["preemptions"].note
    )
    assert a.measurements["hit_rate"].value is None  # a colocated prefill reports no cached tokens
    answers = {c.question.split("?")[0]: c.answer for c in a.checks if c.stage == 3}
    assert list(answers.values()) == ["yes", "yes", "yes", "yes", "unknown", "yes", "yes", "unknown"]


async def test_rag_whose_interference_costs_no_slo_is_not_yet(logged):
    """The same RAG log at a 3 s TTFT SLO: every request meets it, so the p99 ITL stall costs no goodput
    and the checklist stops at the SLO question."""
    a = await _advice(logged, RAG, "smollm2", slo_ms={"ttft": 3000.0, "tpot": 200.0})
    assert a.measurements["slo_attainment"].value == 1.0
    assert a.measurements["itl_p99_over_p50"].value == pytest.approx(3.84, rel=1e-4)
    assert (a.stage, a.stages[2].status) == (1, "not yet")
    assert a.stages[2].because == "no: Does the baseline miss its SLO? (attainment < 90%)"


def _with_split_gain(ev, gain: float):
    """`ev` with the split what-if's measurements as `whatif.simulate_split` reports them."""
    src = "pdserve sim on this log's 5 completed requests (test)"
    m = {
        "split_goodput_colocated": measured("split_goodput_colocated", 0.5, "req/s", src, 5, "2 unified"),
        "split_goodput_best": measured(
            "split_goodput_best", 0.5 * gain, "req/s", src, 5, "1 prefill + 1 decode"
        ),
        GAIN: measured(GAIN, gain, "×", src, 5, "best split 1P+1D ÷ colocated"),
    }
    return dataclasses.replace(ev, m={**ev.m, **m})


@pytest.mark.parametrize(("gain", "stage", "status"), [(0.4, 1, "not yet"), (1.1, 3, "warranted")])
async def test_a_simulated_split_decides_stage_3_with_the_checklist(logged, gain, stage, status):
    """The RAG log's checklist holds; the split simulated on its requests must also win ≥ 1.1× goodput."""
    a = _decide(_with_split_gain(await _evidence(logged, RAG), gain), "smollm2")
    split = next(c for c in a.checks if c.question.startswith("Would a split of this fleet"))
    assert split.answer == ("yes" if gain >= 1.1 else "no")
    assert split.because == (
        f"{0.5 * gain:.3f} req/s simulated for 1 prefill + 1 decode against 0.500 for 2 unified ({gain:.2f}×)"
    )
    assert (a.stage, a.stages[2].status) == (stage, status)


async def test_without_a_profile_the_split_is_unknown_and_stage_3_rests_on_the_checklist(logged):
    a = await _advice(logged, RAG, "smollm2")
    split = next(c for c in a.checks if c.question.startswith("Would a split of this fleet"))
    assert split.answer == "unknown" and "--profile" in split.because
    assert a.stages[2].status == "warranted"


def test_cli_says_when_the_profile_cannot_be_read(logged, capsys, tmp_path):
    missing_profile = tmp_path / "none.json"
    assert cli.main(["advise", "--database-url", logged, "--profile", str(missing_profile)]) == 2
    assert f"cannot read the profile {missing_profile}" in capsys.readouterr().out


async def test_chat_without_interference_is_not_yet(logged):
    a = await _advice(logged, CHAT, "smollm2")
    assert a.stage == 1 and a.verdict.startswith("not yet: stay at stage 1")
    assert a.measurements["itl_p99_over_p50"].value == pytest.approx(1.0, rel=1e-4)
    assert a.measurements["prompt_to_output_ratio"].value == 0.05
    assert [v.status for v in a.stages] == ["baseline", "not yet", "not yet", "not yet"]
    assert "Prefill/decode interference" in a.stages[2].because


async def test_admission_pressure_is_stage_2(logged):
    a = await _advice(logged, CAPACITY, "smollm2")
    assert a.stage == 2 and a.measurements["admission_deferred_share"].value == 0.5
    assert a.stages[1].status == "warranted" and a.stages[1].because.startswith("capacity-bound")


async def test_shared_prefix_round_robin_over_four_replicas_is_stage_4(logged):
    a = await _advice(logged, AGENTIC, "tiny")
    m = {k: v.value for k, v in a.measurements.items()}
    assert a.stage == 4 and [v.status for v in a.stages] == ["baseline", "in place", "in place", "warranted"]
    assert (m["hit_rate"], m["router_ceiling_hit_rate"]) == (1792 / 4096, 3136 / 4096)
    assert m["routing_gap_share"] == 1344 / 4096
    assert (m["reuse_ceiling_hit_rate"], m["eviction_gap_share"]) == (3136 / 4096, 0.0)
    assert m["tier_hit_rate[offload]"] == 128 / 4096
    assert m["transfer_GB_s_max"] == pytest.approx(512 * 512 / 0.002 / 1e9)
    assert "nearest in the link table: Ethernet 25G (TCP)" in a.measurements["interconnect_class"].note
    assert m["transfer_s_p95_on_link"] == pytest.approx(512 * 512 / 4.15e9 + 1e-6)
    assert [(r.replica, r.hit_rate) for r in a.replicas] == [
        ("prefill-0", 448 / 1024),
        ("prefill-1", 448 / 1024),
        ("prefill-2", 448 / 1024),
        ("prefill-3", 448 / 1024),
    ]
    assert a.measurements["itl_p99_over_p50"].value is None  # one commit per request: the log shows no ITL


def test_cli_prints_the_advice_as_json(logged, capsys, tmp_path):
    since = datetime.fromtimestamp(RAG - 1, UTC).isoformat()
    until = datetime.fromtimestamp(RAG + 50, UTC).isoformat()
    assert (
        cli.main(
            [
                "advise",
                "--database-url",
                logged,
                "--since",
                since,
                "--until",
                until,
                "--model",
                "smollm2",
                "--fleet",
                "2",
                "--accelerator-memory-gb",
                "12",
                "--json",
                "--plot",
                str(tmp_path / "a.png"),
            ]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert out["stage"] == 3 and out["measurements"]["prompt_to_output_ratio"]["source"].startswith("Σ")
    assert (tmp_path / "a.png").stat().st_size > 10_000


def test_cli_simulates_the_split_with_a_profile(logged, capsys):
    """`--profile` (the SmolLM2 profile the docs' simulations use): the chat log's 4 requests replayed on
    2 unified replicas and on 1 prefill + 1 decode, the check answered from the ratio."""
    profile = ROOT / "docs" / "benchmarks" / "sim-profile.json"
    since = datetime.fromtimestamp(CHAT - 1, UTC).isoformat()
    until = datetime.fromtimestamp(CHAT + 50, UTC).isoformat()
    args = ["advise", "--database-url", logged, "--since", since, "--until", until, "--model", "smollm2"]
    assert cli.main([*args, "--profile", str(profile), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    m = out["measurements"]
    assert m[GAIN]["samples"] == 4 and m[GAIN]["note"].startswith(
        "best split ÷ colocated; every split: 1P+1D"
    )
    assert m["split_goodput_best"]["note"] == "1 prefill + 1 decode over UCX shared memory (this machine)"
    assert m["split_goodput_colocated"]["value"] > 0
    assert "2 ms before the engine" in m["split_goodput_colocated"]["note"]  # route + reserve, not the queue
    assert m[GAIN]["value"] == pytest.approx(
        m["split_goodput_best"]["value"] / m["split_goodput_colocated"]["value"]
    )
    split = next(c for c in out["checks"] if c["question"].startswith("Would a split of this fleet"))
    assert split["answer"] == ("yes" if m[GAIN]["value"] >= 1.1 else "no")
    assert out["stages"][2]["status"] == ("warranted" if split["answer"] == "yes" else "not yet")


def test_replicas_without_a_shared_prefix_do_not_warrant_stage_4():
    log = []
    for i in range(4):  # round robin over 2 replicas, every prompt its own: the perfect router hits nothing
        hashes = hash_blocks([9000 + 100 * i + j for j in range(64)], 16)
        log += _request(
            T0 + i,
            64,
            4,
            "disaggregated",
            f"prefill-{i % 2}",
            "decode-0",
            0.05,
            prefill={"cached": 0, "best": 0, "policy": "round_robin"},
            transfer=(64 * 512, 0.001),
            hashes=hashes,
        )
    a = advise(measure(log), model_spec("tiny", None, None), SHM, 2, 12e9, "test: 12 GB")
    assert a.measurements["router_ceiling_hit_rate"].value == 0.0
    assert (a.stage, a.stages[3].status) == (3, "not yet")
    assert a.stages[3].because.startswith("no prefix the replicas could share")
