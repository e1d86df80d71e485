"""The seed's substitution claim on a real stack: "perfect routing reduces the need for a shared store, and a
fast shared store reduces the need for perfect routing" — {kv routing, round robin} × {store off, store on}.

One disaggregated stack of real processes (tests/e2e/stack.py: recorder, router, coordinator, 4 prefill
workers, 1 decode worker, gateway) serving the tiny model (2 layers, hidden 64, SmolLM2's vocabulary,
seeded random weights: the hit rate depends on token ids only), each prefill worker's KV cache
`capacity_tokens` (128 blocks × 16, as benchmarks/routing_stack.py), on the machine's NATS and Postgres
(`PDS_TEST_NATS_URL`, `PDS_TEST_DATABASE_URL`) and a real Mooncake Store (`pdserve.embedded.start_mooncake`,
loopback). Two workloads (benchmarks/routing_workloads.py, scaled to this machine): vLLM's prefix repetition
(10 prefixes of 256 tokens + 256-token suffixes, Poisson) and multi-turn chat (one system prompt, each turn
the whole history). Requests are one-token completions sent open-loop at the workload's times.

Store off / on: the prefill and decode workers are restarted with or without `PDS_KV_STORE=mooncake`;
policy: only the router is restarted with `PDS_POLICY`. Every (store, policy, workload) cell carries a
`cache_salt` of its own, so no cell hits another's blocks in any pool or in the store. Cells run in the order
store off (kv, round robin), store on (kv, round robin), per workload interleaved.

Per cell, from the event log of its time window (`pdserve report routing`'s fold, `routing/report.py`):
hit rate by tier (pool, store) = cached tokens from that tier / prompt tokens, prompt tokens computed
(prompt − cached); from the client: TTFT p50 / p99 (the one-token completion's latency, which is its time
to first token plus the response's return). Headline: round robin with the store / kv routing without it,
hit rate (target ≥ 0.90).

    .venv/bin/python benchmarks/kv_store.py             # → docs/benchmarks/kv_store.{json,md,png}
    .venv/bin/python benchmarks/kv_store.py --from-json docs/benchmarks/kv_store.json   # re-render
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import sys
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path

import httpx
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.routing_stack import RoutingStack, window_report  # noqa: E402
from benchmarks.routing_workloads import Prompt, multi_turn_chat, prefix_repetition  # noqa: E402
from pdserve.config import CommonSettings  # noqa: E402
from pdserve.service_plan import ServiceSpec  # noqa: E402
from pdserve.store.migrate import create_database, drop_database, upgrade  # noqa: E402

TARGET = 0.90
POLICIES = ("kv", "round_robin")
STORES = ("off", "on")


class StoreStack(RoutingStack):
    """A RoutingStack whose workers use the Mooncake Store at `store_url` while `store_on`."""

    def __init__(self, *args, store_url: str, **kw) -> None:
        super().__init__(*args, **kw)
        self.store_url = store_url
        self.store_on = False

    def env(self, spec: ServiceSpec) -> dict[str, str]:
        env = super().env(spec)
        if spec.is_worker and self.store_on:
            env |= {"PDS_KV_STORE": "mooncake", "PDS_KV_STORE_URL": self.store_url}
        return env

    def restart_workers(self, store_on: bool) -> None:
        """Every worker again, with the store or without (empty pools either way)."""
        self.store_on = store_on
        workers = [s for s in self.plan if s.is_worker]
        for spec in workers:
            self.kill(spec.name, sig=15)
        for spec in workers:
            self.start_service(spec)
        self.wait_ready(300)


def workloads(seed: int) -> dict[str, list[Prompt]]:
    return {
        "prefix repetition": prefix_repetition(random.Random(seed), num_prompts=120, rate_per_s=5.0),
        "multi-turn chat": multi_turn_chat(random.Random(seed), num_conversations=16, turns=5,
                                           start_spread_s=12.0, think_s=2.5),
    }


async def send_all(url: str, model: str, prompts: list[Prompt], salt: str) -> tuple[int, list[float]]:
    """Send every prompt at its arrival time; (how many completed with 200, their latencies in s)."""
    t0 = time.monotonic()
    latencies: list[float] = []
    bar = tqdm(total=len(prompts), leave=False, desc=salt.split("-")[0])
    async with httpx.AsyncClient(timeout=120) as client:

        async def one(p: Prompt) -> bool:
            await asyncio.sleep(max(p.arrival_s - (time.monotonic() - t0), 0.0))
            body = {"model": model, "prompt": p.token_ids, "max_tokens": 1, "temperature": 0,
                    "ignore_eos": True, "cache_salt": salt}
            start = time.monotonic()
            try:
                r = await client.post(f"{url}/v1/completions", json=body)
            except httpx.HTTPError:  # a reset connection is a failed request, counted, not the run's end
                bar.update()
                return False
            bar.update()
            if r.status_code != 200:
                return False
            latencies.append(time.monotonic() - start)
            return True

        ok = sum(await asyncio.gather(*(one(p) for p in prompts)))
    bar.close()
    return ok, latencies


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def run(seed: int, capacity_tokens: int, var_dir: Path) -> dict:
    from pdserve.embedded import start_mooncake

    admin_url = os.environ.get("PDS_TEST_DATABASE_URL", "postgresql+asyncpg://postgres@127.0.0.1:5432/postgres")
    nats_url = os.environ.get("PDS_TEST_NATS_URL", "nats://127.0.0.1:4222")
    tag = f"ks{uuid.uuid4().hex[:8]}"
    db = f"pdserve_bench_{tag}"
    settings = CommonSettings(nats_url=nats_url, var_dir=Path("var").resolve(),
                              database_url=create_database(admin_url, db), subject_prefix=tag,
                              events_stream=f"PDS_EVENTS_{tag}")
    upgrade(settings.database_url)
    var_dir = var_dir.resolve()
    store = start_mooncake(var_dir / "mooncake", segment_bytes=512 << 20)
    stack = StoreStack(settings, var_dir, model="tiny", mode="disaggregated", n_prefill=4, n_decode=1,
                       capacity_tokens=capacity_tokens, store_url=store.url)
    rows: list[dict] = []
    t_start = time.monotonic()
    try:
        stack.start(timeout_s=300)
        for store_setting in STORES:
            stack.restart_workers(store_setting == "on")
            for policy in POLICIES:
                stack.restart_router(policy)
                for name, prompts in workloads(seed).items():
                    salt = f"{policy}-{store_setting}-{name.split()[0]}-{tag}"
                    since = datetime.now(UTC)
                    t0 = time.monotonic()
                    ok, lat = asyncio.run(send_all(stack.url, stack.served_model, prompts, salt))
                    wall = time.monotonic() - t0
                    time.sleep(1.5)  # the recorder's last batch reaches Postgres
                    rep = asyncio.run(window_report(settings.database_url, since, datetime.now(UTC)))
                    row = {
                        "workload": name, "policy": policy, "store": store_setting, "sent": len(prompts),
                        "completed": ok, "requests": rep.requests, "prompt_tokens": rep.prompt_tokens,
                        "cached_tokens": rep.cached_tokens,
                        "computed_tokens": rep.prompt_tokens - rep.cached_tokens,
                        "hit_rate": rep.hit_rate, "hit_rate_by_tier": rep.hit_rate_by_tier,
                        "ceiling_hit_rate": rep.ceiling_hit_rate, "ttft_p50_s": percentile(lat, 0.5),
                        "ttft_p99_s": percentile(lat, 0.99),
                        "ttft_mean_s": statistics.fmean(lat) if lat else None,
                        "requests_per_worker": {r.replica: r.requests for r in rep.replicas}, "wall_s": wall,
                        "load_average_1m": os.getloadavg()[0],
                    }
                    rows.append(row)
                    tiers = " ".join(f"{t} {v:.3f}" for t, v in row["hit_rate_by_tier"].items())
                    print(f"{name:18} {policy:12} store {store_setting:3}: "
                          f"hit {row['hit_rate']:.3f} ({tiers}) "
                          f"computed {row['computed_tokens']} TTFT p50 {row['ttft_p50_s'] * 1e3:.0f} ms "
                          f"p99 {row['ttft_p99_s'] * 1e3:.0f} ms ({ok}/{len(prompts)} ok, {wall:.0f} s)",
                          flush=True)
    finally:
        stack.stop()
        store.stop()
        drop_database(admin_url, db)
    return {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
        "date": time.strftime("%Y-%m-%d"),
        "seed": seed,
        "model": "tiny (2 layers, hidden 64, SmolLM2 vocabulary, seeded random weights)",
        "prefill_workers": 4, "decode_workers": 1, "prefill_kv_capacity_tokens": capacity_tokens,
        "store": "Mooncake Store 0.3.13 (mooncake-transfer-engine-non-cuda), TCP, 512 MiB segment, loopback",
        "total_s": time.monotonic() - t_start,
        "rows": rows,
        "substitution": substitution(rows),
    }


def substitution(rows: list[dict]) -> dict[str, dict]:
    """Per workload: hit rate of round robin with the store / kv routing without it (the headline), and
    every cell's hit rate and TTFT p50 against kv-without-store's, measured in the same run."""
    out: dict[str, dict] = {}
    for name in dict.fromkeys(r["workload"] for r in rows):
        cell = {(r["policy"], r["store"]): r for r in rows if r["workload"] == name}
        base = cell.get(("kv", "off"))
        rr_on = cell.get(("round_robin", "on"))
        if not base or not rr_on or not base["hit_rate"]:
            continue
        out[name] = {
            "rr_store_over_kv_no_store": rr_on["hit_rate"] / base["hit_rate"],
            "target_met": rr_on["hit_rate"] / base["hit_rate"] >= TARGET,
            "hit_over_kv_no_store": {f"{p}/{s}": c["hit_rate"] / base["hit_rate"]
                                     for (p, s), c in cell.items()},
            "ttft_p50_over_kv_no_store": {f"{p}/{s}": c["ttft_p50_s"] / base["ttft_p50_s"]
                                          for (p, s), c in cell.items()},
        }
    return out


def write_markdown(result: dict, path: Path) -> None:
    lines = [
        "# Shared KV store (Mooncake Store): does a fast store substitute for perfect routing?",
        "",
        f"`python benchmarks/kv_store.py` — {result['machine']}, {result['date']}, seed {result['seed']}; "
        f"{result['prefill_workers']} prefill workers ({result['prefill_kv_capacity_tokens']} tokens of KV "
        f"each) + {result['decode_workers']} decode worker, {result['model']}; {result['store']}.",
        "",
        "Hit rate = cached prompt tokens / prompt tokens, from the event log (`PrefillCompleted."
        "cached_tokens_by_tier`), split by the tier the tokens came from; computed = prompt tokens the "
        "prefill workers computed; TTFT = client latency of a one-token completion. Each cell its own "
        "`cache_salt`; all cells in one run on one stack.",
        "",
    ]
    for name, s in result["substitution"].items():
        verdict = "met" if s["target_met"] else "**not met**"
        lines.append(f"**{name}**: round robin with the store reaches "
                     f"**{s['rr_store_over_kv_no_store']:.1%}** "
                     f"of kv routing's hit rate without it (target ≥ {TARGET:.0%}: {verdict}).")
        lines.append("")
    head = ("| workload | policy | store | completed | hit rate | pool | store tier | of kv/off | "
            "tokens computed | TTFT p50 | TTFT p99 | p50 vs kv/off |")
    lines += [head, "|" + "---|" * (head.count("|") - 1)]
    for r in result["rows"]:
        s = result["substitution"].get(r["workload"], {})
        key = f"{r['policy']}/{r['store']}"
        by = r["hit_rate_by_tier"]
        lines.append(
            f"| {r['workload']} | {r['policy']} | {r['store']} | {r['completed']}/{r['sent']} | "
            f"{r['hit_rate']:.3f} | {by.get('pool', 0):.3f} | {by.get('store', 0):.3f} | "
            f"{s.get('hit_over_kv_no_store', {}).get(key, float('nan')):.2f}× | {r['computed_tokens']:,} | "
            f"{r['ttft_p50_s'] * 1e3:.0f} ms | {r['ttft_p99_s'] * 1e3:.0f} ms | "
            f"{s.get('ttft_p50_over_kv_no_store', {}).get(key, float('nan')):.2f}× |")
    lines += ["", f"Whole run: {result['total_s'] / 60:.1f} min. The machine has 2 cores shared with other "
              "work: TTFTs move between runs, hit rates and tokens computed do not."]
    if result.get("notes"):
        lines += ["", f"**Note.** {result['notes']}"]
    loads = [r.get("load_average_1m") for r in result["rows"]]
    if all(v is not None for v in loads):
        lines += ["", "Load average (1 min) at each cell's end: " + ", ".join(
            f"{r['policy']}/{r['store']} {r['workload'].split()[0]} {r['load_average_1m']:.1f}"
            for r in result["rows"])]
    lines.append("")
    path.write_text("\n".join(lines))


def write_png(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r["workload"] for r in result["rows"]))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.18
    cells = [(p, s) for s in STORES for p in POLICIES]
    colors = {"pool": "#4c72b0", "store": "#dd8452"}
    for i, (p, s) in enumerate(cells):
        for j, name in enumerate(names):
            r = next((r for r in result["rows"]
                      if (r["workload"], r["policy"], r["store"]) == (name, p, s)), None)
            if r is None:
                continue
            x = j + (i - 1.5) * width
            bottom = 0.0
            for tier in ("pool", "store"):
                v = r["hit_rate_by_tier"].get(tier, 0.0)
                axes[0].bar(x, v, width, bottom=bottom, color=colors[tier])
                bottom += v
            axes[0].text(x, bottom + 0.01, f"{p.replace('round_robin', 'rr')}\n{s}", ha="center", fontsize=7)
            axes[1].bar(x, r["ttft_p50_s"] * 1e3, width, color="#55a868" if s == "on" else "#8c8c8c")
    for ax, title in zip(axes, ("hit rate by tier", "TTFT p50 (ms)"), strict=True):
        ax.set_xticks(range(len(names)), names)
        ax.set_title(title)
    axes[0].set_ylim(0, 1.1)
    from matplotlib.patches import Patch

    axes[0].legend(handles=[Patch(color=c, label=t) for t, c in colors.items()], loc="upper right")
    axes[1].legend(handles=[Patch(color="#8c8c8c", label="store off"),
                            Patch(color="#55a868", label="store on")], loc="upper left")
    fig.suptitle("{kv, round robin} × {store off, on}: 4 prefill workers, tiny model, Mooncake Store")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--capacity-tokens", type=int, default=2048,
                    help="each prefill worker's KV in tokens (default 2048)")
    ap.add_argument("--var-dir", type=Path, default=Path("var/bench/kv_store"))
    ap.add_argument("--from-json", type=Path, help="re-render the reports from an earlier run's JSON")
    args = ap.parse_args()
    result = (json.loads(args.from_json.read_text()) if args.from_json
              else run(args.seed, args.capacity_tokens, args.var_dir))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "kv_store.json").write_text(json.dumps(result, indent=2))
    write_markdown(result, args.out / "kv_store.md")
    write_png(result, args.out / "kv_store.png")


if __name__ == "__main__":
    main()
