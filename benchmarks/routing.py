"""KV-aware routing against round robin, least loaded and random, and the perfect-router ceiling.

    python benchmarks/routing.py [--out docs/benchmarks] [--seed 0] [--no-stack] [--from-json PATH]

Simulation: four prefill workers, each a model of a worker's prefix cache (`pdserve.routing.cache_model`:
LRU of full 16-token blocks with a capacity, emitting the KV events a worker publishes) behind the
router's real placement code (`pdserve.routing.router.Placer`: KV index, bookings, policies), in
virtual time (`pdserve.routing.simulate`). No model runs: hit rates depend on token ids and block hashes
only (`benchmarks/routing_workloads.py`: prefix repetition, multi-turn chat), hashed with the production
`hash_blocks`. Each policy runs on the same requests in one run; the same is repeated on four more
workload seeds to show the spread. Real stack (unless --no-stack): `benchmarks/routing_stack.py`, four
real prefill workers of the tiny model, hit rates read back from the event log. Also: router decision
latency with 100k indexed blocks. Writes routing.json, routing.md and routing.png under `--out`
(`benchmarks/routing_report.py`).
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
from pathlib import Path

from pdserve.config import RouterSettings
from pdserve.engine.block_hash import hash_blocks
from pdserve.messages import BlockStored, Heartbeat, KVEvents, Role, RouteRequest
from pdserve.routing.policy import POLICY_NAMES
from pdserve.routing.router import Placer
from pdserve.routing.simulate import SimConfig, SimRequest, ceiling_tokens, sim_descriptor, simulate

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.routing_report import write_markdown, write_png  # noqa: E402
from benchmarks.routing_workloads import Prompt, multi_turn_chat, prefix_repetition, random_tokens  # noqa: E402

BLOCK = 16
SEEDS_SPREAD = (1, 2, 3, 4)
ROUTER_KNOBS = (
    "overlap_score_weight",
    "active_prefill_weight",
    "balance_weight",
    "balance_window_requests",
    "balance_abs_threshold",
    "balance_rel_threshold",
    "temperature",
)


def sim_requests(prompts: list[Prompt]) -> list[SimRequest]:
    return [
        SimRequest(p.request_id, p.arrival_s, len(p.token_ids), tuple(hash_blocks(p.token_ids, BLOCK)))
        for p in prompts
    ]


def run_workload(
    name: str, requests: list[SimRequest], config: SimConfig, seed: int, quiet: bool = False
) -> dict:
    ceiling = ceiling_tokens(requests, config)
    rows = []
    for policy in POLICY_NAMES:
        settings = RouterSettings(policy=policy, seed=seed)
        summary = simulate(requests, settings, config, ceiling).summary(
            [f"prefill-{i}" for i in range(config.num_prefill_workers)]
        )
        rows.append(summary)
        if not quiet:
            print(
                f"{name:18} {policy:13} hit {summary['hit_rate']:.3f} ceiling "
                f"{summary['ceiling_hit_rate']:.3f} "
                f"({summary['of_ceiling']:.1%}; pooled {summary['of_pooled_ceiling']:.1%}) max/min active "
                f"{summary['max_min_active_requests']:.2f} requests {summary['max_min_requests']:.2f}",
                flush=True,
            )
    return {
        "workload": name,
        "requests": len(requests),
        "prompt_tokens": sum(r.num_prompt_tokens for r in requests),
        "policies": rows,
    }


def decision_latency(
    num_blocks: int = 100_000,
    num_workers: int = 4,
    prompt_tokens: int = 1024,
    decisions: int = 5000,
    seed: int = 0,
) -> dict:
    """Seconds per `Placer.route` (hash the prompt, look up the index, score, book) with `num_blocks`
    distinct blocks indexed over `num_workers` prefill workers; the prompt's first half is cached on
    prefill-0 (which the balance term stops from taking every request)."""
    rng = random.Random(seed)
    desc = sim_descriptor(BLOCK)
    placer = Placer(RouterSettings(policy="kv", heartbeat_timeout_s=3600, kv_index_ttl_s=3600))
    for i in range(num_workers):
        placer.observe_heartbeat(
            Heartbeat(
                worker_id=f"prefill-{i}",
                role=Role.PREFILL,
                descriptor=desc,
                num_running=0,
                num_waiting=0,
                kv_capacity_tokens=1,
                kv_free_tokens=1,
                ts=time.time(),
            )
        )
    placer.observe_heartbeat(
        Heartbeat(
            worker_id="decode-0",
            role=Role.DECODE,
            descriptor=desc,
            num_running=0,
            num_waiting=0,
            kv_capacity_tokens=1,
            kv_free_tokens=1,
            ts=time.time(),
        )
    )
    shared = random_tokens(rng, prompt_tokens // 2)
    per_worker = num_blocks // num_workers
    for i in range(num_workers):
        hashes = hash_blocks(shared, BLOCK) if i == 0 else []
        while len(hashes) < per_worker:
            hashes += hash_blocks(random_tokens(rng, 64 * BLOCK), BLOCK)
        placer.observe_kv_events(
            KVEvents(
                worker_id=f"prefill-{i}",
                seq=0,
                ts=time.time(),
                events=(BlockStored(block_hashes=tuple(hashes[:per_worker])),),
            )
        )
    indexed = placer.index.num_blocks()
    prompts = [shared + random_tokens(rng, prompt_tokens - len(shared)) for _ in range(64)]
    wall, cpu = [], []
    for k in range(decisions):
        req = RouteRequest(
            request_id=f"r{k}", num_prompt_tokens=prompt_tokens, prompt_token_ids=tuple(prompts[k % 64])
        )
        t0, c0 = time.perf_counter(), time.thread_time()
        d = placer.route(req)
        cpu.append(time.thread_time() - c0)
        wall.append(time.perf_counter() - t0)
        placer.release(req.request_id)
        assert d.best_cached_tokens == len(shared)  # the index found the cached half on prefill-0
    qw, qc = statistics.quantiles(wall, n=100), statistics.quantiles(cpu, n=100)
    # Wall time includes being preempted on a shared machine; thread CPU time is the router's own work.
    return {
        "indexed_blocks": indexed,
        "workers": num_workers,
        "prompt_tokens": prompt_tokens,
        "decisions": decisions,
        "p50_ms": qw[49] * 1e3,
        "p99_ms": qw[98] * 1e3,
        "max_ms": max(wall) * 1e3,
        "cpu_p50_ms": qc[49] * 1e3,
        "cpu_p99_ms": qc[98] * 1e3,
        "load_average_1m": os.getloadavg()[0],
        "cpus": os.cpu_count(),
    }


WORKLOADS = (
    ("prefix repetition", prefix_repetition, SimConfig(capacity_blocks=128)),
    ("multi-turn chat", multi_turn_chat, SimConfig(capacity_blocks=512)),
)


def simulate_all(seed: int, quiet: bool = False) -> list[dict]:
    """Every workload × policy on workload seed `seed` (one rng for both workloads, in order)."""
    rng = random.Random(seed)
    return [
        run_workload(name, sim_requests(make(rng)), config, seed, quiet) for name, make, config in WORKLOADS
    ]


def spread(seeds: tuple[int, ...]) -> list[dict]:
    """The kv policy's figures on other workload seeds: per workload, per seed."""
    out = []
    for seed in seeds:
        for w in simulate_all(seed, quiet=True):
            kv = w["policies"][0]
            out.append(
                {
                    "seed": seed,
                    "workload": w["workload"],
                    **{
                        k: kv[k]
                        for k in (
                            "of_ceiling",
                            "of_pooled_ceiling",
                            "max_min_active_requests",
                            "max_min_requests",
                        )
                    },
                }
            )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-stack", action="store_true", help="skip the real-stack check")
    ap.add_argument("--stack-only", action="store_true", help="rerun only the real-stack check")
    ap.add_argument("--from-json", type=Path, help="re-render the reports from an earlier run's JSON")
    args = ap.parse_args()
    if args.from_json:
        result = json.loads(args.from_json.read_text())
    else:
        prev = args.out / "routing.json"
        result = json.loads(prev.read_text()) if args.stack_only else {}
        if not args.stack_only:
            result = {
                "machine": f"{platform.machine()}, {os.cpu_count()} cores, "
                f"Python {platform.python_version()}",
                "date": time.strftime("%Y-%m-%d"),
                "seed": args.seed,
                "config": {name: config.__dict__ for name, _, config in WORKLOADS},
                "router_settings": {k: getattr(RouterSettings(), k) for k in ROUTER_KNOBS},
                "workloads": simulate_all(args.seed),
                "spread": spread(SEEDS_SPREAD),
            }
            result["decision_latency"] = decision_latency(seed=args.seed)
            lat = result["decision_latency"]
            print(
                f"decision latency, {lat['indexed_blocks']} blocks: wall p50 {lat['p50_ms']:.3f} ms "
                f"p99 {lat['p99_ms']:.3f} ms, CPU p50 {lat['cpu_p50_ms']:.3f} ms p99 "
                f"{lat['cpu_p99_ms']:.3f} ms "
                f"(load {lat['load_average_1m']:.1f})"
            )
        if not args.no_stack:
            from benchmarks.routing_stack import run_stack_check

            result["stack"] = run_stack_check(list(POLICY_NAMES), seed=args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "routing.json").write_text(json.dumps(result, indent=2))
    write_markdown(result, args.out / "routing.md")
    write_png(result, args.out / "routing.png")


if __name__ == "__main__":
    main()
