"""Must-show 1 of issue 17: the simulator, calibrated by `pdserve profile`, against `pdserve bench compare`
measured here on the same grid (input:output ratios × request rates, colocated and disaggregated).

One run, per mode: `pdserve profile` pinned to core 0 (the core the first worker pool is pinned to), then
that mode's stack: a few probe requests (other prompts than the sweep's: one at a time at each ratio, 8
decode-heavy ones at once, and one decode stream with eight prefills beside it), the `bench compare` sweep
(`bench/compare.py`: a real stack, each pool on its own core), then the simulator on the same requests
(the same random prompts, hashed with pdserve's block hashing, and the same arrival times:
`bench/datasets.py`, `bench/arrivals.py`, seed 0) with that profile's cost model and the stack's
configuration (colocated: 2 unified workers; disaggregated: 1 prefill + 1 decode worker; each max_num_seqs
64, a 512-token budget, 32,768 KV tokens; the `kv` policy; the measured ucxx GB/s as the link), the cost
model the mean of a profile taken just before and one just after the sweep, the control plane's time
before the first token, its time per emitted token and how much longer a step is beside a prefill from
the probes (the engine-only variant uses the profile before and the documented constants below instead;
both are reported). A sweep keeps its stack up, and every rate of one ratio sends the same prompts (one
seed), so the simulator runs each ratio's rates in sweep order on one cluster, as the stack served them
(later rates hit the prefix cache the earlier ones filled). The control plane's fixed times are the
concurrency-1 phases of docs/benchmarks/control_plane.md (client↔gateway, queue, route, reserve,
dispatch: 12 ms before the engine, 3 ms for the first token's way back, 2 ms to start decode).

Writes docs/benchmarks/sim-validation.{json,md,png}: TTFT p50, TPOT p50 and goodput per cell, simulated
beside measured, the error of each, the winner (by goodput, `bench compare`'s margin: 2 requests) per cell.
`--render JSON` re-simulates from a saved run (its measurements and profiles) without measuring.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.outputs import write_outputs  # noqa: E402
from benchmarks.pinned_profile import profile_here  # noqa: E402
from pdserve.bench.arrivals import arrival_times  # noqa: E402
from pdserve.bench.compare import CompareConfig, code_commit, run_compare, split_tokens
from pdserve.bench.compare_report import WIN_MARGIN_REQUESTS
from pdserve.bench.datasets import random_dataset
from pdserve.sim.calibrate import fit_decode_token_s, fit_prefill_interference
from pdserve.sim.cluster import simulate
from pdserve.sim.config import ClusterConfig, LinkConfig, Overheads, PoolConfig, PoolRole
from pdserve.sim.profile import Profile
from pdserve.sim.workload import SimRequest, from_samples

STEM = "sim-validation"
OVERHEADS = Overheads(request_s=0.012, first_token_s=0.003, decode_start_s=0.002)


def cluster(mode: str, profile: Profile, overheads: Overheads = OVERHEADS) -> ClusterConfig:
    hw = profile.measured
    pool = {"max_num_seqs": 64, "max_num_batched_tokens": 512, "kv_capacity_tokens": 32768, "hardware": hw}
    if mode == "colocated":
        return ClusterConfig(
            pools=[PoolConfig(role=PoolRole.UNIFIED, replicas=2, **pool)], overheads=overheads
        )
    gbs = profile.transfer_gb_s("ucxx") or profile.transfer_gb_s("tcp") or 1.0
    link = LinkConfig(
        name="ucxx",
        bandwidth_bytes_per_s=gbs * 1e9,
        latency_s=20e-6,
        source="measured here (pdserve profile)",
    )
    return ClusterConfig(
        pools=[PoolConfig(role=PoolRole.PREFILL, **pool), PoolConfig(role=PoolRole.DECODE, **pool)],
        link=link,
        overheads=overheads,
    )


def requests_of(cfg: dict, ratio: str, rate: float) -> list[SimRequest]:
    a, b = (int(x) for x in ratio.split(":"))
    n_in, n_out = split_tokens(cfg["tokens_per_request"], (a, b))
    samples = random_dataset(cfg["num_prompts"], n_in, n_out, 0.0, 0, cfg["seed"])
    times = arrival_times(len(samples), rate, cfg["burstiness"], np.random.default_rng(cfg["seed"]))
    return from_samples(samples, times)


def simulate_mode(mode: str, profile: Profile, cfg: dict, overheads: Overheads = OVERHEADS) -> list[dict]:
    """Every (ratio, rate) cell of `mode`, each ratio's rates in sweep order on one cluster (a gap of
    1,000 virtual seconds between rates, so each starts idle but with the caches the earlier ones left)."""
    cells = []
    cl = cluster(mode, profile, overheads)
    for ratio in cfg["ratios"]:
        reqs: list[SimRequest] = []
        spans = []
        offset = 0.0
        for rate in cfg["rates"]:
            part = requests_of(cfg, ratio, rate)
            spans.append((rate, len(reqs), len(reqs) + len(part)))
            reqs += [r._replace(arrival_s=r.arrival_s + offset) for r in part]
            offset = reqs[-1].arrival_s + 1000.0
        res = simulate(cl, reqs)
        slo = cfg["goodput_slo_ms"]
        meets = res.meets(slo)
        for rate, lo, hi in spans:
            sl = slice(lo, hi)
            done = res.done[sl]
            duration = float(np.nanmax(res.finish_s[sl]) - np.min(res.arrival_s[sl]))
            out = res.output_len[sl]
            tpot = res.tpot_s[sl][done & (out > 1)]
            cells.append(
                {
                    "mode": mode,
                    "ratio": ratio,
                    "request_rate": rate,
                    "ttft_p50_ms": float(np.median(res.ttft_s[sl][done])) * 1e3,
                    "tpot_p50_ms": float(np.median(tpot)) * 1e3 if len(tpot) else 0.0,
                    "good_requests": int(meets[sl].sum()),
                    "requests": hi - lo,
                    "request_goodput": float(meets[sl].sum()) / duration,
                    "prefix_hit_tokens": int(res.cached_tokens[sl].sum()),
                }
            )
    return cells


PROBE_PROMPTS = 2
PROBE_SEED = 1000
# The concurrent probe: decode-heavy requests all sent at once, so each worker's decode batch holds several
# sequences for ~100 steps; its TPOT is what the serving loop costs per emitted token under a batch.
CONCURRENT_PROBE = {"ratio": "1:20", "num_prompts": 8, "max_concurrency": 8}
# The interference probe: one decode-heavy stream, and prefill-heavy requests (Poisson) beside it from 1 s
# on; the stream's TPOT is its decode steps slowed by the prefills (benchmarks/itl_positions.py).
INTERFERENCE_PROBE = {"stream": (6, 126), "prefills": 8, "prefill": (120, 1), "rate": 2.0, "delay_s": 1.0}


def interference_requests() -> tuple[list, list, list[float]]:
    """The interference probe's stream (1 sample), its prefills (samples) and their arrival times (s, from
    the stream's send): other prompts than the sweep's and the other probes' (seeds 1001, 1002)."""
    ip = INTERFERENCE_PROBE
    stream = random_dataset(1, *ip["stream"], 0.0, 0, PROBE_SEED + 1)
    fills = random_dataset(ip["prefills"], *ip["prefill"], 0.0, 0, PROBE_SEED + 2)
    times = arrival_times(len(fills), ip["rate"], 1.0, np.random.default_rng(PROBE_SEED))
    return stream, fills, [ip["delay_s"] + float(t) for t in times]


def _interference_probe(base_url: str) -> dict:
    import asyncio

    from pdserve.bench.runner import LoadSpec, run_load

    stream, fills, _ = interference_requests()
    ip = INTERFERENCE_PROBE

    async def both():
        async def beside():
            await asyncio.sleep(ip["delay_s"])
            return await run_load(base_url, fills, LoadSpec(request_rate=ip["rate"], seed=PROBE_SEED),
                                  progress=False)

        return await asyncio.gather(run_load(base_url, stream, LoadSpec(), progress=False), beside())

    streamed, _ = asyncio.run(both())
    (rec,) = streamed.records
    return {**ip, "tpot_ms": rec.tpot_s * 1e3, "success": rec.success}


def _serve_probe(base_url: str, ratio: str, cfg: dict, num_prompts: int, max_concurrency: int) -> dict:
    import asyncio

    from pdserve.bench.serve import ServeConfig, run_serve

    a, b = (int(x) for x in ratio.split(":"))
    n_in, n_out = split_tokens(cfg["tokens_per_request"], (a, b))
    sc = ServeConfig(
        base_url=base_url,
        dataset="random",
        num_prompts=num_prompts,
        input_len=n_in,
        output_len=n_out,
        request_rate=float("inf"),
        max_concurrency=max_concurrency,
        seed=PROBE_SEED,
        database_url=None,
    )
    m = asyncio.run(run_serve(sc, progress=False)).metrics
    return {
        "input_len": n_in,
        "output_len": n_out,
        "num_prompts": num_prompts,
        "max_concurrency": max_concurrency,
        "ttft_p50_ms": m.latency["ttft"].median_ms,
        "tpot_p50_ms": m.latency["tpot"].median_ms,
    }


def probe(mode: str, base_url: str, cfg: dict) -> dict:
    """Calibration requests on the stack before its sweep, other prompts than the sweep's (seed 1000), never
    a cell of the grid: `sequential`, each ratio's lengths one at a time (the stack's TTFT and TPOT with
    nothing else running: the control plane's time before the first token), `concurrent`,
    `CONCURRENT_PROBE`'s prompts all at once (its TPOT: the serving loop's time per emitted token), and
    `interference`, `INTERFERENCE_PROBE`'s stream with prefills beside it (its TPOT: how much a decode step
    slows beside a prefill)."""
    out: dict = {"sequential": {}}
    for ratio in cfg["ratios"]:
        out["sequential"][ratio] = _serve_probe(base_url, ratio, cfg, PROBE_PROMPTS, 1)
        print(f"  probe {mode} {ratio}: {out['sequential'][ratio]}", flush=True)
    cp = CONCURRENT_PROBE
    out["concurrent"] = _serve_probe(base_url, cp["ratio"], cfg, cp["num_prompts"], cp["max_concurrency"])
    print(f"  probe {mode} concurrent: {out['concurrent']}", flush=True)
    out["interference"] = _interference_probe(base_url)
    print(f"  probe {mode} interference: {out['interference']}", flush=True)
    return out


SLO_TTFT_OVER_PROBE = 1.4  # × the longest one-at-a-time TTFT p50: room for queueing, not for a backlog
SLO_TPOT_OVER_PROBE = 1.3  # × one stream's TPOT p50: a batch of a few sequences meets it, a stalled one not


def slo_from_probes(p: dict) -> dict[str, float]:
    """The goodput SLO where this machine's two modes differ on the day, from the first stack's sequential
    probes (never from the sweep): TTFT ≤ 1.4 × the longest ratio's TTFT p50, TPOT ≤ 1.3 × the median
    TPOT p50, ms, rounded to 10 ms. A fixed SLO does not travel: on a slower day every request of both
    modes misses a TPOT bound the quiet machine met, and every cell is a tie (a winner test that cannot
    fail)."""
    seq = p["sequential"].values()
    ttft = SLO_TTFT_OVER_PROBE * max(x["ttft_p50_ms"] for x in seq)
    tpot = SLO_TPOT_OVER_PROBE * statistics.median(x["tpot_p50_ms"] for x in seq)
    return {"ttft": round(ttft, -1), "tpot": round(tpot, -1)}


def bracketed(before: Profile, after: Profile | None) -> Profile:
    """The mean of the cost models fitted just before and just after the sweep (the machine's load moves
    within minutes: the two bracket what the sweep ran under)."""
    if after is None:
        return before
    cost = before.cost.model_copy(update={k: (v + getattr(after.cost, k)) / 2 for k, v in before.cost})
    measured = before.measured.model_copy(update={"cost": cost})
    return before.model_copy(update={"measured": measured, "cost": cost})


def simulated_probe_tpot_s(mode: str, profile: Profile, overheads: Overheads, p: dict) -> float:
    """TPOT p50 (s) of the concurrent probe `p` simulated on `mode`'s cluster: its prompts (seed 1000), all
    arriving at t = 0 (the client sends `max_concurrency` ≥ `num_prompts` at once)."""
    samples = random_dataset(p["num_prompts"], p["input_len"], p["output_len"], 0.0, 0, PROBE_SEED)
    res = simulate(cluster(mode, profile, overheads), from_samples(samples, [0.0] * len(samples)))
    return res.metrics().latency["tpot"].median_ms / 1e3


def interference_sim_requests() -> list[SimRequest]:
    """The interference probe as the simulator takes it: the stream (request 0) at 0, its prefills after."""
    stream, fills, times = interference_requests()
    return from_samples(stream, [0.0]) + from_samples(fills, times)


def calibrate(mode: str, profile: Profile, probes: dict | None) -> tuple[Overheads, dict]:
    """The control plane's time around the engine, from the probes (without probes: the documented
    constants). `request_s`: the sequential probes' client TTFT above the engine's prefill (median over
    ratios). `decode_token_s`: fitted (`sim/calibrate.py`) so the simulated concurrent probe's TPOT p50 is
    the measured one. `prefill_interference` (when the run has the interference probe): then fitted so the
    simulated interference probe's stream has its measured TPOT."""
    if not probes:
        return OVERHEADS, {}
    c = profile.cost
    seq = probes["sequential"]
    ttft_extra = [p["ttft_p50_ms"] / 1e3 - c.prefill_s(p["input_len"]) for p in seq.values()]
    request_s = max(0.0, statistics.median(ttft_extra))
    ov = Overheads(request_s=request_s, first_token_s=0.0, decode_start_s=OVERHEADS.decode_start_s)
    target_s = probes["concurrent"]["tpot_p50_ms"] / 1e3

    def tpot_at(decode_token_s: float) -> float:
        with_token = ov.model_copy(update={"decode_token_s": decode_token_s})
        return simulated_probe_tpot_s(mode, profile, with_token, probes["concurrent"])

    decode_token_s = fit_decode_token_s(tpot_at, target_s)
    ov = ov.model_copy(update={"decode_token_s": decode_token_s})
    engine_tpot = tpot_at(0.0)
    fitted = {
        "request_s": request_s,
        "ttft_above_engine_s": ttft_extra,
        "decode_token_s": decode_token_s,
        "concurrent_probe_tpot_s": {"measured": target_s, "simulated_engine_only": engine_tpot},
    }
    ip = probes.get("interference")
    if ip and ip.get("success"):
        reqs = interference_sim_requests()

        def stream_tpot_at(x: float) -> float:  # the stream's TPOT (s), its prefills beside it
            with_x = ov.model_copy(update={"prefill_interference": x})
            return float(simulate(cluster(mode, profile, with_x), reqs).tpot_s[0])

        alpha = fit_prefill_interference(stream_tpot_at, ip["tpot_ms"] / 1e3)
        ov = ov.model_copy(update={"prefill_interference": alpha})
        fitted["prefill_interference"] = alpha
        fitted["interference_probe_tpot_s"] = {"measured": ip["tpot_ms"] / 1e3,
                                               "simulated_without": stream_tpot_at(0.0)}
    return ov, fitted


def measure(args: argparse.Namespace, work: Path) -> dict:
    results: dict = {
        "config": {
            "ratios": args.ratios,
            "rates": args.rates,
            "num_prompts": args.num_prompts,
            "tokens_per_request": args.tokens_per_request,
            "seed": 0,
            "burstiness": 1.0,
            # filled from the first stack's probes unless given (`slo_from_probes`); one dict, shared with
            # every CompareConfig below, so the second mode's sweep counts goodput at the same SLO
            "goodput_slo_ms": (
                {"ttft": args.slo_ttft_ms, "tpot": args.slo_tpot_ms}
                if args.slo_ttft_ms and args.slo_tpot_ms
                else {}
            ),
        },
        "commit": code_commit(),
        "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "loadavg_at_start": os.getloadavg(),
        "measured": [],
        "profiles": {},
    }
    for mode in ("colocated", "disaggregated"):
        print(f"== {mode}: pdserve profile (core 0)", flush=True)
        results.setdefault("loadavg", {})[f"{mode} profile"] = os.getloadavg()[0]
        prof = profile_here(work / f"profile-{mode}.json")
        results["profiles"][mode] = json.loads(prof.model_dump_json())
        cc = CompareConfig(
            modes=[mode],
            ratios=[tuple(int(x) for x in r.split(":")) for r in args.ratios],
            rates=args.rates,
            num_prompts=args.num_prompts,
            tokens_per_request=args.tokens_per_request,
            port=args.port,
            var_dir=(work / "stacks").resolve(),
            goodput_slo_ms=results["config"]["goodput_slo_ms"],
        )
        print(f"== {mode}: bench compare", flush=True)

        def probe_then_slo(m: str, url: str) -> dict:
            p = probe(m, url, results["config"])
            slo = results["config"]["goodput_slo_ms"]
            if not slo:
                slo.update(slo_from_probes(p))
                results["slo_from_probes"] = True
                print(f"  SLO from the {m} probes: {slo}", flush=True)
            return p

        run_compare(cc, work / mode, probe=probe_then_slo)
        measured = json.loads((work / mode / "colocated-vs-disaggregated.json").read_text())
        results["measured"] += measured["points"]
        results.setdefault("probes", {}).update(measured.get("probes", {}))
        print(f"== {mode}: pdserve profile again (core 0)", flush=True)
        results["loadavg"][f"{mode} profile after"] = os.getloadavg()[0]
        after = profile_here(work / f"profile-{mode}-after.json")
        results.setdefault("profiles_after", {})[mode] = json.loads(after.model_dump_json())
        results["elapsed_s"] = time.monotonic() - T0
        (work / f"{STEM}-raw.json").write_text(json.dumps(results, indent=2))
    return results


def rel(sim: float, meas: float) -> float:
    return (sim - meas) / meas if meas else float("nan")


def winner(co: float, dis: float) -> str:
    if dis - co >= WIN_MARGIN_REQUESTS:
        return "disaggregated"
    if co - dis >= WIN_MARGIN_REQUESTS:
        return "colocated"
    return "tie"


def compare(results: dict) -> dict:
    """Both variants: `engine` (the profile taken before the sweep alone, the control plane's documented
    constants) and, the headline, `calibrated` (the mean of the profiles before and after the sweep, and
    the control plane's time before the first token from the concurrency-1 probes)."""
    out = {}
    for variant in ("engine", "calibrated"):
        out[variant] = compare_variant(results, variant)
    return {
        **results,
        **out["calibrated"],
        "engine_only": {
            k: out["engine"][k] for k in ("median_abs_error", "same_winner", "num_cells", "rows", "cells")
        },
    }


def compare_variant(results: dict, variant: str) -> dict:
    cfg = results["config"]
    sims = []
    calibration = {}
    for mode in ("colocated", "disaggregated"):
        prof = Profile.model_validate(results["profiles"][mode])
        ov = OVERHEADS
        if variant == "calibrated":
            after = results.get("profiles_after", {}).get(mode)
            prof = bracketed(prof, Profile.model_validate(after) if after else None)
            ov, calibration[mode] = calibrate(mode, prof, results.get("probes", {}).get(mode))
        sims += simulate_mode(mode, prof, cfg, ov)
    sim_by = {(c["mode"], c["ratio"], c["request_rate"]): c for c in sims}
    rows = []
    for p in results["measured"]:
        s = sim_by[(p["mode"], p["ratio"], p["request_rate"])]
        good = p["goodput_fraction"] * (p["completed"] + p["failed"])
        rows.append(
            {
                "mode": p["mode"],
                "ratio": p["ratio"],
                "request_rate": p["request_rate"],
                "measured": {
                    "ttft_p50_ms": p["latency_ms"]["ttft"]["p50"],
                    "tpot_p50_ms": p["latency_ms"]["tpot"]["p50"],
                    "request_goodput": p["request_goodput"],
                    "good_requests": round(good),
                },
                "simulated": s,
                "error": {
                    "ttft_p50": rel(s["ttft_p50_ms"], p["latency_ms"]["ttft"]["p50"]),
                    "tpot_p50": rel(s["tpot_p50_ms"], p["latency_ms"]["tpot"]["p50"]),
                    "request_goodput": rel(s["request_goodput"], p["request_goodput"]),
                },
            }
        )
    cells = []
    for ratio in cfg["ratios"]:
        for rate in cfg["rates"]:
            pair = {r["mode"]: r for r in rows if r["ratio"] == ratio and r["request_rate"] == rate}
            if len(pair) < 2:
                continue
            m = winner(
                pair["colocated"]["measured"]["good_requests"],
                pair["disaggregated"]["measured"]["good_requests"],
            )
            s = winner(
                pair["colocated"]["simulated"]["good_requests"],
                pair["disaggregated"]["simulated"]["good_requests"],
            )
            cells.append(
                {
                    "ratio": ratio,
                    "request_rate": rate,
                    "measured_winner": m,
                    "simulated_winner": s,
                    "same": m == s,
                }
            )
    summary = (
        {
            k: statistics.median(abs(r["error"][k]) for r in rows if r["error"][k] == r["error"][k])
            for k in ("ttft_p50", "tpot_p50", "request_goodput")
        }
        if rows
        else {}
    )
    by_mode = {
        mode: {
            k: statistics.median(
                abs(r["error"][k]) for r in rows if r["mode"] == mode and r["error"][k] == r["error"][k]
            )
            for k in ("ttft_p50", "tpot_p50")
        }
        for mode in {r["mode"] for r in rows}
    }
    return {
        "median_abs_error_by_mode": by_mode,
        "rows": rows,
        "cells": cells,
        "calibration": calibration,
        "median_abs_error": summary,
        "same_winner": sum(c["same"] for c in cells),
        "num_cells": len(cells),
    }


def interference_text(c: dict) -> str:
    if "prefill_interference" not in c:
        return ""
    t = c["interference_probe_tpot_s"]
    return (f", a step {c['prefill_interference']:.0%} longer beside a prefill from the interference probe "
            f"(its stream's TPOT {t['measured'] * 1e3:.1f} ms measured, "
            f"{t['simulated_without'] * 1e3:.1f} ms simulated without it)")


def calibration_text(r: dict) -> str:
    parts = []
    for mode, c in r.get("calibration", {}).items():
        bracket = (
            "profiles before and after the sweep averaged"
            if mode in r.get("profiles_after", {})
            else "the profile before the sweep (this run took none after)"
        )
        parts.append(
            f"{mode}: {bracket}, {c['request_s'] * 1e3:.0f} ms of control plane before the first token "
            f"from the sequential probes, {c['decode_token_s'] * 1e3:.1f} ms per emitted token from the "
            f"concurrent probe (TPOT p50 {c['concurrent_probe_tpot_s']['measured'] * 1e3:.1f} ms measured, "
            f"{c['concurrent_probe_tpot_s']['simulated_engine_only'] * 1e3:.1f} ms simulated without it)"
            + interference_text(c)
            if c
            else f"{mode}: no probes, documented constants"
        )
    return "; ".join(parts) or "no calibration data"


def slo_text(r: dict) -> str:
    if r.get("slo_from_probes"):
        return (
            f"set from the first stack's one-at-a-time probes: {SLO_TTFT_OVER_PROBE:g} × their longest TTFT "
            f"p50, {SLO_TPOT_OVER_PROBE:g} × their median TPOT p50"
        )
    return "given on the command line"


def loads_text(r: dict) -> str:
    loads = r.get("loadavg", {})
    return (
        ", ".join(f"{k} {v:.1f}" for k, v in loads.items()) or f"{r['loadavg_at_start'][0]:.1f} (run start)"
    )


def markdown(r: dict) -> str:
    cfg = r["config"]
    e = r["median_abs_error"]
    eo = r["engine_only"]
    lines = [
        "# Simulator vs measured: colocated and disaggregated SmolLM2 on this machine",
        "",
        f"Generated by `python benchmarks/sim_validation.py` ({r['started']}, commit {r['commit']}, load "
        "average "
        f"at start {r['loadavg_at_start'][0]:.1f} on 2 shared cores). Measured: `pdserve bench compare` "
        f"(random prompts, {cfg['num_prompts']} per cell, {cfg['tokens_per_request']} tokens per request "
        "split by "
        f"the ratio, Poisson arrivals, seed 0; SLO TTFT ≤ {cfg['goodput_slo_ms']['ttft']:.0f} ms and TPOT ≤ "
        f"{cfg['goodput_slo_ms']['tpot']:.0f} ms, {slo_text(r)}). Simulated: `pdserve sim`'s simulator "
        "with the cost model `pdserve profile` fitted on this machine just before that mode's measurement, "
        "on the same requests.",
        "",
        f"**Median absolute error: TTFT p50 {e.get('ttft_p50', float('nan')):.1%}, TPOT p50 "
        f"{e.get('tpot_p50', float('nan')):.1%}, goodput {e.get('request_goodput', float('nan')):.1%} "
        "(target ≤ 15% on TTFT and TPOT: "
        f"{'met' if max(e.get('ttft_p50', 9), e.get('tpot_p50', 9)) <= 0.15 else 'NOT met'}); "
        f"same winner in {r['same_winner']} of {r['num_cells']} cells (target ≥ 8 of 9: "
        f"{'met' if r['same_winner'] >= 8 else 'NOT met'}).**",
        "",
        f"That is the calibrated variant: {calibration_text(r)}. The engine-only variant (the profile before "
        "the sweep, the control plane's quiet-machine constants of docs/benchmarks/control_plane.md) has "
        f"TTFT p50 {eo['median_abs_error']['ttft_p50']:.1%}, "
        f"TPOT p50 {eo['median_abs_error']['tpot_p50']:.1%}, "
        f"goodput {eo['median_abs_error']['request_goodput']:.1%}, same winner {eo['same_winner']} of "
        f"{eo['num_cells']}. Load average at the start of each phase: {loads_text(r)}.",
        "",
        "Per mode (calibrated): "
        + "; ".join(
            f"{m}: TTFT p50 {v['ttft_p50']:.1%}, TPOT p50 {v['tpot_p50']:.1%}"
            for m, v in sorted(r["median_abs_error_by_mode"].items())
        )
        + ".",
        "",
        "| ratio | rate | mode | TTFT p50 meas / sim (ms) | err | TPOT p50 meas / sim (ms) | err | "
        "goodput meas / sim (req/s) | err | SLO met meas / sim |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for x in r["rows"]:
        m, s, er = x["measured"], x["simulated"], x["error"]
        lines.append(
            f"| {x['ratio']} | {x['request_rate']:g} | {x['mode']} | {m['ttft_p50_ms']:.0f} / "
            f"{s['ttft_p50_ms']:.0f} | "
            f"{er['ttft_p50']:+.0%} | {m['tpot_p50_ms']:.1f} / {s['tpot_p50_ms']:.1f} | "
            f"{er['tpot_p50']:+.0%} | "
            f"{m['request_goodput']:.3f} / {s['request_goodput']:.3f} | {er['request_goodput']:+.0%} | "
            f"{m['good_requests']}/{s['good_requests']} of {s['requests']} |"
        )
    lines += ["", "| ratio | rate | winner measured | winner simulated | same |", "|---|---:|---|---|---|"]
    lines += [
        f"| {c['ratio']} | {c['request_rate']:g} | {c['measured_winner']} | {c['simulated_winner']} | "
        f"{'yes' if c['same'] else '**no**'} |"
        for c in r["cells"]
    ]
    if r.get("notes"):
        lines += ["", "Notes:", ""] + [f"- {n}" for n in r["notes"]]
    lines += ["", "Profiles (fitted in the same run, one engine thread pinned to core 0):", ""]
    for mode, p in r["profiles"].items():
        c = p["cost"]
        lines.append(
            f"- {mode}: prefill step {c['prefill_fixed_s'] * 1e3:.1f} ms + "
            f"{c['prefill_token_s'] * 1e3:.3f} ms/token "
            f"(+ {c['prefill_pair_s'] * 1e9:.2f} ns/pair), fit error mean "
            f"{p['prefill_fit']['mean_abs_rel']:.1%}; "
            f"decode step {c['decode_fixed_s'] * 1e3:.1f} ms + {c['decode_seq_s'] * 1e3:.2f} ms/sequence + "
            f"{c['decode_ctx_s'] * 1e9:.1f} ns/context token, fit error mean "
            f"{p['decode_fit']['mean_abs_rel']:.1%}; "
            + ", ".join(
                f"{t['transport']} {t['nbytes'] / t['seconds'] / 1e9:.2f} GB/s" for t in p["transfers"]
            )
        )
    lines += [
        "",
        "What the simulator models of the control plane is two calibrated constants: a fixed time before "
        "each request's first token and a time per emitted token (the CPU the gateway, coordinator, "
        "recorder and NATS take from the workers' cores while streaming). Not modelled "
        "(docs/architecture.md §17): how either varies with load, the decode worker's checksum "
        "verification, the noise of the other work on these 2 cores.",
    ]
    return "\n".join(lines) + "\n"


def plot(r: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for ax, key, name in (
        (axes[0], "ttft_p50_ms", "TTFT p50 (ms)"),
        (axes[1], "tpot_p50_ms", "TPOT p50 (ms)"),
        (axes[2], "request_goodput", "goodput (req/s)"),
    ):
        for mode, marker in (("colocated", "o"), ("disaggregated", "s")):
            xs = [x["measured"][key] for x in r["rows"] if x["mode"] == mode]
            ys = [x["simulated"][key] for x in r["rows"] if x["mode"] == mode]
            ax.scatter(xs, ys, marker=marker, label=mode)
        vals = [x["measured"][key] for x in r["rows"]] + [x["simulated"][key] for x in r["rows"]]
        lo, hi = min(vals + [0]), max(vals + [1e-9]) * 1.1
        ax.plot([lo, hi], [lo, hi], "k--", lw=0.8)
        ax.fill_between([lo, hi], [lo * 0.85, hi * 0.85], [lo * 1.15, hi * 1.15], color="grey", alpha=0.15)
        ax.set_xlabel(f"measured {name}")
        ax.set_ylabel(f"simulated {name}")
        ax.grid(alpha=0.3)
    axes[0].legend()
    e = r["median_abs_error"]
    fig.suptitle(
        f"simulated vs measured (±15% band); median |error| TTFT {e.get('ttft_p50', 0):.0%}, "
        f"TPOT {e.get('tpot_p50', 0):.0%}; same winner {r['same_winner']}/{r['num_cells']}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


T0 = time.monotonic()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ratios", nargs="+", default=["10:1", "1:1", "1:20"])
    ap.add_argument("--rates", type=float, nargs="+", default=[0.5, 1.0, 2.0])
    ap.add_argument("--num-prompts", type=int, default=20)
    ap.add_argument("--tokens-per-request", type=int, default=132)
    ap.add_argument("--port", type=int, help="gateway port of the stacks (default: a free one)")
    # Under `bench compare`'s default (2 s / 200 ms) both modes meet the SLO in every cell on a quiet
    # machine, and every cell is a tie: a winner test that cannot fail. Default: `slo_from_probes`.
    ap.add_argument("--slo-ttft-ms", type=float, help="goodput SLO on TTFT (default: from the probes)")
    ap.add_argument("--slo-tpot-ms", type=float, help="goodput SLO on TPOT (default: from the probes)")
    ap.add_argument("--work", type=Path, default=Path("var/sim-validation"))
    ap.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    ap.add_argument(
        "--render",
        type=Path,
        help="re-simulate a saved run's JSON (no measuring), e.g. docs/benchmarks/sim-validation.json",
    )
    ap.add_argument(
        "--note", action="append", default=[], help="a line for the page's notes (kept in the JSON)"
    )
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    if args.port is None:
        from pdserve.embedded import free_port

        args.port = free_port()
    raw = json.loads(args.render.read_text()) if args.render else measure(args, args.work)
    raw["notes"] = list(dict.fromkeys([*raw.get("notes", []), *args.note]))
    print(write_outputs(args.out, STEM, compare(raw), markdown, plot))


if __name__ == "__main__":
    main()
