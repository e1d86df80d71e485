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
from pathlib import Path

from pdserve.bus import Bus
from pdserve.embedded import free_port, nats_server_binary
from pdserve.ids import new_id
from pdserve.store.queries import make_db
from pdserve.store.recorder import caught_up

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.events_load import (  # noqa: E402
    Part,
    bare_drain,
    count_events,
    drain_cpu_s,
    lifecycle,
    publish,
    publish_rate,
    serve_round,
    stack_cpu_s,
    top_seq,
    until_caught_up,
    wait_recorded,
)
from benchmarks.events_report import markdown  # noqa: E402
from tests.e2e.stack import Stack  # noqa: E402


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
        cpu0 = drain_cpu_s(rec.pid)
        rec.send_signal(signal.SIGCONT)
        t0 = time.perf_counter()
        while not samples or samples[-1][1] < n_events:
            samples.append((time.perf_counter() - t0, await top_seq(db) - base))
            await asyncio.sleep(0.02)
        cpu_us = {k: (v - cpu0.get(k, 0.0)) / n_events * 1e6 for k, v in drain_cpu_s(rec.pid).items()}
        assert await count_events(db) == n_events + len(warm)
        assert await caught_up(bus)
        bare, bare_cpu_us = await bare_drain(bus, part.settings.events_stream, n_events + len(warm))
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


def throughput_repeated(n_events: int, repeats: int, tmp: Path) -> dict:
    """`part_throughput` `repeats` times, each on a fresh stream and database; the median run's figures
    (by sustained events/s), with every run's sustained and bare figures beside them."""
    runs = [asyncio.run(part_throughput(n_events, tmp / f"run{i}")) for i in range(repeats)]
    runs_sorted = sorted(runs, key=lambda r: r["record_events_per_s_10_to_90"])
    return {**runs_sorted[len(runs) // 2], "runs": runs}


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
            serve_round(stack.url, n_requests, max_tokens)
        for q in range(n_quartets):
            order = ("on", "off", "off", "on") if q % 2 == 0 else ("off", "on", "on", "off")
            got: dict[str, list[float]] = {"on": [], "off": []}
            for phase in order:
                running = stack.procs["recorder"].poll() is None
                if phase == "off" and running:
                    stack.kill("recorder", 15)  # SIGTERM: it commits the batch in hand, then exits
                elif phase == "on" and not running:
                    stack.start_service(recorder)
                    asyncio.run(until_caught_up(part.settings))
                before = stack_cpu_s(stack)
                got[phase].append(serve_round(stack.url, n_requests, max_tokens))
                for name, used in stack_cpu_s(stack).items():
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
            out[name] = asyncio.run(publish_rate(f"nats://127.0.0.1:{port}", n))
        finally:
            proc.terminate()
            proc.wait(10)
    out["always_over_default"] = out["sync_always"] / out["default"]
    return out


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
