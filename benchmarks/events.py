"""The event log's costs: how fast the recorder writes, how far it lags, what recording costs serving, and
what JetStream's `sync_interval: always` costs publishers.

    python benchmarks/events.py [--events 60000] [--rate 1000] [--rate-s 10] [--requests 8]
                                [--max-tokens 128] [--quartets 14] [--out docs/benchmarks]

Needs a NATS server with JetStream and a Postgres (PDS_TEST_NATS_URL / PDS_TEST_DATABASE_URL, the admin
URL; defaults are the machine's own at 127.0.0.1). Every part uses its own stream, subjects and database.

1. Sustained events/s into Postgres: the real recorder service (its own process) is started and has
   recorded a first request before the clock starts; it is paused (SIGSTOP) while `--events` lifecycle
   events (the types of a real request, real payload sizes) are published, then resumed. Sustained =
   the slope of Postgres's progress between 10% and 90% of the backlog (20 ms samples); the whole drain
   from the resume is reported beside it. Same-run baselines: the JetStream publish rate, and a bare
   consumer draining the same backlog (`BatchPuller` + acks, no parsing, no Postgres): the transport's
   ceiling for this client library on this machine.
2. Recorder lag at a steady rate: events published at `--rate`/s (publish_async in 5 ms ticks) for
   `--rate-s` s while the recorder runs; an event's lag = the first 10 ms poll that sees it in Postgres
   − its publish time. The achieved rate is reported.
3. Serving throughput with recording on vs off, same run, same stack (tiny model, 1 prefill + 1 decode):
   `--requests` concurrent greedy completions, output tokens/s, in rounds with the recorder running and
   rounds with the recorder process stopped (events wait in JetStream; the serving path is byte for byte
   the same), in `--quartets` quartets alternating on/off/off/on and off/on/on/off so that drift cancels;
   before each "on" round the restarted recorder catches up first, so a round pays for its own events.
   Reported: the ratio of the medians, each quartet's ratio (the spread), and the recorder process's
   share of the stack's CPU during the on-rounds.
4. JetStream publish throughput with the server's default fsync (every 2 min) vs `sync_interval: always`,
   each against its own embedded nats-server, `publish_async` with all acks awaited.

The machine's load average is recorded with each part (the machine is shared). Writes events.json and
events.md under `--out`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil
import sqlalchemy as sa
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from pdserve.bus import Bus
from pdserve.config import CommonSettings
from pdserve.embedded import free_port, nats_server_binary
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
from pdserve.store.queries import make_db
from pdserve.store.recorder import caught_up

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tests.e2e.stack import Stack  # noqa: E402

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


async def part_throughput(n_events: int, tmp: Path) -> dict:
    """The recorder process is started and recording before the clock starts (its start is not
    "sustained"); it is paused (SIGSTOP) while the backlog is published, resumed (SIGCONT), and the
    progress of Postgres's highest stream sequence is sampled every 20 ms until it holds the backlog."""
    part = Part("drain", tmp)
    bus = await Bus.connect(part.settings, "bench")
    db = make_db(part.url)
    try:
        warm = lifecycle(new_id())
        rec = part.recorder()
        await publish(bus, warm)
        await wait_recorded(db, len(warm))
        base = await top_seq(db)
        rec.send_signal(signal.SIGSTOP)
        events = [e for _ in range(n_events // 12 + 1) for e in lifecycle(new_id())][:n_events]
        t0 = time.perf_counter()
        await publish(bus, events)
        publish_s = time.perf_counter() - t0
        samples: list[tuple[float, int]] = []  # (seconds since SIGCONT, events recorded)
        cpu0 = _drain_cpu_s(rec.pid)
        rec.send_signal(signal.SIGCONT)
        t0 = time.perf_counter()
        while not samples or samples[-1][1] < n_events:
            samples.append((time.perf_counter() - t0, await top_seq(db) - base))
            await asyncio.sleep(0.02)
        cpu_us = {k: (v - cpu0.get(k, 0.0)) / n_events * 1e6 for k, v in _drain_cpu_s(rec.pid).items()}
        assert await count_events(db) == n_events + len(warm)
        assert await caught_up(bus)
        bare, bare_cpu_us = await _bare_drain(bus, part.settings.events_stream, n_events + len(warm))
    finally:
        await db.dispose()
        await part.close()
        await bus.close()
    # Steady state: the slope between the first samples past 10% and past 90% of the backlog.
    t10, n10 = next(s for s in samples if s[1] >= 0.1 * n_events)
    t90, n90 = next(s for s in samples if s[1] >= 0.9 * n_events)
    return {"events": n_events, "publish_events_per_s": n_events / publish_s,
            "record_s_from_resume": samples[-1][0],
            "record_events_per_s_from_resume": n_events / samples[-1][0],
            "record_events_per_s_10_to_90": (n90 - n10) / (t90 - t10), "bare_consume_events_per_s": bare,
            "bare_consume_cpu_us_per_event": bare_cpu_us, "drain_cpu_us_per_event": cpu_us,
            "loadavg_1m": os.getloadavg()[0]}


def _drain_cpu_s(recorder_pid: int) -> dict[str, float]:
    """CPU seconds (user + system) so far of the recorder process, of all Postgres processes and of all
    nats-server processes on this machine (those serve only this benchmark's drain while it runs, give or
    take the other sessions sharing the machine)."""
    out = {"recorder": 0.0, "postgres": 0.0, "nats-server": 0.0}
    for proc in psutil.process_iter(["name"]):
        name = "recorder" if proc.pid == recorder_pid else proc.info["name"]
        if name in out:
            try:
                t = proc.cpu_times()
            except psutil.Error:
                continue
            out[name] += t.user + t.system
    return out


def throughput_repeated(n_events: int, repeats: int, tmp: Path) -> dict:
    """`part_throughput` `repeats` times, each on a fresh stream and database; the median run's figures
    (by sustained events/s), with every run's sustained and bare figures beside them."""
    runs = [asyncio.run(part_throughput(n_events, tmp / f"run{i}")) for i in range(repeats)]
    runs_sorted = sorted(runs, key=lambda r: r["record_events_per_s_10_to_90"])
    return {**runs_sorted[len(runs) // 2], "runs": runs}


async def _bare_drain(bus: Bus, stream: str, n: int) -> tuple[float, float]:
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


async def part_lag(rate: float, seconds: float, tmp: Path) -> dict:
    """Events published at `rate`/s (publish_async in 5 ms ticks, so the publisher keeps up) while the
    recorder runs; an event's lag = the first 10 ms poll that sees its stream sequence in Postgres − its
    publish time."""
    part = Part("lag", tmp)
    bus = await Bus.connect(part.settings, "bench")
    db = make_db(part.url)
    part.recorder()
    try:
        warm = lifecycle(new_id())
        await publish(bus, warm)  # the recorder is up and bound before the clock starts
        await wait_recorded(db, len(warm))
        n = int(rate * seconds)
        events = [e for _ in range(n // 12 + 1) for e in lifecycle(new_id())][:n]
        payloads = [(bus.subjects.event(e.request_id, e.type), e.model_dump_json().encode(), e.event_id)
                    for e in events]
        acks: list[tuple[asyncio.Future, float]] = []  # (PubAck future, publish time)
        seen: list[tuple[float, int]] = []  # (poll time, max stream seq in Postgres)
        stop = asyncio.Event()

        async def poll() -> None:
            while not stop.is_set() or seen[-1][1] < last_seq:
                seen.append((time.time(), await top_seq(db)))
                await asyncio.sleep(0.01)

        last_seq = 1 << 62
        poller = asyncio.ensure_future(poll())
        start = time.perf_counter()
        while len(acks) < n:
            due = min(n, int((time.perf_counter() - start) * rate) + 1)
            t = time.time()
            for subject, data, msg_id in payloads[len(acks):due]:
                fut = await bus.js.publish_async(subject, data, headers={"Nats-Msg-Id": msg_id})
                acks.append((fut, t))
            await asyncio.sleep(0.005)
        achieved = n / (time.perf_counter() - start)
        await bus.js.publish_async_completed()
        published = [((await fut).seq, t) for fut, t in acks]
        last_seq = max(seq for seq, _ in published)
        stop.set()
        await asyncio.wait_for(poller, 60)
    finally:
        await db.dispose()
        await part.close()
        await bus.close()
    lags, j = [], 0
    for seq, t in sorted(published):  # both in increasing seq order
        while seen[j][1] < seq:
            j += 1
        lags.append(max(0.0, seen[j][0] - t))
    q = statistics.quantiles(lags, n=100)
    return {"rate_events_per_s": rate, "achieved_events_per_s": achieved, "seconds": seconds,
            "events": len(lags), "lag_p50_s": q[49], "lag_p99_s": q[98], "lag_max_s": max(lags),
            "poll_interval_s": 0.01}


def _serve_round(url: str, n: int, max_tokens: int) -> float:
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


def part_serving(n_requests: int, max_tokens: int, n_quartets: int, tmp: Path) -> dict:
    """Rounds with the recorder running ("on") and stopped ("off"), in `n_quartets` on/off/off/on
    quartets alternating with off/on/on/off ones, so drift cancels within each; before an "on" round the
    restarted recorder first catches up on the events the "off" rounds left in JetStream, so each round
    pays for recording its own events only."""
    part = Part("serve", tmp)
    stack = Stack(part.settings, tmp / "stack", model="tiny").start()
    rounds: dict[str, list[float]] = {"on": [], "off": []}
    quartets: list[float] = []  # on/off ratio of the output tokens/s within each quartet
    cpu: dict[str, dict[str, float]] = {"on": {}, "off": {}}  # CPU seconds per process, summed over rounds
    recorder = next(s for s in stack.plan if s.name == "recorder")
    try:
        for _ in range(3):  # warm-up: the first rounds of a fresh stack are the slowest
            _serve_round(stack.url, n_requests, max_tokens)
        for q in range(n_quartets):
            order = ("on", "off", "off", "on") if q % 2 == 0 else ("off", "on", "on", "off")
            got: dict[str, list[float]] = {"on": [], "off": []}
            for phase in order:
                running = stack.procs["recorder"].poll() is None
                if phase == "off" and running:
                    stack.kill("recorder", 15)  # SIGTERM: it commits the batch in hand, then exits
                elif phase == "on" and not running:
                    stack.start_service(recorder)
                    asyncio.run(_until_caught_up(part.settings))
                before = _cpu_s(stack)
                got[phase].append(_serve_round(stack.url, n_requests, max_tokens))
                for name, used in _cpu_s(stack).items():
                    cpu[phase][name] = cpu[phase].get(name, 0.0) + used - before.get(name, 0.0)
            quartets.append(sum(got["on"]) / sum(got["off"]))
            for phase in got:
                rounds[phase] += got[phase]
    finally:
        stack.stop()
        asyncio.run(part.close())
    on, off = statistics.median(rounds["on"]), statistics.median(rounds["off"])
    return {"requests": n_requests, "max_tokens": max_tokens, "tokens_per_s_on": rounds["on"],
            "tokens_per_s_off": rounds["off"], "on_over_off": on / off, "quartet_on_over_off": quartets,
            "quartet_median": statistics.median(quartets), "cpu_s": cpu,
            "recorder_cpu_share_on": cpu["on"].get("recorder", 0.0) / sum(cpu["on"].values())}


async def _until_caught_up(settings: CommonSettings, timeout_s: float = 120.0) -> None:
    bus = await Bus.connect(settings, "bench-catch-up")
    try:
        async with asyncio.timeout(timeout_s):
            while not await caught_up(bus):
                await asyncio.sleep(0.1)
    finally:
        await bus.close()


def _cpu_s(stack: Stack) -> dict[str, float]:
    """user + system CPU seconds so far of each live process of the stack."""
    out = {}
    for name, proc in stack.procs.items():
        try:
            t = psutil.Process(proc.pid).cpu_times()
            out[name] = t.user + t.system
        except psutil.Error:
            pass
    return out


async def _publish_rate(url: str, n: int) -> float:
    settings = CommonSettings(nats_url=url, subject_prefix="sync", events_stream="PDS_SYNC")
    bus = await Bus.connect(settings, "bench")
    try:
        events = [e for _ in range(n // 12 + 1) for e in lifecycle(new_id())][:n]
        t0 = time.perf_counter()
        await publish(bus, events)
        return n / (time.perf_counter() - t0)
    finally:
        await bus.close()


def part_sync(n: int, tmp: Path) -> dict:
    out = {}
    for name, sync in (("default", ""), ("sync_always", ", sync_interval: always")):
        store = tmp / f"nats-{name}"
        store.mkdir(parents=True)
        port = free_port()
        cfg = store / "nats.conf"
        cfg.write_text(f'listen: 127.0.0.1:{port}\njetstream {{ store_dir: "{store}"{sync} }}\n')
        proc = subprocess.Popen([str(nats_server_binary()), "-c", str(cfg)], stdout=subprocess.DEVNULL,
                                stderr=subprocess.STDOUT)
        try:
            time.sleep(1.0)
            out[name] = asyncio.run(_publish_rate(f"nats://127.0.0.1:{port}", n))
        finally:
            proc.terminate()
            proc.wait(10)
    out["always_over_default"] = out["sync_always"] / out["default"]
    return out


def markdown(r: dict) -> str:
    t, lag, s, sync = r["throughput"], r["lag"], r["serving"], r["jetstream_sync"]
    ms = 1000.0
    quartets = sorted(s["quartet_on_over_off"])
    cpu = t["drain_cpu_us_per_event"]
    cpu_sum = sum(cpu.values())
    rows = [
        (f"**sustained events/s into Postgres** (the running recorder draining a {t['events']:,}-event "
         f"backlog; slope from 10% to 90% of it; median of {len(t['runs'])} runs)",
         f"**{t['record_events_per_s_10_to_90']:,.0f} events/s** (target ≥ 20,000); runs: "
         + ", ".join(f"{x['record_events_per_s_10_to_90']:,.0f}" for x in t["runs"])),
        ("the same, whole drain from the recorder's resume",
         f"{t['record_events_per_s_from_resume']:,.0f}/s"),
        ("baseline: bare consumer of the same backlog (pull + ack only, no parsing, no Postgres), same run",
         f"{t['bare_consume_events_per_s']:,.0f}/s (recorder at "
         f"{t['record_events_per_s_10_to_90'] / t['bare_consume_events_per_s']:.0%} of it); runs: "
         + ", ".join(f"{x['bare_consume_events_per_s']:,.0f}" for x in t["runs"])),
        ("CPU µs per event during the drain (median run; user + system): recorder, Postgres, nats-server",
         f"{cpu['recorder']:.0f}, {cpu['postgres']:.0f}, {cpu['nats-server']:.0f} (sum {cpu_sum:.0f}); "
         f"bare consumer's own: {t['bare_consume_cpu_us_per_event']:.0f}"),
        ("baseline: JetStream publish of the backlog (publish_async, acks awaited)",
         f"{t['publish_events_per_s']:,.0f}/s"),
        (f"recorder lag at {lag['rate_events_per_s']:,.0f} events/s for {lag['seconds']:.0f} s "
         f"(achieved {lag['achieved_events_per_s']:,.0f}/s; 10 ms poll)",
         f"p50 **{lag['lag_p50_s'] * ms:.0f} ms**, p99 **{lag['lag_p99_s'] * ms:.0f} ms**, "
         f"max {lag['lag_max_s'] * ms:.0f} ms"),
        ("serving output tokens/s, recording on (rounds)",
         ", ".join(f"{x:.0f}" for x in s["tokens_per_s_on"])),
        ("serving output tokens/s, recording off (rounds)",
         ", ".join(f"{x:.0f}" for x in s["tokens_per_s_off"])),
        ("**with recording / without** (ratio of the medians)", f"**{s['on_over_off']:.1%}** (target ≥ 97%)"),
        (f"the same within each of the {len(quartets)} quartets (sorted)",
         ", ".join(f"{x:.0%}" for x in quartets) + f"; median {s['quartet_median']:.1%}"),
        ("recorder process CPU during the on-rounds, share of the whole stack's",
         f"{s['recorder_cpu_share_on']:.1%}"),
        ("JetStream publish events/s, default sync (fsync every 2 min)", f"{sync['default']:,.0f}"),
        ("JetStream publish events/s, `sync_interval: always`",
         f"{sync['sync_always']:,.0f} ({sync['always_over_default']:.0%} of default)"),
        ("load average (1 min) at the start of each part: throughput, lag, serving, sync",
         ", ".join(f"{r['load'][p]:.1f}" for p in ("throughput", "lag", "serving", "jetstream_sync"))),
    ]
    table = "\n".join(f"| {what} | {result} |" for what, result in rows)
    return f"""# Event log benchmark

`python benchmarks/events.py` on {r['machine']} ({r['date']}). Ratios are measured in the same run.

| what | result |
|---|---|
{table}

Recorder (libs/pdserve/store/recorder.py): one process, batches of ≤ 500 events, each one transaction (COPY
into `events`; the batch's requests' rows locked, folded in Python by `projection.apply` — the fold replay
uses — and upserted in one statement); two batches' transactions overlap on two connections (a batch's
COPY runs while the batch before folds and commits), and the next batch is pulled and parsed meanwhile;
explicit acks after each commit. Its CPU per event is in the table: of it, nats-py taking the message off
the socket and acking it is about the bare consumer's own figure, the rest is validating the envelope
(pydantic), the COPY record, the fold (which validates each projected payload) and asyncpg. At the
target's 20,000 events/s the three processes need 20,000 × {cpu_sum:.0f} µs = {0.02 * cpu_sum:.1f} of
the machine's 2 cores, which they share with the other sessions' work, and the recorder, one Python
thread, tops out at {1e6 / cpu['recorder']:,.0f} events/s with a whole core to itself: the sustained figure
therefore moves with the load average in the table. At serving rates (a few hundred events/s, ≤ 4
transactions/s: `PDS_LINGER_S`, 0.25 s) the CPU per event is many times higher: each transaction's fixed
round trips to Postgres and NATS (each a few slow syscalls on this VM) dominate, which is what the CPU share
below measures.

Serving: tiny model, 1 prefill + 1 decode worker, {s['requests']} concurrent greedy completions of
{s['max_tokens']} tokens per round; 3 warm-up rounds, then quartets on/off/off/on and off/on/on/off
alternately (the recorder stopped with SIGTERM for "off", events waiting in JetStream; restarted and caught
up before an "on" round). The machine has 2 cores shared by every process of the stack and by the other
sessions' work, so single rounds vary by ±30%; the quartet ratios show that spread. The recorder's CPU
share bounds what recording itself takes from serving (Postgres's commit work comes on top: one
transaction per ≤ 250 ms of events, `PDS_LINGER_S`; at 50 ms this benchmark measured 95% instead of
97-98%).

## Durability decision

JetStream acknowledges a publish once the message is in the server's file store, not once it is fsynced
(the server syncs every 2 minutes by default; docs/architecture.md §10). pdserve keeps the default: Postgres
is the
record (the recorder acks only after its transaction commits, and Postgres fsyncs each commit), JetStream is
the buffer in front of it, and with the recorder caught up (lag above) an event spends well under a second
unsynced in the buffer alone. Losing it needs the NATS host to lose power in that window — not a process
crash: a killed nats-server keeps what the kernel has (tests/faults/test_infra_restarts.py restarts it
under load). `sync_interval: always` costs publishers the ratio in the table; run the server with it where
a power loss must not lose an event that was acknowledged but not yet recorded.
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--events", type=int, default=60000)
    ap.add_argument("--rate", type=float, default=1000.0)
    ap.add_argument("--rate-s", type=float, default=10.0)
    ap.add_argument("--requests", type=int, default=8)
    # Rounds of ~1 s and 14 quartets: with 0.5 s rounds and 6 quartets one run's ratio moved by ±3%.
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--quartets", type=int, default=14, help="on/off quartets of serving rounds")
    ap.add_argument("--repeats", type=int, default=3, help="runs of the throughput part (median reported)")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks")
    ap.add_argument("--only", choices=("throughput", "lag", "jetstream_sync", "serving"),
                    help="run one part and print its JSON (nothing written)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        parts = {
            "throughput": lambda: throughput_repeated(args.events, args.repeats, tmp),
            "lag": lambda: asyncio.run(part_lag(args.rate, args.rate_s, tmp)),
            "jetstream_sync": lambda: part_sync(args.events // 2, tmp),
            "serving": lambda: part_serving(args.requests, args.max_tokens, args.quartets, tmp),
        }
        if args.only:
            print(json.dumps(parts[args.only](), indent=2))
            return
        result = {"machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.python_version()}",
                  "date": time.strftime("%Y-%m-%d")}
        result["load"] = {}
        for name, run in parts.items():
            result["load"][name] = os.getloadavg()[0]
            result[name] = run()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "events.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / "events.md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
