"""The bus floor under the control plane: what one NATS request/reply between two processes costs on this
machine, bare (nats-py alone) and typed (`Bus.request` → `Bus.serve`: the pydantic messages, trace headers
and per-message task every command of pdserve pays), measured on an embedded nats-server of its own.

A request's way to its first token through pdserve is a chain of messages through NATS, each a hop
sender → server → receiver (two process wake-ups). `CRITICAL_PATH_MESSAGES[stack]` one-way messages long:

1.   gateway → coordinator: `Submit`,
2-3. coordinator: the request's lease claimed in the lease bucket (JetStream KV) and its ack, and its
     `RequestReceived` stored in JetStream and its ack (the two round trips overlap, one on the path), while
     the coordinator places the request in-process (`RequestLifecycle.route_ahead`; with `PDS_PLACEMENT=
     router`, coordinator → router → coordinator overlaps them too),
4-5. disaggregated only: coordinator → decode worker → coordinator: reserve (a colocated placement is
     local: its prefill command reserves, lifecycle/placement.py),
6.   coordinator → prefill (or unified) worker: prefill (its reply comes after the forward, off this path),
7.   prefill worker → gateway: the first token (`TokenChunk`).

So `CRITICAL_PATH_MESSAGES[stack] × round trip / 2` is the least the control plane can add above the HTTP
floor with these hops on this machine, before any service does any work (benchmarks/control_plane.py
reports it beside its target).

    python -c "from pdserve.bench.bus_floor import main; main()" NATS_URL    # the responder process
"""

from __future__ import annotations

import asyncio
import statistics
import subprocess
import sys
import time
from pathlib import Path

import nats

from pdserve.bus import Bus
from pdserve.config import CommonSettings
from pdserve.embedded import free_port, start_nats
from pdserve.messages import Ack

CRITICAL_PATH_MESSAGES = {"colocated": 5, "disaggregated": 7}
RAW_SUBJECT, TYPED_SUBJECT = "busfloor.raw", "busfloor.typed"


async def _respond(url: str) -> None:
    nc = await nats.connect(url)

    async def echo(msg) -> None:
        await msg.respond(msg.data)

    await nc.subscribe(RAW_SUBJECT, cb=echo)
    bus = Bus(nc, nc.jetstream(), CommonSettings(nats_url=url), "bus-floor")

    async def ack(_: Ack) -> Ack:
        return Ack()

    await bus.serve(TYPED_SUBJECT, Ack, ack)
    print("ready", flush=True)
    await asyncio.Event().wait()


def main() -> None:
    asyncio.run(_respond(sys.argv[1]))


async def _round_trips(url: str, n: int) -> dict[str, float]:
    nc = await nats.connect(url)
    bus = Bus(nc, nc.jetstream(), CommonSettings(nats_url=url), "bus-floor-client")
    try:
        raw, typed = [], []
        for i in range(n + 20):  # the first 20 warm the connection up and are not counted
            t0 = time.perf_counter()
            await nc.request(RAW_SUBJECT, b"x" * 400, timeout=5)
            t1 = time.perf_counter()
            await bus.request(TYPED_SUBJECT, Ack(), Ack, timeout_s=5)
            t2 = time.perf_counter()
            if i >= 20:
                raw.append(t1 - t0)
                typed.append(t2 - t1)
        return {"raw_round_trip_p50_ms": statistics.median(raw) * 1e3,
                "typed_round_trip_p50_ms": statistics.median(typed) * 1e3, "round_trips": n}
    finally:
        await nc.close()


def measure_bus_floor(work_dir: Path, n: int = 300) -> dict[str, float]:
    """Round-trip p50s (ms) over `n` alternating bare and typed request/replies between this process and a
    responder process, on an embedded nats-server under `work_dir`, with the critical path's messaging floor
    derived from them for each stack (`critical_path_ms_raw_<stack>` / `_typed_<stack>`:
    `CRITICAL_PATH_MESSAGES[stack]` × round trip / 2).
    Raises RuntimeError when the responder does not start."""
    server = start_nats(work_dir / "bus-floor-nats", free_port())
    proc = subprocess.Popen([sys.executable, "-c", "from pdserve.bench.bus_floor import main; main()",
                             server.url], stdout=subprocess.PIPE, text=True)
    try:
        if (proc.stdout.readline() if proc.stdout else "").strip() != "ready":
            raise RuntimeError("the bus-floor responder did not start")
        out = asyncio.run(_round_trips(server.url, n))
    finally:
        proc.terminate()
        proc.wait(10)
        server.stop()
    for stack, messages in CRITICAL_PATH_MESSAGES.items():
        out[f"critical_path_messages_{stack}"] = messages
        for kind in ("raw", "typed"):
            out[f"critical_path_ms_{kind}_{stack}"] = messages * out[f"{kind}_round_trip_p50_ms"] / 2
    return out
