"""The shared KV store tier against a real Mooncake Store (`mooncake_master` + its memory-holding client):
blocks written by one worker's client are read by another's, bit for bit; a corrupt copy is refused and
dropped; a dead master costs a bounded wait and no exception (docs/architecture.md §16)."""

from __future__ import annotations

import os
import signal
import time
import uuid

import pytest
import torch

from pdserve.kv_store import MooncakeClient, MooncakeStoreTier, StoreTimeouts, store_key
from pdserve.kv_store.tier import HEADER
from pdserve.telemetry import metrics
from tests.conftest import mooncake_importable

pytestmark = pytest.mark.skipif(bool(mooncake_importable()), reason=mooncake_importable() or "ok")

# A tiny model's block: 2 paged layers x 16 tokens x (K/V, 2 heads, 8 dims), fp32 = 4 KiB.
SHAPE = (2, 16, 2, 2, 8)


def make_tier(url: str, namespace: str, worker_id: str, timeouts: StoreTimeouts | None = None):
    client = MooncakeClient(url, timeouts or StoreTimeouts())
    tier = MooncakeStoreTier(client, namespace, SHAPE, torch.float32, worker_id=worker_id)
    client.connect()  # a False is no error: the first call retries
    return tier


@pytest.fixture
def namespace() -> str:
    return uuid.uuid4().hex[:16]  # each test its own keys in the session's store


@pytest.fixture
def writer(mooncake_url, namespace):
    tier = make_tier(mooncake_url, namespace, "writer")
    yield tier
    tier.close()


@pytest.fixture
def reader(mooncake_url, namespace):
    tier = make_tier(mooncake_url, namespace, "reader")
    yield tier
    tier.close()


def failures(worker_id: str, op: str, reason: str) -> float:
    return metrics.KV_STORE_FAILURES.labels(worker_id=worker_id, op=op, reason=reason)._value.get()


def test_block_put_by_one_worker_is_read_bit_for_bit_by_another(writer, reader) -> None:
    blocks = {h: torch.randn(SHAPE) for h in (11, 12, 13)}
    for h, b in blocks.items():
        writer.put(h, b)
    for h, b in blocks.items():
        out = torch.empty(SHAPE)
        assert reader.get_into(h, out)
        assert torch.equal(out, b)
    got = metrics.KV_STORE_BYTES.labels(worker_id="reader", op="get")._value.get()
    assert got == 3 * (HEADER.size + b.numel() * 4)


def test_lookup_counts_the_leading_blocks_held(writer, reader) -> None:
    for h in (1, 2, 4):
        writer.put(h, torch.zeros(SHAPE))
    assert reader.lookup([1, 2, 3, 4]) == 2
    assert reader.lookup([3, 4]) == 0
    assert reader.lookup([]) == 0


def test_another_compatibility_descriptor_sees_none_of_the_blocks(mooncake_url, writer) -> None:
    writer.put(21, torch.ones(SHAPE))
    other = make_tier(mooncake_url, uuid.uuid4().hex[:16], "other")
    try:
        assert other.lookup([21]) == 0
        assert not other.get_into(21, torch.empty(SHAPE))
    finally:
        other.close()


def test_a_miss_is_false_and_no_failure(reader) -> None:
    assert not reader.get_into(999, torch.empty(SHAPE))
    assert failures("reader", "get", "checksum") == 0


def test_corrupted_block_in_the_store_is_refused_and_dropped(writer, reader, namespace) -> None:
    good = torch.randn(SHAPE)
    writer.put(31, good)
    # Flip one payload byte in the stored value, under the original checksum, with the raw client.
    raw = writer._lanes["kv"].put_buf
    raw[HEADER.size + 100] ^= 0xFF
    assert writer.client.put_from(store_key(namespace, 32), raw.data_ptr(), raw.numel()) == 0
    before = failures("reader", "get", "checksum")
    out = torch.empty(SHAPE)
    assert not reader.get_into(32, out)
    assert failures("reader", "get", "checksum") == before + 1
    deadline = time.monotonic() + 5
    while reader.lookup([32]) and time.monotonic() < deadline:  # removed in the background
        time.sleep(0.05)
    assert reader.lookup([32]) == 0
    assert reader.get_into(31, out) and torch.equal(out, good)  # the good copy is untouched


def test_killed_master_costs_bounded_calls_and_no_exception(tmp_path) -> None:
    from pdserve.embedded import start_mooncake

    server = start_mooncake(tmp_path, segment_bytes=32 << 20)
    timeouts = StoreTimeouts(lookup_s=0.2, get_s=0.3, put_s=0.3, retry_after_s=1.0)
    tier = make_tier(server.url, "killed", "killed", timeouts)
    try:
        tier.put(1, torch.ones(SHAPE))
        assert tier.lookup([1]) == 1
        os.kill(server.pid, signal.SIGKILL)
        time.sleep(0.2)
        started = time.monotonic()
        for _ in range(20):  # a request's worth of calls: each bounded, then fail-fast while down
            assert tier.lookup([1]) in (0, 1)
            tier.get_into(1, torch.empty(SHAPE))
            tier.put(2, torch.ones(SHAPE))
        elapsed = time.monotonic() - started
        assert elapsed < 3 * (timeouts.lookup_s + timeouts.get_s + timeouts.put_s), elapsed
        assert sum(failures("killed", op, r) for op in ("lookup", "get", "put")
                   for r in ("timeout", "error", "down", "busy")) > 0
    finally:
        tier.close()
        server.stop()


def test_a_store_that_never_answers_costs_one_bounded_wait_then_fails_fast() -> None:
    from pdserve.embedded import free_port

    timeouts = StoreTimeouts(setup_s=1.0, lookup_s=0.2, get_s=0.2, put_s=0.2, retry_after_s=5.0)
    client = MooncakeClient(f"mooncake://127.0.0.1:{free_port()}", timeouts)  # nothing listens there
    tier = MooncakeStoreTier(client, "absent", SHAPE, torch.float32, worker_id="absent")
    try:
        started = time.monotonic()
        assert not client.connect()
        assert time.monotonic() - started < 3 * timeouts.setup_s
        started = time.monotonic()
        for _ in range(50):  # down for retry_after_s: every call answers at once
            assert tier.lookup([1, 2]) == 0
            assert not tier.get_into(1, torch.empty(SHAPE))
            tier.put(1, torch.ones(SHAPE))
        assert time.monotonic() - started < 1.0
        assert failures("absent", "lookup", "down") + failures("absent", "lookup", "busy") == 50
    finally:
        tier.close()
