"""The load generator's loop: send samples at their arrival times, at most `max_concurrency` at once, and
collect one `RequestRecord` each (vllm/benchmarks/serve.py `benchmark`: arrivals from `get_request`, a
semaphore for `--max-concurrency`, duration = first send scheduled → last response)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass

import httpx
import numpy as np
from tqdm.asyncio import tqdm

from pdserve.bench.arrivals import arrival_times
from pdserve.bench.client import send_completion
from pdserve.bench.datasets import SampleRequest
from pdserve.bench.metrics import RequestRecord


@dataclass(frozen=True)
class LoadSpec:
    """How to send: `request_rate` req/s (inf = all at once), gamma `burstiness` (1 = Poisson),
    `max_concurrency` requests in flight at most (None = unbounded), `seed` for the arrival process,
    `read_timeout_s` seconds of silence after which a request fails."""

    request_rate: float = float("inf")
    burstiness: float = 1.0
    max_concurrency: int | None = None
    seed: int = 0
    ignore_eos: bool = True
    # The longest silence between two chunks before a request counts as failed. A benchmark request may
    # wait behind a long queue (vLLM's client allows 6 h in all); a sweep sets less so a stall ends it.
    read_timeout_s: float = 3600.0


@dataclass(frozen=True)
class RunResult:
    """Every record, in sample order, and the run's wall time in seconds. `started_at_unix` marks the
    start (UNIX seconds) for joining with the event log."""

    records: list[RequestRecord]
    duration_s: float
    started_at_unix: float


async def discover_model(client: httpx.AsyncClient, base_url: str) -> str | None:
    """The first model id of GET /v1/models, or None when the server does not list one (the gateway then
    uses its served model)."""
    try:
        r = await client.get(f"{base_url}/v1/models")
        data = r.json().get("data") or []
        return data[0]["id"] if r.status_code == 200 and data else None
    except (httpx.HTTPError, ValueError, KeyError):
        return None


async def run_load(base_url: str, samples: Sequence[SampleRequest], load: LoadSpec,
                   model: str | None = None, progress: bool = True) -> RunResult:
    """Send `samples` to `<base_url>/v1/completions` as `load` says. A sample with `after` set waits for
    that request to finish first (multi-turn); its turn still counts from its own arrival time."""
    times = arrival_times(len(samples), load.request_rate, load.burstiness, np.random.default_rng(load.seed))
    finished = [asyncio.Event() for _ in samples]
    limit = asyncio.Semaphore(load.max_concurrency) if load.max_concurrency else None
    url = f"{base_url.rstrip('/')}/v1/completions"
    cap = load.max_concurrency
    limits = httpx.Limits(max_connections=cap, max_keepalive_connections=cap)
    timeout = httpx.Timeout(connect=30.0, read=load.read_timeout_s, write=60.0, pool=None)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        if model is None:
            model = await discover_model(client, base_url)
        bar = tqdm(total=len(samples), disable=not progress, unit="req", desc="requests")
        t0 = time.perf_counter()
        started_at = time.time()

        async def one(i: int, sample: SampleRequest) -> RequestRecord:
            try:
                await asyncio.sleep(max(0.0, t0 + times[i] - time.perf_counter()))
                if sample.after is not None:
                    await finished[sample.after].wait()
                if limit is None:
                    return await send_completion(client, url, i, sample, model, load.ignore_eos)
                async with limit:
                    return await send_completion(client, url, i, sample, model, load.ignore_eos)
            finally:
                finished[i].set()
                bar.update(1)

        records = await asyncio.gather(*(one(i, s) for i, s in enumerate(samples)))
        duration_s = time.perf_counter() - t0
        bar.close()
    return RunResult(list(records), duration_s, started_at)
