"""The offload tier on a real stack: a shared-prefix workload whose working set is ~4x one worker's pool,
served with the offload tier off and on, in the same run.

    python benchmarks/kv_tiers.py [--model smollm2] [--prefixes 16] [--prefix-len 128] [--suffix-len 16]
                                  [--pool-blocks 32] [--offload-blocks 256] [--requests 64]
                                  [--out docs/benchmarks]

One colocated stack of real processes (tests/e2e/stack.py: recorder, router, coordinator, two unified
workers, gateway) on the machine's NATS and Postgres (`PDS_TEST_NATS_URL`, `PDS_TEST_DATABASE_URL`), with a
database, stream and subject prefix of its own. Both workers have a paged pool of `--pool-blocks` blocks;
`unified-1` alone has an offload tier of `--offload-blocks` (`PDS_KV_OFFLOAD_BLOCKS`), `unified-0` none.
The router runs `round_robin`, and every prompt is sent twice in a row, one request after the other: each
worker serves the same prompts in the same order, a pair of requests moments apart (interleaved rounds;
which worker served which request is read from its `RequestRouted` event, not assumed).

Workload: `--prefixes` shared prefixes of `--prefix-len` tokens (random ids), each request one of them
chosen uniformly at random plus a fresh suffix of `--suffix-len` tokens, two-token greedy
completions. Working set = prefixes x prefix blocks = 4x the pool at the defaults (16 x 8 = 128 blocks
against 32): the pool alone keeps about three prefixes, so most prefixes are evicted before they come
back; the offload tier keeps them all.

Per worker, from the event log (`PrefillCompleted`, `RequestCompleted.ttft`): hit rate = cached prompt
tokens / prompt tokens, split by tier (`cached_tokens_by_tier`); prefill tokens computed; TTFT p50/p99
(the coordinator's `ttft_s`: gateway receive -> first token), over all requests and over the steady state
(after the first `--prefixes` pairs). Each pair's completions must be the same text (greedy output is
unchanged by the tier). Beside it, measured in this process on the same block shape: the offload tier's
copy-back cost per token (get_into + scatter into the pool's layers) against the prefill cost per token the
off worker measured (`prefill_s / num_computed_tokens`): the ratio the router's tier weight is made of
(`routing/policy.py` `tier_weights`). Writes kv_tiers.json, .md and .png under `--out`.
"""

from __future__ import annotations

import argparse
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
import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdserve.config import CommonSettings  # noqa: E402
from pdserve.engine.kv_tiers.host_tier import HostOffloadTier  # noqa: E402
from pdserve.engine.kv_tiers.tier_set import KVTierSet  # noqa: E402
from pdserve.engine.loader import load_model  # noqa: E402
from pdserve.service_plan import ServiceSpec  # noqa: E402
from pdserve.store.migrate import create_database, drop_database, upgrade  # noqa: E402
from tests.e2e.stack import Stack  # noqa: E402

BLOCK_SIZE = 16
OFF, ON = "unified-0", "unified-1"
LABEL = {OFF: "offload off", ON: "offload on"}


class TierStack(Stack):
    """Colocated, two unified workers with `pool_blocks` each; `unified-1` with an offload tier."""

    def __init__(self, *args, pool_blocks: int, offload_blocks: int, **kw) -> None:
        super().__init__(*args, **kw)
        self.pool_blocks, self.offload_blocks = pool_blocks, offload_blocks

    def env(self, spec: ServiceSpec) -> dict[str, str]:
        env = super().env(spec)
        env["PDS_POLICY"] = "round_robin"
        if spec.is_worker:
            env["PDS_KV_CAPACITY_TOKENS"] = str(self.pool_blocks * BLOCK_SIZE)
            env["PDS_KV_OFFLOAD_BLOCKS"] = str(self.offload_blocks if spec.name == ON else 0)
        return env


def events_of(url: str, request_id: str, timeout_s: float = 60.0) -> dict[str, dict]:
    """Payload by event type of a request, once its completion is recorded."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        r = httpx.get(f"{url}/v1/requests/{request_id}")
        if r.status_code == 200:
            got = {e["type"]: e["payload"] for e in r.json()["events"]}
            if "RequestCompleted" in got and "PrefillCompleted" in got:
                return got
        time.sleep(0.2)
    raise TimeoutError(f"{request_id}: completion not recorded in {timeout_s} s")


def workload(rng: random.Random, n_prefixes: int, prefix_len: int, suffix_len: int,
             n_requests: int) -> list[tuple[int, list[int]]]:
    """(prefix index, prompt token ids) per request: a uniformly chosen shared prefix + a fresh suffix."""
    prefixes = [[rng.randrange(1000, 40000) for _ in range(prefix_len)] for _ in range(n_prefixes)]
    out = []
    for _ in range(n_requests):
        k = rng.randrange(n_prefixes)
        out.append((k, prefixes[k] + [rng.randrange(1000, 40000) for _ in range(suffix_len)]))
    return out


def run_pairs(stack: Stack, prompts: list[tuple[int, list[int]]]) -> list[dict]:
    """Each prompt twice, one request after the other (round robin puts one on each worker)."""
    rows = []
    with httpx.Client(timeout=300) as client:
        for i, (prefix, ids) in enumerate(tqdm(prompts, desc="pairs")):
            pair = []
            for _ in range(2):
                r = client.post(f"{stack.url}/v1/completions", json={
                    "model": stack.served_model, "prompt": ids, "max_tokens": 2, "temperature": 0,
                    "ignore_eos": True})
                r.raise_for_status()
                pair.append((r.headers["x-request-id"], r.json()["choices"][0]["text"]))
            for rid, text in pair:
                ev = events_of(stack.url, rid)
                done = ev["PrefillCompleted"]
                rows.append({
                    "pair": i, "prefix": prefix, "request_id": rid, "text": text,
                    "worker": ev["RequestRouted"]["prefill_worker_id"], "prompt_tokens": len(ids),
                    "cached_tokens": done["num_cached_tokens"],
                    "cached_tokens_by_tier": done.get("cached_tokens_by_tier", {}),
                    "computed_tokens": done["num_computed_tokens"], "prefill_s": done["prefill_s"],
                    "ttft_s": ev["RequestCompleted"]["ttft"]["ttft_s"],
                })
    return rows


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))] if xs else float("nan")


def pool_first(item: tuple[str, int]) -> tuple[bool, str]:
    return item[0] != "pool", item[0]


def summarize(rows: list[dict], warm_after_pair: int) -> dict:
    out = {}
    for worker in (OFF, ON):
        for phase, keep in (("all", lambda r: True), ("steady", lambda r: r["pair"] >= warm_after_pair)):
            rs = [r for r in rows if r["worker"] == worker and keep(r)]
            prompt = sum(r["prompt_tokens"] for r in rs)
            tiers: dict[str, int] = {}
            for r in rs:
                for t, n in r["cached_tokens_by_tier"].items():
                    tiers[t] = tiers.get(t, 0) + n
            ttft = [r["ttft_s"] for r in rs]
            out[f"{worker}/{phase}"] = {
                "worker": worker, "label": LABEL[worker], "phase": phase, "requests": len(rs),
                "prompt_tokens": prompt, "cached_tokens": sum(r["cached_tokens"] for r in rs),
                "hit_rate": sum(r["cached_tokens"] for r in rs) / prompt if prompt else 0.0,
                "hit_rate_by_tier": {t: n / prompt for t, n in sorted(tiers.items(), key=pool_first)}
                if prompt else {},
                "computed_tokens": sum(r["computed_tokens"] for r in rs),
                "ttft_p50_s": pct(ttft, 0.5), "ttft_p99_s": pct(ttft, 0.99),
                "ttft_mean_s": statistics.fmean(ttft),
            }
    return out


def copy_cost(model: str, var_dir: Path, reps: int = 200) -> dict:
    """Seconds per token to copy one block back from the offload tier into a pool of the model's shape
    (get_into, checksum, scatter into each paged layer), and to snapshot one out of it."""
    config = load_model(model, var_dir / "weights").config
    row = (2, config.num_kv_heads, config.head_dim)
    pool = [torch.randn(8, BLOCK_SIZE, *row) for _ in range(config.num_layers)]
    tier = HostOffloadTier(4)
    tiers = KVTierSet([tier], pool, background=False)
    tiers.write_down([(1, 0)])
    t0 = time.perf_counter()
    for _ in range(reps):
        tiers.read_block(0)
    snapshot_s = (time.perf_counter() - t0) / reps
    t0 = time.perf_counter()
    for _ in range(reps):
        assert tiers.load([1], [3]) == ["offload"]
    load_s = (time.perf_counter() - t0) / reps
    return {"block_bytes": config.num_layers * BLOCK_SIZE * 2 * config.num_kv_heads * config.head_dim * 4,
            "load_s_per_block": load_s, "load_s_per_token": load_s / BLOCK_SIZE,
            "snapshot_s_per_block": snapshot_s}


def write_reports(result: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "kv_tiers.json").write_text(json.dumps(result, indent=2))
    meta, s = result["meta"], result["summary"]
    ms = lambda x: f"{x * 1e3:.0f}"  # noqa: E731
    tiers = lambda d: " · ".join(f"{t} {v:.1%}" for t, v in d.items()) or "—"  # noqa: E731
    off, on = s[f"{OFF}/steady"], s[f"{ON}/steady"]
    cost = result["copy_cost"]
    lines = [
        "# KV tiers: the offload tier off and on",
        "",
        f"Generated by `python benchmarks/kv_tiers.py --requests {meta['requests']}` on {meta['when']} "
        f"({meta['machine']}), model {meta['model']}, one colocated stack with two unified workers, each a "
        f"paged pool of {meta['pool_blocks']} blocks × {BLOCK_SIZE} tokens; `unified-1` also an offload "
        f"tier of {meta['offload_blocks']} blocks (host memory, LRU, xxh3 per block). Workload: "
        f"{meta['prefixes']} shared prefixes of {meta['prefix_len']} tokens, each request one of them "
        f"(uniform) + a fresh {meta['suffix_len']}-token suffix, two greedy tokens; working set "
        f"{meta['working_set_blocks']} blocks = {meta['working_set_blocks'] / meta['pool_blocks']:.1f}× one "
        f"pool. Every prompt is sent twice in a row and round robin puts one copy on each worker, so the two "
        f"columns are paired in time. Steady state = after the first {meta['prefixes']} pairs. "
        f"Load average (1 min) {meta['load_avg_1min'][0]:.2f} before, {meta['load_avg_1min'][1]:.2f} after "
        "(shared 2-core machine: TTFTs swing).",
        "",
        f"Greedy output: {result['identical_pairs']}/{meta['requests']} pairs identical text.",
        "",
        "| worker | phase | requests | hit rate | by tier | prefill tokens computed | TTFT p50 ms "
        "| TTFT p99 ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for key in (f"{OFF}/all", f"{ON}/all", f"{OFF}/steady", f"{ON}/steady"):
        r = s[key]
        lines.append(f"| {r['label']} | {r['phase']} | {r['requests']} | {r['hit_rate']:.1%} | "
                     f"{tiers(r['hit_rate_by_tier'])} | {r['computed_tokens']} | {ms(r['ttft_p50_s'])} | "
                     f"{ms(r['ttft_p99_s'])} |")
    lines += [
        "",
        "Steady state, on / off: prefill tokens computed "
        f"{on['computed_tokens'] / off['computed_tokens']:.2f}×, TTFT p50 "
        f"{on['ttft_p50_s'] / off['ttft_p50_s']:.2f}×, p99 {on['ttft_p99_s'] / off['ttft_p99_s']:.2f}×; "
        f"hit rate {off['hit_rate']:.1%} → {on['hit_rate']:.1%}.",
        "",
        f"Copy cost (this process, {meta['model']}'s block: {cost['block_bytes'] / 2**10:.0f} KiB): "
        "copying a block back from the offload tier (get_into with its checksum, scatter into the pool's "
        "layers) "
        f"{cost['load_s_per_block'] * 1e3:.2f} ms = {cost['load_s_per_token'] * 1e6:.0f} µs/token; "
        f"writing one down (the snapshot the engine takes before the block is reused) "
        f"{cost['snapshot_s_per_block'] * 1e3:.2f} ms. Prefill measured on the off worker: "
        f"{result['prefill_s_per_token'] * 1e3:.2f} ms/token (median prefill_s / computed tokens). "
        f"The router's weight of an offload block, 1 − copy / prefill = {result['offload_weight']:.3f} "
        "(`PDS_OFFLOAD_COPY_S_PER_TOKEN`, `PDS_PREFILL_S_PER_TOKEN`). On this CPU machine pool and tier are "
        "both host memory, so the tier buys capacity (recompute saved), not bandwidth.",
    ]
    (out / "kv_tiers.md").write_text("\n".join(lines) + "\n")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    rows = result["rows"]
    for worker, color in ((OFF, "tab:gray"), (ON, "tab:blue")):
        rs = [r for r in rows if r["worker"] == worker]
        a.plot([r["pair"] for r in rs], [r["ttft_s"] * 1e3 for r in rs], ".", color=color,
               label=LABEL[worker])
        cum_p = cum_c = 0
        xs, ys = [], []
        for r in rs:
            cum_p += r["prompt_tokens"]
            cum_c += r["cached_tokens"]
            xs.append(r["pair"])
            ys.append(cum_c / cum_p)
        b.plot(xs, ys, color=color, label=LABEL[worker])
    a.set_xlabel("request pair")
    a.set_ylabel("TTFT (ms)")
    a.set_title("TTFT per request")
    a.legend()
    b.set_xlabel("request pair")
    b.set_ylabel("cumulative hit rate")
    b.set_ylim(0, 1)
    b.set_title(f"Hit rate, working set {meta['working_set_blocks'] / meta['pool_blocks']:.0f}× the pool")
    b.legend()
    fig.suptitle(f"Offload tier off vs on, {meta['model']}")
    fig.tight_layout()
    fig.savefig(out / "kv_tiers.png", dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--prefixes", type=int, default=16)
    ap.add_argument("--prefix-len", type=int, default=128)
    ap.add_argument("--suffix-len", type=int, default=16)
    ap.add_argument("--pool-blocks", type=int, default=32)
    ap.add_argument("--offload-blocks", type=int, default=256)
    ap.add_argument("--requests", type=int, default=64, help="prompts; each is sent twice (one per worker)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    ap.add_argument("--var-dir", type=Path, default=Path("var/bench/kv_tiers"))
    ap.add_argument("--from-json", type=Path, help="re-render the reports from an earlier run's JSON")
    args = ap.parse_args()
    if args.from_json:
        saved = json.loads(args.from_json.read_text())
        saved["summary"] = summarize(saved["rows"], saved["meta"]["prefixes"])
        write_reports(saved, args.out)
        print((args.out / "kv_tiers.md").read_text())
        return
    admin_url = os.environ.get("PDS_TEST_DATABASE_URL", "postgresql+asyncpg://postgres@127.0.0.1:5432/postgres")
    tag = f"kt{uuid.uuid4().hex[:8]}"
    db = f"pdserve_bench_{tag}"
    settings = CommonSettings(
        nats_url=os.environ.get("PDS_TEST_NATS_URL", "nats://127.0.0.1:4222"), var_dir=Path("var").resolve(),
        database_url=create_database(admin_url, db), subject_prefix=tag, events_stream=f"PDS_EVENTS_{tag}")
    upgrade(settings.database_url)
    var_dir = args.var_dir.resolve()
    stack = TierStack(settings, var_dir, model=args.model, mode="colocated", n_prefill=2, n_decode=0,
                      pool_blocks=args.pool_blocks, offload_blocks=args.offload_blocks)
    prompts = workload(random.Random(args.seed), args.prefixes, args.prefix_len, args.suffix_len,
                       args.requests)
    load_before = os.getloadavg()[0]
    try:
        stack.start(timeout_s=300)
        rows = run_pairs(stack, prompts)
    finally:
        stack.stop()
        drop_database(admin_url, db)
    load_after = os.getloadavg()[0]
    by_pair: dict[int, dict[str, str]] = {}
    for r in rows:
        by_pair.setdefault(r["pair"], {})[r["worker"]] = r["text"]
    split = sum(set(p) == {OFF, ON} for p in by_pair.values())
    identical = sum(set(p) == {OFF, ON} and p[OFF] == p[ON] for p in by_pair.values())
    off_rows = [r for r in rows if r["worker"] == OFF and r["computed_tokens"] > 0]
    prefill_per_token = statistics.median(r["prefill_s"] / r["computed_tokens"] for r in off_rows)
    cost = copy_cost(args.model, var_dir)
    result = {
        "meta": {
            "when": datetime.now(UTC).strftime("%Y-%m-%d %H:%M"), "machine": f"{platform.machine()}, "
            f"{os.cpu_count()} cores", "model": args.model, "prefixes": args.prefixes,
            "prefix_len": args.prefix_len, "suffix_len": args.suffix_len, "pool_blocks": args.pool_blocks,
            "offload_blocks": args.offload_blocks, "requests": args.requests,
            "working_set_blocks": args.prefixes * args.prefix_len // BLOCK_SIZE,
            "load_avg_1min": [load_before, load_after], "pairs_split_over_both_workers": split,
        },
        "summary": summarize(rows, args.prefixes),
        "identical_pairs": identical,
        "copy_cost": cost,
        "prefill_s_per_token": prefill_per_token,
        "offload_weight": max(0.0, 1 - cost["load_s_per_token"] / prefill_per_token),
        "rows": rows,
    }
    write_reports(result, args.out)
    print((args.out / "kv_tiers.md").read_text())


if __name__ == "__main__":
    main()
