"""The routing benchmark's real-stack check: the policies in front of real prefill workers.

One disaggregated stack of real processes (tests/e2e/stack.py: recorder, router, coordinator, 4 prefill
workers, 1 decode worker, gateway) serving the tiny model (2 layers, hidden 64, SmolLM2's vocabulary,
seeded random weights: the hit rate depends on token ids only), on the machine's NATS and Postgres
(`PDS_TEST_NATS_URL`, `PDS_TEST_DATABASE_URL`) with a database, stream and subject prefix of its own.
Each prefill worker's KV cache holds `capacity_tokens` (the simulator's 128 blocks × 16), so prefixes
are evicted as they are in the simulation; the decode worker keeps the default capacity.

Per policy: only the router is restarted, with `PDS_POLICY=<policy>`; the workers keep running, and
each policy's requests carry a `cache_salt` of their own, so no policy hits blocks another one cached
(old-salt blocks only occupy capacity, as in any warm LRU). A smaller prefix-repetition run (vLLM's
prefix_len 256, suffix_len 256, num_prefixes 10) is sent open-loop at the workload's Poisson times
(one-token completions). Hit rate, ceiling and load then come from the event log of the policy's time
window through `pdserve report routing`'s own query and fold (`pdserve.routing.log.routed_requests`,
`pdserve.routing.report.summarize`). Last, every prefill worker is stopped and a few requests check that
the decode worker then prefills them itself (mode `local`) instead of the requests failing.
"""

from __future__ import annotations

import asyncio
import os
import random
import sys
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.routing_workloads import Prompt, prefix_repetition  # noqa: E402
from pdserve.config import CommonSettings  # noqa: E402
from pdserve.routing.log import routed_requests  # noqa: E402
from pdserve.routing.report import RoutingReport, summarize  # noqa: E402
from pdserve.service_plan import ServiceSpec  # noqa: E402
from pdserve.store.migrate import create_database, drop_database, upgrade  # noqa: E402
from pdserve.store.queries import make_db  # noqa: E402
from tests.e2e.stack import Stack  # noqa: E402


class RoutingStack(Stack):
    """A Stack whose router runs `policy` and whose prefill workers hold `capacity_tokens` of KV. Placement
    is the router service's (`n_routers=1`), so a policy is swapped by restarting the router alone."""

    def __init__(self, *args, capacity_tokens: int, **kw) -> None:
        super().__init__(*args, **{"n_routers": 1, **kw})
        self.capacity_tokens = capacity_tokens
        self.policy = "kv"

    def env(self, spec: ServiceSpec) -> dict[str, str]:
        env = super().env(spec)
        env["PDS_POLICY"] = self.policy
        env["PDS_SEED"] = "0"
        if spec.role == "prefill":
            env["PDS_KV_CAPACITY_TOKENS"] = str(self.capacity_tokens)
        return env

    def restart_router(self, policy: str) -> None:
        """The router again, now with `policy` (its KV index is rebuilt from the workers' next events)."""
        self.policy = policy
        self.kill("router", sig=15)
        self.start_service(next(s for s in self.plan if s.name == "router"))
        time.sleep(2.0)  # a few heartbeats: every worker is live in the new router


async def send_all(url: str, model: str, prompts: list[Prompt], salt: str) -> int:
    """Send every prompt at its arrival time (open loop); returns how many completed with 200."""
    t0 = time.monotonic()
    async with httpx.AsyncClient(timeout=120) as client:

        async def one(p: Prompt) -> bool:
            await asyncio.sleep(max(p.arrival_s - (time.monotonic() - t0), 0.0))
            body = {
                "model": model,
                "prompt": p.token_ids,
                "max_tokens": 1,
                "temperature": 0,
                "ignore_eos": True,
                "cache_salt": salt,
            }
            r = await client.post(f"{url}/v1/completions", json=body)
            return r.status_code == 200

        return sum(await asyncio.gather(*(one(p) for p in prompts)))


def local_fallback_check(stack: Stack) -> dict:
    """Stop every prefill worker, wait past the router's heartbeat timeout (3 s), send one completion: it
    should be served with the decode worker prefilling it itself (`RequestRouted.mode` 'local')."""
    for spec in stack.plan:
        if spec.role == "prefill":
            stack.kill(spec.name, sig=15)
    time.sleep(4.0)
    rng = random.Random(1)
    body = {
        "model": stack.served_model,
        "prompt": [rng.randrange(1000, 40000) for _ in range(64)],
        "max_tokens": 2,
        "temperature": 0,
        "ignore_eos": True,
    }
    out: dict = {"completed": False, "mode": None, "error": None}
    t0 = time.monotonic()
    try:
        r = httpx.post(f"{stack.url}/v1/completions", json=body, timeout=90)
        out["completed"] = r.status_code == 200
        rid = r.headers.get("x-request-id", "")
        out["error"] = None if r.status_code == 200 else f"HTTP {r.status_code}: {r.text[:200]}"
        for _ in range(50):  # the event log is written asynchronously
            events = httpx.get(f"{stack.url}/v1/requests/{rid}").json().get("events", [])
            routed = [e["payload"]["mode"] for e in events if e["type"] == "RequestRouted"]
            if routed:
                out["mode"] = routed[-1]
                break
            time.sleep(0.2)
    except httpx.HTTPError as e:
        out["error"] = repr(e)
    out["seconds"] = time.monotonic() - t0
    return out


async def window_report(database_url: str, since: datetime, until: datetime) -> RoutingReport:
    db = make_db(database_url)
    try:
        return summarize(await routed_requests(db, since, until))
    finally:
        await db.dispose()


def report_row(policy: str, report: RoutingReport, sent: int, ok: int, wall_s: float) -> dict:
    return {
        "policy": policy,
        "sent": sent,
        "completed": ok,
        "requests": report.requests,
        "unfinished": report.unfinished,
        "hit_rate": report.hit_rate,
        "ceiling_hit_rate": report.ceiling_hit_rate,
        "of_ceiling": report.of_ceiling,
        "gap_tokens": report.gap_tokens,
        "prediction_exact": report.prediction_exact,
        "max_min_requests": report.max_min_requests,
        "max_min_active_requests": report.max_min_active_requests,
        "requests_per_worker": {r.replica: r.requests for r in report.replicas},
        "mean_active_requests_per_worker": {r.replica: r.mean_active_requests for r in report.replicas},
        "modes": report.modes,
        "wall_s": wall_s,
    }


def run_stack_check(
    policies: list[str],
    num_prompts: int = 150,
    rate_per_s: float = 6.0,
    capacity_tokens: int = 2048,
    seed: int = 0,
    var_dir: Path = Path("var/bench/routing"),
) -> dict:
    """Start the stack, run every policy in turn, stop it. Returns the rows and the setup."""
    admin_url = os.environ.get(
        "PDS_TEST_DATABASE_URL", "postgresql+asyncpg://postgres@127.0.0.1:5432/postgres"
    )
    nats_url = os.environ.get("PDS_TEST_NATS_URL", "nats://127.0.0.1:4222")
    tag = f"rb{uuid.uuid4().hex[:8]}"
    db = f"pdserve_bench_{tag}"
    settings = CommonSettings(
        nats_url=nats_url,
        var_dir=Path("var").resolve(),
        database_url=create_database(admin_url, db),
        subject_prefix=tag,
        events_stream=f"PDS_EVENTS_{tag}",
    )
    upgrade(settings.database_url)
    stack = RoutingStack(
        settings,
        var_dir.resolve(),
        model="tiny",
        mode="disaggregated",
        n_prefill=4,
        n_decode=1,
        capacity_tokens=capacity_tokens,
    )
    rows = []
    t_start = time.monotonic()
    try:
        stack.start(timeout_s=300)
        startup_s = time.monotonic() - t_start
        for policy in policies:
            stack.restart_router(policy)
            prompts = prefix_repetition(random.Random(seed), num_prompts=num_prompts, rate_per_s=rate_per_s)
            since = datetime.now(UTC)
            t0 = time.monotonic()
            ok = asyncio.run(send_all(stack.url, stack.served_model, prompts, f"{policy}-{tag}"))
            wall = time.monotonic() - t0
            time.sleep(1.5)  # the recorder's last batch reaches Postgres
            report = asyncio.run(window_report(settings.database_url, since, datetime.now(UTC)))
            rows.append(report_row(policy, report, len(prompts), ok, wall))
            r = rows[-1]
            print(
                f"stack {policy:13} hit {r['hit_rate']:.3f} ceiling {r['ceiling_hit_rate']:.3f} "
                f"({r['of_ceiling']:.1%}) max/min active {r['max_min_active_requests']:.2f} "
                f"requests {r['max_min_requests']:.2f} ({ok}/{len(prompts)} ok, {wall:.0f} s)",
                flush=True,
            )
        fallback = local_fallback_check(stack)
        print(f"no prefill worker live: {fallback}", flush=True)
    finally:
        stack.stop()
        drop_database(admin_url, db)
    return {
        "model": "tiny (2 layers, hidden 64, SmolLM2 vocabulary, seeded random weights)",
        "prefill_workers": 4,
        "decode_workers": 1,
        "prefill_kv_capacity_tokens": capacity_tokens,
        "num_prompts": num_prompts,
        "rate_per_s": rate_per_s,
        "startup_s": startup_s,
        "total_s": time.monotonic() - t_start,
        "policies": rows,
        "local_fallback": fallback,
    }
