"""`pdserve sim`: simulate a deployment in virtual time (libs/pdserve/sim/).

    pdserve sim --profile var/profile.json --mode both --replicas 2 --prefill 1 --decode 1 \
        --input-len 120 --output-len 12 --num-prompts 200 --request-rate 1 --goodput ttft:2000 tpot:200
    pdserve sim --hardware h100-sxm-tp8-llama-3-70b-bf16 --mode disaggregated --prefill 64 --decode 64 \
        --link 'InfiniBand NDR' --input-len 2000 --output-len 200 --num-prompts 100000 --request-rate 400 \
        --max-num-seqs 256 --max-num-batched-tokens 8192 --no-prefix-caching
    pdserve sim ... --search rate            # DistServe's goodput: the highest rate at --attainment
    pdserve sim ... --search split --max-replicas 8   # the fewest replicas holding --request-rate

Workloads: the bench datasets (`--dataset`, `--input-len`, … as `pdserve bench serve`), or the requests
of a served stack's event log (`--replay`: arrival times, lengths and prompt block hashes as recorded).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from pdserve.bench.datasets import DATASETS
from pdserve.bench.metrics import parse_goodput
from pdserve.cli.output import make_console

console = make_console(soft_wrap=True)


def _pool(args: argparse.Namespace, role, replicas: int, hardware, prefix: str):
    from pdserve.sim.config import PoolConfig

    def pick(name: str):
        v = getattr(args, f"{prefix}_{name}", None)
        return v if v is not None else getattr(args, name)

    return PoolConfig(
        role=role,
        replicas=replicas,
        max_num_seqs=pick("max_num_seqs"),
        max_num_batched_tokens=pick("max_num_batched_tokens"),
        kv_capacity_tokens=pick("kv_capacity_tokens"),
        hardware=hardware,
    )


def build_cluster(args: argparse.Namespace, profile, mode: str, prefill: int, decode: int):
    """The `ClusterConfig` the flags describe for `mode` with `prefill` (colocated: unified) and `decode`
    replicas."""
    from pdserve.sim.config import ClusterConfig, Overheads, PoolRole
    from pdserve.sim.hardware import resolve_hardware

    hw_p = resolve_hardware(profile, args.prefill_hardware or args.hardware)
    hw_d = resolve_hardware(profile, args.decode_hardware or args.hardware)
    overheads = Overheads(
        request_s=args.request_overhead_ms / 1e3,
        first_token_s=args.first_token_overhead_ms / 1e3,
        decode_start_s=args.decode_start_ms / 1e3,
    )
    common = dict(policy=args.policy, prefix_caching=not args.no_prefix_caching, overheads=overheads)
    if mode == "colocated":
        return ClusterConfig(pools=[_pool(args, PoolRole.UNIFIED, prefill, hw_p, "unified")], **common)
    link = _link(args, profile)
    return ClusterConfig(
        pools=[
            _pool(args, PoolRole.PREFILL, prefill, hw_p, "prefill"),
            _pool(args, PoolRole.DECODE, decode, hw_d, "decode"),
        ],
        link=link,
        first_token_from=args.first_token_from,
        **common,
    )


def _link(args: argparse.Namespace, profile):
    """--link-gbps (with --link-latency-us), else --link from the interconnect table (hardware/links.py:
    its achievable bandwidth and latency), else the profile's measured GB/s over --link-transport."""
    from pdserve.sim.config import LinkConfig

    layerwise = not args.naive_transfer
    if args.link_gbps is not None:
        return LinkConfig(
            name="--link-gbps",
            bandwidth_bytes_per_s=args.link_gbps * 1e9,
            latency_s=args.link_latency_us / 1e6,
            layerwise=layerwise,
            source="--link-gbps",
        )
    if args.link:
        from pdserve.hardware.links import link

        row = link(args.link)
        return LinkConfig(
            name=row.name,
            bandwidth_bytes_per_s=row.achievable_GB_s * 1e9,
            latency_s=row.latency_s,
            layerwise=layerwise,
            source=f"{row.achievable_source}; latency: {row.latency_source}",
        )
    measured = profile.transfer_gb_s(args.link_transport)
    if measured is None:
        raise SystemExit(
            f"the profile measured no {args.link_transport} transfer: give --link or --link-gbps"
        )
    return LinkConfig(
        name=args.link_transport,
        bandwidth_bytes_per_s=measured * 1e9,
        latency_s=args.link_latency_us / 1e6,
        layerwise=layerwise,
        source=f"measured here: {args.link_transport} (pdserve profile)",
    )


def workload(args: argparse.Namespace, rate: float):
    """The requests at `rate` req/s, as `bench serve` would send them (same seed, same arrivals)."""
    import numpy as np

    from pdserve.bench.arrivals import arrival_times
    from pdserve.bench.datasets import prefix_repetition_dataset, random_dataset, shared_prefix_dataset
    from pdserve.sim.workload import from_samples, random_lengths

    if args.dataset == "random" and (args.no_prefix_caching or args.prefix_len == 0):
        return random_lengths(
            args.num_prompts,
            args.input_len,
            args.output_len,
            rate,
            args.range_ratio,
            args.burstiness,
            args.seed,
        )
    if args.dataset == "random":
        samples = random_dataset(
            args.num_prompts, args.input_len, args.output_len, args.range_ratio, args.prefix_len, args.seed
        )
    elif args.dataset == "prefix_repetition":
        samples = prefix_repetition_dataset(
            args.num_prompts, args.prefix_len, args.suffix_len, args.num_prefixes, args.output_len, args.seed
        )
    else:
        samples = shared_prefix_dataset(
            args.num_prompts,
            args.num_turns,
            args.prefix_len,
            args.input_len,
            args.output_len,
            args.num_prefixes,
            args.seed,
        )
    times = arrival_times(len(samples), rate, args.burstiness, np.random.default_rng(args.seed))
    return from_samples(samples, times)


def sim(args: argparse.Namespace) -> int:
    from pdserve.sim.cluster import simulate
    from pdserve.sim.plots import plot_result
    from pdserve.sim.profile import Profile
    from pdserve.sim.search import cheapest_split, max_rate

    profile = Profile.read(Path(args.profile))
    slo = parse_goodput(args.goodput)
    modes = ["colocated", "disaggregated"] if args.mode == "both" else [args.mode]
    if args.replay:
        from pdserve.cli.replay import parse_since
        from pdserve.sim.replay import replay_requests

        requests_at = _fixed(replay_requests(args.replay, parse_since(args.since) if args.since else None))
    else:

        def requests_at(rate: float):
            return workload(args, rate)

    sizes = {"colocated": (args.replicas, 0), "disaggregated": (args.prefill, args.decode)}
    out: dict = {"command": "pdserve sim " + " ".join(args.argv), "profile": args.profile, "modes": {}}
    results, probes = {}, {}
    for mode in modes:
        cfg = build_cluster(args, profile, mode, *sizes[mode])
        if args.search == "rate":
            found = max_rate(cfg, requests_at, slo, args.attainment)
            probes[mode] = found.probes
            out["modes"][mode] = {
                "goodput_rate": found.goodput_rate,
                "attainment": args.attainment,
                "probes": [p._asdict() for p in found.probes],
            }
            console.print(
                f"{mode}: goodput {found.goodput_rate:.3g} req/s at ≥ {args.attainment:.0%} SLO "
                f"attainment ({len(found.probes)} probes)"
            )
            rate = found.goodput_rate or args.request_rate
        elif args.search == "split":
            reqs = requests_at(args.request_rate)
            best, tried = cheapest_split(
                lambda p, d, m=mode: build_cluster(args, profile, m, p, d),
                reqs,
                slo,
                args.attainment,
                args.max_replicas,
                mode == "disaggregated",
            )
            out["modes"][mode] = {
                "cheapest": best._asdict() if best else None,
                "tried": [s._asdict() for s in tried],
            }
            console.print(
                f"{mode}: cheapest split for {args.request_rate:g} req/s at ≥ {args.attainment:.0%}: "
                + (
                    f"{best.prefill} + {best.decode} replicas (attainment {best.attainment:.0%})"
                    if best
                    else f"none up to {args.max_replicas} replicas"
                )
            )
            if best:
                cfg = build_cluster(args, profile, mode, best.prefill, best.decode)
            rate = args.request_rate
        else:
            rate = args.request_rate
        reqs = requests_at(rate)
        t0, c0 = time.perf_counter(), time.process_time()
        result = simulate(cfg, reqs)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        results[mode] = result
        summary = result.summary(slo)
        summary.update(
            request_rate=rate,
            wall_s=wall,
            cpu_s=cpu,
            simulated_requests_per_wall_s=len(reqs) / wall,
            cluster=json.loads(cfg.model_dump_json()),
        )
        out["modes"].setdefault(mode, {}).update(summary)
        console.print(report_line(mode, rate, summary), markup=False)
    if args.out:
        out_dir = Path(args.out)
        out_dir.mkdir(parents=True, exist_ok=True)
        stem = args.label or "sim"
        (out_dir / f"{stem}.json").write_text(json.dumps(_compact(out), indent=2, default=float))
        png = plot_result(results, out_dir / f"{stem}.png", out["command"][:160], probes or None)
        console.print(f"wrote {out_dir / (stem + '.json')}, {png}")
    return 0


def _compact(out: dict) -> dict:
    """The cluster's hardware profiles are long; keep their names only in the JSON."""
    for m in out["modes"].values():
        for pool in m.get("cluster", {}).get("pools", []):
            hw = pool["hardware"]
            pool["hardware"] = {
                "name": hw["name"],
                "accelerator": hw["accelerator"],
                "cost": hw["cost"],
                "kv_capacity_tokens": hw["kv_capacity_tokens"],
                "sources": hw["sources"],
            }
    return out


def _fixed(requests):
    def at(_rate: float):
        return requests

    return at


def report_line(mode: str, rate: float, s: dict) -> str:
    lat = s["latency_ms"]
    bd = " + ".join(f"{k} {v:.1f}" for k, v in s["ttft_breakdown_mean_ms"].items())
    return (
        f"{mode} @ {rate:g} req/s: {s['completed']}/{s['requests']} completed in {s['duration_s']:.1f} s "
        f"(virtual); goodput {s['request_goodput'] or 0:.3g} req/s, SLO attainment "
        f"{s['slo_attainment']:.1%}; "
        f"TTFT p50/p99 {lat['ttft']['p50']:.1f}/{lat['ttft']['p99']:.1f} ms, TPOT p50 "
        f"{lat['tpot']['p50']:.1f} ms, "
        f"ITL p50/p99 {lat['itl']['p50']:.1f}/{lat['itl']['p99']:.1f} ms, output "
        f"{s['output_throughput']:.0f} tok/s; "
        f"TTFT mean = {bd} ms; prefix hit rate {s['prefix_hit_rate']:.1%}; "
        f"{s['simulated_requests_per_wall_s']:.0f} simulated requests per wall second "
        f"({s['wall_s']:.1f} s wall, "
        f"{s['cpu_s']:.1f} s CPU)"
    )


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sim", help="simulate colocated or disaggregated pools in virtual time")
    p.add_argument("--profile", default="var/profile.json", help="a `pdserve profile` file")
    p.add_argument("--mode", choices=("colocated", "disaggregated", "both"), default="both")
    p.add_argument("--replicas", type=int, default=2, help="colocated: unified replicas")
    p.add_argument("--prefill", type=int, default=1, help="disaggregated: prefill replicas")
    p.add_argument("--decode", type=int, default=1, help="disaggregated: decode replicas")
    p.add_argument(
        "--hardware",
        help="hardware profile of every pool: 'measured' (default), a name in the "
        "profile, or <accelerator>-tp<N>-<model>-<dtype>, e.g. h100-sxm-tp8-llama-3-70b-bf16",
    )
    p.add_argument("--prefill-hardware")
    p.add_argument("--decode-hardware")
    for pool in ("", "unified-", "prefill-", "decode-"):
        dflt = (
            {"max-num-seqs": 64, "max-num-batched-tokens": 512, "kv-capacity-tokens": None}
            if not pool
            else {}
        )
        for name in ("max-num-seqs", "max-num-batched-tokens", "kv-capacity-tokens"):
            p.add_argument(f"--{pool}{name}", type=int, default=dflt.get(name))
    p.add_argument("--policy", default="kv", choices=("kv", "round_robin", "least_loaded", "random"))
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--link-transport", default="ucxx", help="which measured transport's GB/s is the link")
    p.add_argument("--link", help="a link of hardware/links.py's table by name, e.g. 'InfiniBand NDR'")
    p.add_argument("--link-gbps", type=float, help="link bandwidth, GB/s (default: the profile's measured)")
    p.add_argument("--link-latency-us", type=float, default=20.0)
    p.add_argument(
        "--naive-transfer", action="store_true", help="send the KV after the prefill, not per layer"
    )
    p.add_argument("--first-token-from", choices=("prefill", "decode"), default="prefill")
    p.add_argument(
        "--request-overhead-ms",
        type=float,
        default=0.0,
        help="control plane before the engine (client → worker queue)",
    )
    p.add_argument("--first-token-overhead-ms", type=float, default=0.0)
    p.add_argument("--decode-start-ms", type=float, default=0.0)
    p.add_argument("--dataset", choices=DATASETS, default="random")
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--range-ratio", type=float, default=0.0)
    p.add_argument("--prefix-len", type=int, default=0)
    p.add_argument("--suffix-len", type=int, default=128)
    p.add_argument("--num-prefixes", type=int, default=4)
    p.add_argument("--num-turns", type=int, default=3)
    p.add_argument("--request-rate", type=float, default=1.0)
    p.add_argument("--burstiness", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--replay", metavar="DATABASE_URL", help="replay the requests of this event store")
    p.add_argument("--since", help="with --replay: only requests received in the last e.g. 15m")
    p.add_argument("--goodput", nargs="+", default=["ttft:2000", "tpot:200"], metavar="KEY:MS")
    p.add_argument("--search", choices=("rate", "split"))
    p.add_argument("--attainment", type=float, default=0.9, help="SLO attainment the search holds")
    p.add_argument("--max-replicas", type=int, default=16, help="--search split: most replicas in all")
    p.add_argument("--out", help="write <label>.json and .png here")
    p.add_argument("--label")
    p.set_defaults(func=sim)
