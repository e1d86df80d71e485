"""A hybrid's prefix hit is a pair (KV hit L, state checkpoint C <= L) to the router too: its workers'
KV events carry their checkpoints, the KV index keeps them, and the router predicts and costs the usable
hit C (the prefill computes prompt − C), recorded beside L in `RequestRouted`, the projection and
`pdserve report routing`."""

from __future__ import annotations

import time

from pdserve.config import RouterSettings
from pdserve.engine.block_hash import hash_blocks
from pdserve.events import Event, PrefillCompleted, RequestReceived, RequestRouted
from pdserve.messages import (
    AllBlocksCleared,
    BlockStored,
    CheckpointRemoved,
    CheckpointStored,
    KVEvents,
    Role,
    RouteRequest,
)
from pdserve.routing.kv_index import KVIndex
from pdserve.routing.report import fold_routed, summarize
from pdserve.routing.router import Placer
from pdserve.routing.simulate import sim_descriptor
from pdserve.store.projection import apply
from tests.unit.test_routing_policy import hb

BS = 16
HYBRID = sim_descriptor(BS).model_copy(
    update={"family": "kimi_linear", "state_layout": ("recurrent[2,2,16,16]:float32", "conv[2,3,96]:float32")}
)
PROMPT = list(range(2000, 2000 + 10 * BS))  # 10 blocks
HASHES = hash_blocks(PROMPT, BS)


def batch(worker: str, seq: int, *events) -> KVEvents:
    return KVEvents(worker_id=worker, seq=seq, events=events, ts=time.time())


def checkpoint_at(num_tokens: int) -> CheckpointStored:
    return CheckpointStored(block_hash=HASHES[num_tokens // BS - 1], num_tokens=num_tokens)


def test_the_index_finds_the_longest_checkpoint_within_the_kv_hit():
    idx = KVIndex()
    idx.apply(
        batch(
            "a",
            0,
            AllBlocksCleared(),
            BlockStored(block_hashes=tuple(HASHES[:6])),
            checkpoint_at(32),
            checkpoint_at(64),
            checkpoint_at(128),
        )
    )
    assert idx.checkpoint_blocks(HASHES, "a", 6) == 4  # 128 lies past the KV hit of 6 blocks
    assert idx.checkpoint_blocks(HASHES, "a", 10) == 8
    assert idx.checkpoint_blocks(HASHES, "a", 3) == 2
    idx.apply(batch("a", 1, CheckpointRemoved(block_hashes=(HASHES[3],))))
    assert idx.checkpoint_blocks(HASHES, "a", 6) == 2
    assert idx.checkpoint_blocks(HASHES, "nobody", 6) == 0
    idx.apply(batch("a", 0, AllBlocksCleared()))  # restarted: its checkpoints are gone with its blocks
    assert idx.num_checkpoints("a") == 0 and idx.checkpoint_blocks(HASHES, "a", 6) == 0


def test_a_lost_batch_drops_the_workers_checkpoints_too():
    idx = KVIndex()
    idx.apply(
        batch("a", 0, AllBlocksCleared(), BlockStored(block_hashes=tuple(HASHES[:6])), checkpoint_at(64))
    )
    idx.apply(batch("a", 2, BlockStored(block_hashes=(HASHES[6],))))  # seq 1 lost
    assert idx.num_checkpoints("a") == 0


def hybrid_placer() -> Placer:
    p = Placer(RouterSettings(policy="kv", seed=0, local_prefill_max_tokens=0))
    for h in (
        hb("p0", Role.PREFILL, descriptor=HYBRID),
        hb("p1", Role.PREFILL, descriptor=HYBRID),
        hb("d0", Role.DECODE, descriptor=HYBRID),
    ):
        p.observe_heartbeat(h)
    return p


def test_the_router_predicts_the_pair_and_costs_the_usable_hit():
    """p0 holds 8 blocks of KV but its latest checkpoint is at 2 blocks; p1 holds 6 with a checkpoint at
    6. A Llama router would pick p0 (more cached KV); for a hybrid p1 computes 160 − 96 = 64 tokens and
    p0 160 − 32 = 128, so p1 wins, and the decision records L = 96, C = 96."""
    p = hybrid_placer()
    p.observe_kv_events(
        batch("p0", 0, AllBlocksCleared(), BlockStored(block_hashes=tuple(HASHES[:8])), checkpoint_at(32))
    )
    p.observe_kv_events(
        batch("p1", 0, AllBlocksCleared(), BlockStored(block_hashes=tuple(HASHES[:6])), checkpoint_at(96))
    )
    d = p.route(RouteRequest(request_id="r1", num_prompt_tokens=len(PROMPT), prompt_token_ids=tuple(PROMPT)))
    assert d.prefill_worker_id == "p1"
    assert (d.predicted_cached_tokens, d.predicted_checkpoint_tokens) == (96, 96)
    terms = {c.worker_id: c for c in d.candidates if c.role is Role.PREFILL}
    assert (terms["p0"].cached_blocks, terms["p0"].checkpoint_blocks, terms["p0"].uncached_blocks) == (
        8,
        2,
        8,
    )
    assert (terms["p1"].cached_blocks, terms["p1"].checkpoint_blocks, terms["p1"].uncached_blocks) == (
        6,
        6,
        4,
    )
    assert d.best_cached_tokens == 128  # the KV ceiling stays the KV hit


def test_a_kv_hit_past_the_latest_checkpoint_is_predicted_as_l_and_c():
    p = hybrid_placer()
    p.observe_kv_events(
        batch("p0", 0, AllBlocksCleared(), BlockStored(block_hashes=tuple(HASHES[:6])), checkpoint_at(64))
    )
    p.observe_kv_events(batch("p1", 0, AllBlocksCleared()))
    d = p.route(RouteRequest(request_id="r1", num_prompt_tokens=len(PROMPT), prompt_token_ids=tuple(PROMPT)))
    assert (d.prefill_worker_id, d.predicted_cached_tokens, d.predicted_checkpoint_tokens) == ("p0", 96, 64)


def lifecycle(rid: str, cached: int, checkpoint: int, predicted: tuple[int, int]) -> list[Event]:
    routed = RequestRouted(
        mode="disaggregated",
        prefill_worker_id="p0",
        decode_worker_id="d0",
        candidates=(),
        predicted_cached_tokens=predicted[0],
        predicted_checkpoint_tokens=predicted[1],
        block_size=BS,
        route_s=0.001,
    )
    prefilled = PrefillCompleted(
        prefill_worker_id="p0",
        transfer_id="t",
        first_token_id=1,
        num_cached_tokens=cached,
        num_computed_tokens=len(PROMPT) - checkpoint,
        num_checkpoint_tokens=checkpoint,
        kv_bytes=10,
        state_bytes=4096,
        prefill_s=0.1,
    )
    received = RequestReceived(
        model="m", endpoint="/v1/completions", num_prompt_tokens=len(PROMPT), max_tokens=4, stream=False
    )
    return [
        Event.of(rid, received, service="gateway"),
        Event.of(rid, routed, service="coordinator"),
        Event.of(rid, prefilled, service="prefill", worker_id="p0"),
    ]


def test_the_projection_and_the_routing_report_carry_both_lengths():
    rid = "01000000-0000-7000-8000-000000000001"
    events = lifecycle(rid, 96, 64, (96, 64))
    row = None
    for seq, e in enumerate(events, 1):
        row = apply(row, e, seq)
    assert (row["cached_tokens"], row["checkpoint_tokens"], row["computed_tokens"]) == (96, 64, 96)
    assert (row["predicted_cached_tokens"], row["predicted_checkpoint_tokens"]) == (96, 64)
    assert row["state_bytes"] == 4096
    other = "01000000-0000-7000-8000-000000000002"
    report = summarize(fold_routed(events + lifecycle(other, 96, 0, (96, 64))))
    assert (report.hybrid_requests, report.hybrid_cached_tokens, report.checkpoint_tokens) == (2, 192, 64)
    assert report.checkpoint_prediction_exact == 0.5 and report.replicas[0].checkpoint_tokens == 64


def test_a_model_without_state_reads_as_no_hybrid_in_the_report():
    rid = "01000000-0000-7000-8000-000000000003"
    events = lifecycle(rid, 96, 0, (96, 0))
    events[-1] = Event.of(
        rid,
        PrefillCompleted(
            prefill_worker_id="p0",
            transfer_id="t",
            first_token_id=1,
            num_cached_tokens=96,
            num_computed_tokens=len(PROMPT) - 96,
            kv_bytes=10,
            prefill_s=0.1,
        ),
        service="prefill",
        worker_id="p0",
    )
    report = summarize(fold_routed(events))
    assert report.hybrid_requests == 0 and report.cached_tokens == 96


def test_pdserve_report_routing_prints_both_lengths(monkeypatch):
    from rich.console import Console

    from pdserve.cli import report as cli_report

    rid = "01000000-0000-7000-8000-000000000004"
    console = Console(record=True, width=200)
    monkeypatch.setattr(cli_report, "console", console)
    cli_report.print_report(summarize(fold_routed(lifecycle(rid, 96, 64, (96, 64)))))
    text = console.export_text()
    assert "┃ cached ┃ checkpoint ┃" in text  # the replicas table: a C column beside L
    assert "L 96 tokens, C 64 tokens" in text and "32 cached KV tokens were recomputed" in text
