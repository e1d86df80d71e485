"""What the parts of `benchmarks/events.py` drive and observe: one request's lifecycle events, a part's own
stream, subjects, database and recorder process, publishing, Postgres's progress, a bare consumer,
serving rounds and CPU counters. Helpers only: run benchmarks/events.py.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import sqlalchemy as sa
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from pdserve.bench.cpu_time import CpuMeter
from pdserve.bus import Bus
from pdserve.config import CommonSettings
from pdserve.events import (
    DecodeReserved,
    DecodeStarted,
    Event,
    PrefillCompleted,
    PrefillStarted,
    RequestCompleted,
    RequestReceived,
    RequestRouted,
    TokensCommitted,
    TransferCompleted,
    TTFTBreakdown,
)
from pdserve.ids import new_id
from pdserve.messages import FinishReason, SamplingParams
from pdserve.store.migrate import create_database, drop_database, upgrade
from pdserve.store.pull import BatchPuller
from pdserve.store.recorder import caught_up
from tests.e2e.stack import Stack

NATS_URL = os.environ.get("PDS_TEST_NATS_URL", "nats://127.0.0.1:4222")
ADMIN_URL = os.environ.get("PDS_TEST_DATABASE_URL", "postgresql+asyncpg://postgres@127.0.0.1:5432/postgres")


def lifecycle(request_id: str) -> list[Event]:
    """The events of one 64-token request with a 32-token prompt, as the services publish them."""
    ttft = TTFTBreakdown(queue_s=0.001, route_s=0.001, reserve_s=0.001, prefill_s=0.02,
                         exposed_transfer_s=0.002,
                         first_token_s=0.003, ttft_s=0.03)
    payloads = [
        RequestReceived(model="SmolLM2-135M-Instruct", endpoint="/v1/completions", num_prompt_tokens=32,
                        max_tokens=64, stream=True, prompt_token_ids=list(range(32)),
                        sampling=SamplingParams(max_tokens=64, temperature=0.0), received_ts=time.time()),
        RequestRouted(mode="disaggregated", prefill_worker_id="prefill-0", decode_worker_id="decode-0",
                      candidates=[], predicted_cached_tokens=0, best_cached_tokens=0, route_s=0.001),
        DecodeReserved(decode_worker_id="decode-0", transfer_id=new_id(), num_tokens=96, reserve_s=0.001),
        PrefillStarted(prefill_worker_id="prefill-0", transfer_id=new_id(), num_prompt_tokens=32),
        PrefillCompleted(prefill_worker_id="prefill-0", transfer_id=new_id(), first_token_id=1,
                         num_cached_tokens=0, num_computed_tokens=32, kv_bytes=1 << 20, prefill_s=0.02),
        TransferCompleted(transfer_id=new_id(), transport="ucxx", kv_bytes=1 << 20, num_layers=30,
                          transfer_s=0.002, checksum_ok=True),
        DecodeStarted(decode_worker_id="decode-0", num_running=8),
        *(TokensCommitted(start_index=i, token_ids=list(range(i, i + 16))) for i in range(0, 64, 16)),
        RequestCompleted(finish_reason=FinishReason.LENGTH, prompt_tokens=32, completion_tokens=64, ttft=ttft,
                         e2e_s=0.5),
    ]
    return [Event.of(request_id, p, service="bench") for p in payloads]


class Part:
    """One part's own stream, subjects and database; `recorder()` starts the real recorder process."""

    def __init__(self, name: str, tmp: Path) -> None:
        tag = uuid.uuid4().hex[:8]
        self.db = f"pdserve_bench_{name}_{tag}"
        self.url = create_database(ADMIN_URL, self.db)
        upgrade(self.url)
        self.settings = CommonSettings(nats_url=NATS_URL, database_url=self.url, subject_prefix=f"b{tag}",
                                       events_stream=f"PDS_BENCH_{tag}", var_dir=tmp / name)
        self.procs: list[subprocess.Popen] = []

    def recorder(self) -> subprocess.Popen:
        env = dict(os.environ, PDS_NATS_URL=NATS_URL, PDS_DATABASE_URL=self.url,
                   PDS_SUBJECT_PREFIX=self.settings.subject_prefix,
                   PDS_EVENTS_STREAM=self.settings.events_stream,
                   PDS_VAR_DIR=str(self.settings.var_dir))
        self.settings.var_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.settings.var_dir / "recorder.log", "ab")
        proc = subprocess.Popen([sys.executable, "-m", "pdserve.services.recorder"], env=env, stdout=log,
                                stderr=subprocess.STDOUT)
        self.procs.append(proc)
        return proc

    async def close(self) -> None:
        for p in self.procs:
            p.terminate()
            p.wait(15)
        bus = await Bus.connect(self.settings, "bench-cleanup")
        try:
            await bus.js.delete_stream(self.settings.events_stream)
        finally:
            await bus.close()
        drop_database(ADMIN_URL, self.db)


async def publish(bus: Bus, events: list[Event]) -> None:
    subjects = bus.subjects
    for i in range(0, len(events), 2000):  # bounded in-flight acks
        for ev in events[i:i + 2000]:
            await bus.js.publish_async(subjects.event(ev.request_id, ev.type), ev.model_dump_json().encode(),
                                       headers={"Nats-Msg-Id": ev.event_id})
        await bus.js.publish_async_completed()


async def count_events(db) -> int:
    async with db.connect() as conn:
        return (await conn.execute(sa.text("SELECT count(*) FROM events"))).scalar_one()


async def top_seq(db) -> int:
    """The highest stream sequence in Postgres: an index lookup (a count(*) every few ms over a growing
    table would itself load Postgres). The recorder commits batches in stream order, so everything at or
    below it is recorded, give or take the batch in flight."""
    async with db.connect() as conn:
        return (await conn.execute(sa.text("SELECT coalesce(max(stream_seq), 0) FROM events"))).scalar_one()


async def wait_recorded(db, n: int, poll_s: float = 0.05) -> None:
    while await count_events(db) < n:
        await asyncio.sleep(poll_s)


def drain_cpu_s(recorder_pid: int) -> dict[str, float]:
    """CPU seconds (user + system) so far of the recorder process, of all Postgres processes and of all
    nats-server processes on this machine (those serve only this benchmark's drain while it runs, give or
    take the other sessions sharing the machine)."""
    return CpuMeter({"recorder": [(recorder_pid, False)]},
                    {"postgres": ("postgres",), "nats-server": ("nats-server",)}).read()


async def bare_drain(bus: Bus, stream: str, n: int) -> tuple[float, float]:
    """(events/s, CPU µs per event of this process) of a consumer of its own that only pulls and acks the
    stream's `n` events."""
    durable = "bench-bare"
    await bus.js.add_consumer(stream, ConsumerConfig(
        durable_name=durable, filter_subject=bus.subjects.all_events, ack_policy=AckPolicy.EXPLICIT,
        deliver_policy=DeliverPolicy.ALL, max_ack_pending=-1))
    puller = BatchPuller(bus.nc, stream, durable, 500)
    await puller.start()
    got, t0, cpu0 = 0, time.perf_counter(), time.process_time()
    while got < n:
        msgs = await puller.next_batch(1.0, 0.05)
        for m in msgs:
            await bus.nc.publish(m.reply, b"+ACK")
        got += len(msgs)
    rate, cpu_us = n / (time.perf_counter() - t0), (time.process_time() - cpu0) / n * 1e6
    await puller.stop()
    return rate, cpu_us


def serve_round(url: str, n: int, max_tokens: int) -> float:
    body = {"model": "SmolLM2-135M-Instruct", "prompt": "The log is the record", "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True}

    def one(_: int) -> int:
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
        r.raise_for_status()
        return r.json()["usage"]["completion_tokens"]

    t0 = time.perf_counter()
    with ThreadPoolExecutor(n) as pool:
        tokens = sum(pool.map(one, range(n)))
    return tokens / (time.perf_counter() - t0)


async def until_caught_up(settings: CommonSettings, timeout_s: float = 120.0) -> None:
    bus = await Bus.connect(settings, "bench-catch-up")
    try:
        async with asyncio.timeout(timeout_s):
            while not await caught_up(bus):
                await asyncio.sleep(0.1)
    finally:
        await bus.close()


def stack_cpu_s(stack: Stack) -> dict[str, float]:
    """user + system CPU seconds so far of each live process of the stack."""
    return CpuMeter({name: [(proc.pid, False)] for name, proc in stack.procs.items()
                     if proc.poll() is None}).read()


async def publish_rate(url: str, n: int) -> float:
    settings = CommonSettings(nats_url=url, subject_prefix="sync", events_stream="PDS_SYNC")
    bus = await Bus.connect(settings, "bench")
    try:
        events = [e for _ in range(n // 12 + 1) for e in lifecycle(new_id())][:n]
        t0 = time.perf_counter()
        await publish(bus, events)
        return n / (time.perf_counter() - t0)
    finally:
        await bus.close()
