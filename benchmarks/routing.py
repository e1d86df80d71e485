"""KV-aware routing against round robin, least loaded and random, and the perfect-router ceiling.

    python benchmarks/routing.py [--out docs/benchmarks] [--seed 0]

Four prefill workers, each a model of a worker's prefix cache (`pdserve.routing.cache_model`: LRU of
full 16-token blocks with a capacity, emitting the KV events a worker publishes) behind the router's real
placement code (`pdserve.routing.placement.Placer`: KV index, bookings, policies), in virtual time
(`pdserve.routing.simulate`). No model runs: hit rates depend on token ids and block hashes only, so
prompts are random token ids from SmolLM2's 49,152-token vocabulary, hashed with the production
`hash_blocks`. The paged engine is not in this run.

Workloads:
- prefix repetition, vLLM's `prefix_repetition` dataset (benchmarks/datasets: `--prefix-repetition-
  prefix-len 256 --prefix-repetition-suffix-len 256 --prefix-repetition-num-prefixes 10`): each prompt is
  one of 10 random 256-token prefixes (chosen uniformly) + a random 256-token suffix; Poisson arrivals.
- multi-turn chat: conversations sharing one system prompt; each turn's prompt is the whole history
  (system, earlier user and assistant messages) + a new user message; conversations overlap in time.

Each policy runs on the same requests in one run; the ceiling is one LRU cache of all four workers'
capacity together (a perfect router). Also: router decision latency with 100k indexed blocks.
Writes routing.json, routing.md and routing.png under `--out`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import time
from pathlib import Path

from pdserve.config import RouterSettings
from pdserve.engine.block_hash import hash_blocks
from pdserve.messages import BlockStored, Heartbeat, KVEvents, Role, RouteRequest
from pdserve.routing.placement import Placer
from pdserve.routing.policy import POLICY_NAMES
from pdserve.routing.simulate import SimConfig, SimRequest, ceiling_tokens, sim_descriptor, simulate

VOCAB = 49152
BLOCK = 16


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


def _request(rid: str, t: float, tokens: list[int]) -> SimRequest:
    return SimRequest(rid, t, len(tokens), tuple(hash_blocks(tokens, BLOCK)))


def prefix_repetition(
    rng: random.Random,
    num_prompts: int = 600,
    rate_per_s: float = 12.0,
    prefix_len: int = 256,
    suffix_len: int = 256,
    num_prefixes: int = 10,
) -> list[SimRequest]:
    """vLLM's prefix-repetition workload with Poisson arrivals at `rate_per_s`."""
    prefixes = [_tokens(rng, prefix_len) for _ in range(num_prefixes)]
    out, t = [], 0.0
    for i in range(num_prompts):
        t += rng.expovariate(rate_per_s)
        out.append(_request(f"pr-{i}", t, rng.choice(prefixes) + _tokens(rng, suffix_len)))
    return out


def multi_turn_chat(
    rng: random.Random,
    num_conversations: int = 48,
    turns: int = 6,
    system_len: int = 128,
    start_spread_s: float = 30.0,
    think_s: float = 4.0,
) -> list[SimRequest]:
    """Conversations starting uniformly over `start_spread_s`, one turn every ~`think_s` seconds; user
    messages 32–160 tokens, assistant replies 64–256 tokens, one shared system prompt."""
    system = _tokens(rng, system_len)
    out = []
    for c in range(num_conversations):
        history, t = list(system), rng.uniform(0, start_spread_s)
        for k in range(turns):
            history += _tokens(rng, rng.randint(32, 160))
            out.append(_request(f"chat-{c}-{k}", t, list(history)))
            history += _tokens(rng, rng.randint(64, 256))
            t += rng.expovariate(1 / think_s) + 0.5
    return sorted(out, key=lambda r: r.arrival_s)


def run_workload(name: str, requests: list[SimRequest], config: SimConfig, seed: int) -> dict:
    ceiling = ceiling_tokens(requests, config)
    rows = []
    for policy in POLICY_NAMES:
        settings = RouterSettings(policy=policy, seed=seed)
        summary = simulate(requests, settings, config, ceiling).summary(
            [f"prefill-{i}" for i in range(config.num_prefill_workers)]
        )
        rows.append(summary)
        print(
            f"{name:18} {policy:13} hit {summary['hit_rate']:.3f} ceiling {summary['ceiling_hit_rate']:.3f} "
            f"({summary['of_ceiling']:.1%}) max/min req {summary['max_min_requests']:.2f} "
            f"p50 {summary['prefill_latency_p50_s'] * 1e3:.0f} ms",
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
    distinct blocks indexed over `num_workers` prefill workers; the prompt's first half is cached."""
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
    shared = _tokens(rng, prompt_tokens // 2)
    per_worker = num_blocks // num_workers
    for i in range(num_workers):
        hashes = hash_blocks(shared, BLOCK) if i == 0 else []
        while len(hashes) < per_worker:
            hashes += hash_blocks(_tokens(rng, 64 * BLOCK), BLOCK)
        placer.observe_kv_events(
            KVEvents(
                worker_id=f"prefill-{i}",
                seq=0,
                ts=time.time(),
                events=(BlockStored(block_hashes=tuple(hashes[:per_worker])),),
            )
        )
    indexed = placer.index.num_blocks()
    prompts = [shared + _tokens(rng, prompt_tokens - len(shared)) for _ in range(64)]
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
        assert d.prefill_worker_id == "prefill-0" and d.predicted_cached_tokens == len(shared)
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


def write_markdown(result: dict, path: Path) -> None:
    lines = [
        "# KV-aware routing: hit rate against the perfect-router ceiling",
        "",
        f"`python benchmarks/routing.py` — {result['machine']}, {result['date']}. "
        "Simulated prefix caches (LRU, "
        f"{result['config']['capacity_blocks']} blocks × {result['config']['block_size']} tokens per worker) "
        "behind the router's real index and policies; random token ids (SmolLM2 vocabulary), no model run "
        "(hit rate does not depend on the model). The paged engine is not in this run: the cache "
        "model emits the same KV events as its BlockManager.",
        "",
        "Hit rate = cached prompt tokens / prompt tokens. Ceiling = one LRU cache of all 4 workers' capacity "
        "(a perfect router). Per-decision ceiling = the most cached tokens any worker held at each decision "
        "(what `RequestRouted.best_cached_tokens` records). Load = requests per prefill worker, max/min.",
        "",
    ]
    for w in result["workloads"]:
        lines += [
            f"## {w['workload']} ({w['requests']} requests, {w['prompt_tokens']} prompt tokens)",
            "",
            "| policy | hit rate | ceiling | of ceiling | per-decision ceiling | prediction exact | "
            "max/min requests | max/min computed tokens | prefill latency p50 / p90 |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for p in w["policies"]:
            lines.append(
                f"| {p['policy']} | {p['hit_rate']:.3f} | {p['ceiling_hit_rate']:.3f} | "
                f"{p['of_ceiling']:.1%} | "
                f"{p['decision_ceiling_hit_rate']:.3f} | {p['prediction_exact']:.1%} | "
                f"{p['max_min_requests']:.2f} | "
                f"{p['max_min_computed_tokens']:.2f} | {p['prefill_latency_p50_s'] * 1e3:.0f} / "
                f"{p['prefill_latency_p90_s'] * 1e3:.0f} ms |"
            )
        lines.append("")
    kv = {w["workload"]: w["policies"][0] for w in result["workloads"]}
    rr = {w["workload"]: w["policies"][1] for w in result["workloads"]}
    lines += ["## Against the targets", ""]
    for name, p in kv.items():
        lines.append(
            f"- {name}: kv reaches {p['of_ceiling']:.1%} of the ceiling (target ≥ 95%) with max/min requests "
            f"{p['max_min_requests']:.2f} (target ≤ 1.5); round robin {rr[name]['hit_rate']:.3f} against "
            f"ceiling/N = {rr[name]['ceiling_hit_rate'] / 4:.3f}."
        )
    lines += [
        "",
        "Why kv stops short of the ceiling: Dynamo's cost weights queued prefill blocks exactly like "
        "uncached ones, so a worker whose queue holds more uncached blocks than the hit saves loses the "
        "request to an idle, cold worker: a TTFT-neutral trade that costs hit rate (and duplicates the "
        "prefix). In the chat workload conversations stick to the worker holding their history; load "
        "only moves them once a queue outweighs the whole history, so request counts per worker stay "
        "uneven (computed tokens are more even). Round robin sits above ceiling/N because each worker "
        "still sees every prefix now and then and its LRU keeps the recent ones.",
        "",
    ]
    lat = result["decision_latency"]
    lines += [
        "## Router decision latency",
        "",
        f"`Placer.route` with {lat['indexed_blocks']:,} blocks indexed over {lat['workers']} "
        "prefill workers, "
        f"{lat['prompt_tokens']}-token prompts (hashing included), {lat['decisions']} decisions: "
        f"wall p50 {lat['p50_ms']:.3f} ms, p99 {lat['p99_ms']:.3f} ms, max {lat['max_ms']:.3f} ms; "
        f"thread CPU time p50 {lat['cpu_p50_ms']:.3f} ms, p99 {lat['cpu_p99_ms']:.3f} ms. Wall time counts "
        f"preemption: the run shared {lat['cpus']} cores at load average {lat['load_average_1m']:.1f}.",
        "",
    ]
    path.write_text("\n".join(lines))


def write_png(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(result["workloads"]), figsize=(6 * len(result["workloads"]), 4))
    for ax, w in zip(axes, result["workloads"], strict=True):
        names = [p["policy"] for p in w["policies"]]
        ax.bar(names, [p["hit_rate"] for p in w["policies"]], color="tab:blue", label="hit rate")
        ax.axhline(
            w["policies"][0]["ceiling_hit_rate"], color="tab:red", ls="--", label="ceiling (perfect router)"
        )
        for i, p in enumerate(w["policies"]):
            ax.text(
                i,
                p["hit_rate"],
                f"{p['of_ceiling']:.0%}\nmax/min {p['max_min_requests']:.2f}",
                ha="center",
                va="bottom",
                fontsize=8,
            )
        ax.set_title(w["workload"])
        ax.set_ylabel("prefix cache hit rate (tokens)")
        ax.set_ylim(0, 1)
        ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    prefix_config = SimConfig(capacity_blocks=128)
    chat_config = SimConfig(capacity_blocks=512)
    result = {
        "machine": f"{platform.processor() or platform.machine()}, Python {platform.python_version()}",
        "date": time.strftime("%Y-%m-%d"),
        "config": {
            "prefix_repetition": prefix_config.__dict__,
            "multi_turn_chat": chat_config.__dict__,
            "capacity_blocks": prefix_config.capacity_blocks,
            "block_size": BLOCK,
        },
        "workloads": [
            run_workload("prefix repetition", prefix_repetition(rng), prefix_config, args.seed),
            run_workload("multi-turn chat", multi_turn_chat(rng), chat_config, args.seed),
        ],
    }
    result["decision_latency"] = decision_latency(seed=args.seed)
    lat = result["decision_latency"]
    print(
        f"decision latency, {lat['indexed_blocks']} blocks: wall p50 {lat['p50_ms']:.3f} ms "
        f"p99 {lat['p99_ms']:.3f} ms,"
        f" CPU p50 {lat['cpu_p50_ms']:.3f} ms p99 {lat['cpu_p99_ms']:.3f} ms "
        f"(load {lat['load_average_1m']:.1f})"
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "routing.json").write_text(json.dumps(result, indent=2))
    write_markdown(result, args.out / "routing.md")
    write_png(result, args.out / "routing.png")


if __name__ == "__main__":
    main()
