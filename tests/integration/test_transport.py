"""Both KV transports between two OS processes: this test process receives, a spawned process
(`transfer_peer`) sends. Covers docs/architecture.md §6's data-plane contract: KV lands byte-identical in the
receiver's own buffers, a corrupted chunk is never counted, and cancelled or unknown transfers never
write into buffers."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import random
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from multiprocessing.connection import Connection

import pytest
import torch
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from pdserve.messages import KVEndpoint
from pdserve.transfer import (
    ChecksumMismatchError,
    KVTransport,
    TransferCancelled,
    TransferError,
    TransferTimeout,
    make_transport,
)
from tests.integration.transfer_peer import SendPlan, layer_kv, run_sender

HEADS, HEAD_DIM = 2, 8  # transfer_peer.layer_kv's defaults


@dataclass
class Pair:
    """A started receiver in this process and a sender process."""

    kind: str
    receiver: KVTransport
    conn: Connection

    @property
    def endpoint(self) -> KVEndpoint:
        return self.receiver.endpoint()

    async def send(self, *plans: SendPlan) -> int:
        self.conn.send(("send", list(plans)))
        status, value = await asyncio.to_thread(self.conn.recv)
        assert status == "sent", value
        return value


@pytest.fixture(scope="module", params=["tcp", "ucxx"])
async def pair(request) -> AsyncIterator[Pair]:
    receiver = make_transport(request.param)
    await receiver.start()
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=run_sender, args=(request.param, there), daemon=True)
    proc.start()
    status, _ = await asyncio.to_thread(here.recv)
    assert status == "ready"
    yield Pair(request.param, receiver, here)
    here.send(("stop",))
    await asyncio.to_thread(proc.join, 10)
    await receiver.stop()


def buffers(num_layers: int, max_tokens: int) -> list[torch.Tensor]:
    return [torch.zeros(max_tokens, 2, HEADS, HEAD_DIM) for _ in range(num_layers)]


def new_id() -> str:
    return uuid.uuid4().hex


async def test_layers_and_chunks_from_another_process_land_byte_identical(pair: Pair) -> None:
    for from_thread in (False, True):
        tid, seed = new_id(), 7 + from_thread
        num_layers, num_chunks, chunk_tokens = 4, 3, 16
        dst = buffers(num_layers, num_chunks * chunk_tokens + 5)
        inbound = pair.receiver.expect(tid, dst)
        sent = await pair.send(SendPlan(pair.endpoint, tid, num_layers, num_chunks, chunk_tokens, seed,
                                        from_thread=from_thread))
        stats = await inbound.wait(10)
        assert (stats.kv_bytes, stats.num_layers, stats.num_chunks) == (sent, num_layers, num_chunks)
        assert sent == num_layers * num_chunks * chunk_tokens * 2 * HEADS * HEAD_DIM * 4
        assert inbound.layers_done == set(range(num_layers))
        for layer in range(num_layers):
            want = layer_kv(seed, layer, num_chunks * chunk_tokens)
            assert torch.equal(dst[layer][: num_chunks * chunk_tokens], want)
            assert not dst[layer][num_chunks * chunk_tokens :].any()  # rows nobody sent stay untouched


async def test_every_corrupted_chunk_is_detected_and_the_first_bad_layer_reported(pair: Pair) -> None:
    rng = random.Random(1234)
    num_layers, trials = 6, 60
    plans, inbounds, first_bad = [], [], []
    for trial in range(trials):
        tid = new_id()
        bad = rng.randrange(num_layers)
        # Half the trials corrupt a later layer too: the report must still name the first.
        corrupt = {(bad, 0)} | ({(rng.randrange(bad, num_layers), 0)} if trial % 2 else set())
        inbounds.append(pair.receiver.expect(tid, buffers(num_layers, 8)))
        plans.append(SendPlan(pair.endpoint, tid, num_layers, 1, 8, seed=trial, corrupt=frozenset(corrupt)))
        first_bad.append(bad)
    await pair.send(*plans)
    for inbound, bad in zip(inbounds, first_bad, strict=True):
        with pytest.raises(ChecksumMismatchError) as err:
            await inbound.wait(10)
        assert (err.value.transfer_id, err.value.layer, err.value.chunk) == (inbound.transfer_id, bad, 0)
        assert err.value.expected != err.value.actual
        assert bad not in inbound.layers_done


async def test_duplicate_transfer_id_is_rejected_even_after_it_completed(pair: Pair) -> None:
    tid = new_id()
    inbound = pair.receiver.expect(tid, buffers(2, 4))
    with pytest.raises(ValueError):
        pair.receiver.expect(tid, buffers(2, 4))
    await pair.send(SendPlan(pair.endpoint, tid, 2, 1, 4, seed=1))
    await inbound.wait(10)
    with pytest.raises(ValueError):
        pair.receiver.expect(tid, buffers(2, 4))


async def test_cancelled_transfer_late_data_never_writes_into_its_buffers(pair: Pair) -> None:
    cancelled_id, later_id = new_id(), new_id()
    dst = buffers(3, 16)
    inbound = pair.receiver.expect(cancelled_id, dst)
    inbound.cancel()
    later = pair.receiver.expect(later_id, buffers(3, 16))
    # The later transfer travels behind the cancelled one's data, so once it is verified the cancelled
    # data has been received (and discarded).
    await pair.send(SendPlan(pair.endpoint, cancelled_id, 3, 2, 8, seed=3),
                    SendPlan(pair.endpoint, later_id, 3, 2, 8, seed=4))
    await later.wait(10)
    await inbound.drained()
    assert not any(b.any() for b in dst)
    assert not inbound.chunks_done
    with pytest.raises(TransferCancelled):
        await inbound.wait(1)


async def test_wait_times_out_when_the_sender_never_finishes(pair: Pair) -> None:
    tid = new_id()
    inbound = pair.receiver.expect(tid, buffers(2, 8))
    await pair.send(SendPlan(pair.endpoint, tid, 2, 1, 8, seed=5, finish=False))
    with pytest.raises(TransferTimeout):
        await inbound.wait(0.3)
    inbound.cancel()


async def test_chunk_that_does_not_fit_the_buffers_fails_the_transfer(pair: Pair) -> None:
    tid = new_id()
    inbound = pair.receiver.expect(tid, buffers(2, 4))  # 4 rows; the sender sends 8
    await pair.send(SendPlan(pair.endpoint, tid, 2, 1, 8, seed=6))
    with pytest.raises(TransferError, match="does not fit"):
        await inbound.wait(10)


@pytest.fixture(scope="module")
def spans() -> InMemorySpanExporter:
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return exporter


async def test_each_chunk_is_verified_in_a_span_parented_on_the_senders_trace(
        pair: Pair, spans: InMemorySpanExporter) -> None:
    tid = new_id()
    trace_id, parent_span_id = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    inbound = pair.receiver.expect(tid, buffers(2, 4))
    traceparent = f"00-{trace_id}-{parent_span_id}-01"
    await pair.send(SendPlan(pair.endpoint, tid, 2, 1, 4, seed=8, traceparent=traceparent))
    await inbound.wait(10)
    verify = [s for s in spans.get_finished_spans()
              if s.name == "transfer.verify_checksum" and s.attributes["pdserve.transfer_id"] == tid]
    assert sorted(s.attributes["pdserve.layer"] for s in verify) == [0, 1]
    assert all(s.attributes["pdserve.checksum_ok"] for s in verify)
    assert {format(s.context.trace_id, "032x") for s in verify} == {trace_id}


async def test_a_chunk_of_several_pieces_lands_whole_and_a_flipped_piece_is_caught(pair: Pair) -> None:
    # 70,000 rows x 128 B = 8.5 MiB: three 4 MiB ucxx pieces, each hashed while the next one is copied.
    tokens = 70_000
    good, bad = new_id(), new_id()
    dst_good, dst_bad = buffers(1, tokens), buffers(1, tokens)
    in_good, in_bad = pair.receiver.expect(good, dst_good), pair.receiver.expect(bad, dst_bad)
    await pair.send(SendPlan(pair.endpoint, good, 1, 1, tokens, seed=3),
                    SendPlan(pair.endpoint, bad, 1, 1, tokens, seed=4, corrupt=frozenset({(0, 0)})))
    stats = await in_good.wait(30)
    assert stats.kv_bytes == tokens * 2 * HEADS * HEAD_DIM * 4
    assert torch.equal(dst_good[0], layer_kv(3, 0, tokens))
    with pytest.raises(ChecksumMismatchError):
        await in_bad.wait(30)


async def test_a_burst_of_more_layers_than_posted_control_receives_lands_and_a_bad_one_is_caught(
        pair: Pair) -> None:
    # A prefill worker fires every layer's send without waiting; ucxx keeps 64 control receives posted,
    # so 100 headers at once must also go through UCX's unexpected queue, in order, without loss.
    num_layers, chunk_tokens = 100, 8
    tid, seed = new_id(), 31
    dst = buffers(num_layers, chunk_tokens)
    inbound = pair.receiver.expect(tid, dst)
    sent = await pair.send(SendPlan(pair.endpoint, tid, num_layers, 1, chunk_tokens, seed, burst=True))
    stats = await inbound.wait(20)
    assert (stats.kv_bytes, stats.num_layers) == (sent, num_layers)
    for layer in range(num_layers):
        assert torch.equal(dst[layer], layer_kv(seed, layer, chunk_tokens))
    bad = new_id()
    inbound = pair.receiver.expect(bad, buffers(num_layers, chunk_tokens))
    await pair.send(SendPlan(pair.endpoint, bad, num_layers, 1, chunk_tokens, seed,
                             corrupt=frozenset({(57, 0)}), burst=True))
    with pytest.raises(ChecksumMismatchError) as err:
        await inbound.wait(20)
    assert (err.value.layer, err.value.chunk) == (57, 0)
