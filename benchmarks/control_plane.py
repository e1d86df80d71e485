"""Control-plane overhead: a request's TTFT outside the forward and the KV transfer, above the HTTP floor.

    python benchmarks/control_plane.py [--rounds 3] [--num-prompts 100] [--concurrency 1 8]
        [--input-len 128] [--output-len 8] [--servers ...] [--out docs/benchmarks]
    python benchmarks/control_plane.py --from-json docs/benchmarks/control_plane.json   # re-render

Servers up side by side on the tiny model (`--model tiny`: 2 layers, hidden 64, so the forward is a few ms
and what is left is the control plane), driven one at a time by `pdserve bench serve`'s client:

- **floor**: a bare FastAPI app streaming one SSE chunk at once (libs/pdserve/bench/sse_floor.py), run
  under uvicorn as services/gateway runs the gateway, in a process of its own;
- **colocated**: `pdserve up --mode colocated --model tiny` (2 unified workers);
- **disaggregated**: `pdserve up --model tiny` (1 prefill + 1 decode worker, KV over ucxx);
- **colocated-router**, **disaggregated-router**: the same stacks with `--routers 1`, the coordinator
  asking the router service for each placement instead of placing in-process: what the in-process
  placement saves, measured in the same run.

The stacks use this machine's NATS (4222) and Postgres (5432) when they answer, else embedded ones
(`PDS_NATS_URL` / `PDS_DATABASE_URL` choose others). Per request: overhead = client TTFT − the prefill
worker's forward (its `PrefillCompleted.prefill_s`, from the event log) − exposed transfer (the
coordinator's TTFT breakdown), split into client↔gateway, queue, route, reserve, prefill dispatch and
first token (libs/pdserve/bench/control_plane.py), and the same way hop by hop from the spans each stack's
services exported (libs/pdserve/bench/hops.py: HTTP → gateway.request → the coordinator's Submit handler →
its run → the prefill command → the worker's handler → its forward). Each round sends `--num-prompts`
fresh random prompts per concurrency to each server in an order rotated every round and reversed every
other (`sidebyside.round_order`). Reported: p50 / p99 of the overhead minus the floor's TTFT (same
concurrency, same run, all rounds pooled), and the per-round p50 differences. Targets (issue 14): ≤ 4 ms
p50 above the floor disaggregated, ≤ 2 ms colocated. Before and after the rounds it measures the bus under
the control plane (libs/pdserve/bench/bus_floor.py: one NATS request/reply, bare and typed, and the
critical path's messaging floor derived from it). Around each load it reads the CPU time every process of
the server spent — the services by role, NATS, Postgres, the client (libs/pdserve/bench/cpu_time.py) — per
request, and the share of the machine's cores they kept busy. Writes control_plane.json, .md and .png under
`--out`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
from rich.console import Console

from pdserve.bench.breakdown import fetch_breakdowns
from pdserve.bench.bus_floor import CRITICAL_PATH_MESSAGES, measure_bus_floor
from pdserve.bench.compare import code_commit, cpu_model, warm_up
from pdserve.bench.control_plane import PHASES, fetch_worker_prefill_s, request_overheads, summarise
from pdserve.bench.cpu_time import CpuMeter, process_meter, stack_meter
from pdserve.bench.datasets import random_dataset
from pdserve.bench.hops import HOPS, request_hops
from pdserve.bench.runner import LoadSpec, run_load
from pdserve.bench.sidebyside import free_port, pdserve_stack, round_order
from pdserve.telemetry.setup import SCHEDULE_DELAY_MS
from pdserve.telemetry.spans import load_spans

console = Console(highlight=False, soft_wrap=True)
SPAN_EXPORT_WAIT_S = 3 * SCHEDULE_DELAY_MS / 1000  # the services export their spans every 0.5 s
SERVERS = ("floor", "colocated", "disaggregated", "colocated-router", "disaggregated-router")
TARGET_MS = {"disaggregated": 4.0, "colocated": 2.0}  # by mode: a *-router stack has its mode's target
PHASE_LABELS = {"client_gateway": "client↔gateway", "queue": "queue", "route": "route", "reserve": "reserve",
                "prefill_dispatch": "prefill dispatch", "start_decode": "start decode",
                "first_token": "first token"}
# the CPU table's columns: the client, the server's processes along a request's way, then its log
CPU_GROUPS = ("client", "floor server", "gateway", "router", "coordinator", "workers", "recorder", "NATS",
              "Postgres")
HOP_LABELS = {"http": "HTTP → gateway.request", "submit": "→ coordinator (Submit)",
              "claim": "→ run (lease claim, RequestReceived stored)", "dispatch": "→ prefill command",
              "command": "→ worker handler", "handler": "→ forward"}


@contextlib.contextmanager
def floor_server(log: Path) -> Iterator[tuple[str, int]]:
    """The bare FastAPI SSE server in a process of its own; yields its URL and pid."""
    port = free_port()
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-c", "from pdserve.bench.sse_floor import main; main()",
                                 str(port)], stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the floor server exited with {proc.returncode}; see {log}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise TimeoutError(f"the floor server did not answer in 60 s; see {log}")
            time.sleep(0.2)
        yield url, proc.pid
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def one_run(url: str, database_url: str | None, n: int, input_len: int, output_len: int,
                  concurrency: int, seed: int, meter: CpuMeter, trace_dir: Path | None = None) -> dict:
    """`n` random prompts at `concurrency`; per request the client TTFT and the CPU each of the server's
    processes spent (`meter`), and for a pdserve stack the overhead rows joined from its event log and
    the hops from its spans under `trace_dir`."""
    samples = random_dataset(n, input_len, output_len, seed=seed)
    load = LoadSpec(max_concurrency=concurrency, seed=seed, read_timeout_s=120.0)
    cpu_before, t0 = meter.read(), time.monotonic()
    result = await run_load(url, samples, load, progress=True)
    wall_s, cpu_after = time.monotonic() - t0, meter.read()
    cpu_s = sum(cpu_after.values()) - sum(cpu_before.values())
    ok = [r for r in result.records if r.success]
    out: dict = {"client_ttft_s": [r.ttft_s for r in ok], "failed": len(result.records) - len(ok),
                 "errors": sorted({r.error[:200] for r in result.records if not r.success})[:3],
                 "cpu_ms_per_request": CpuMeter.per_request(cpu_before, cpu_after, len(result.records)),
                 # the share of the machine's cores these processes kept busy
                 "busy": cpu_s / (wall_s * (os.cpu_count() or 1)),
                 "wall_s": wall_s}
    if database_url:
        ids = [r.request_id for r in ok if r.request_id]
        breakdowns = await fetch_breakdowns(database_url, ids)
        prefill = await fetch_worker_prefill_s(database_url, ids)
        out["rows"] = request_overheads(ok, breakdowns, prefill)
    if trace_dir is not None:
        await asyncio.sleep(SPAN_EXPORT_WAIT_S)
        out["hops"] = list(request_hops(load_spans(trace_dir).spans,
                                        [r.request_id for r in ok if r.request_id]).values())
    return out


def summarise_all(results: dict) -> dict:
    """Per concurrency and stack: overhead vs the floor over all rounds, and the per-round p50 gaps."""
    summary: dict = {}
    for conc, rounds in results["runs"].items():
        floor = [t for r in rounds for t in r.get("floor", {}).get("client_ttft_s", [])]
        summary[conc] = {"floor_p50_ms": statistics.median(floor) * 1e3 if floor else None}
        for name in results["servers"]:
            if name == "floor":
                continue
            rows = [row for r in rounds for row in r.get(name, {}).get("rows", [])]
            s = summarise(rows, floor)
            per_round = []
            for r in rounds:
                if name in r and "floor" in r and r[name].get("rows"):
                    one = summarise(r[name]["rows"], r["floor"]["client_ttft_s"])
                    per_round.append(one["above_floor_p50_ms"])
            s["above_floor_p50_ms_rounds"] = per_round
            s["failed"] = sum(r.get(name, {}).get("failed", 0) for r in rounds)
            s.update(cpu_summary([r[name] for r in rounds if name in r]))
            hops = [h for r in rounds for h in r.get(name, {}).get("hops", [])]
            if hops:
                s["hops_requests"] = len(hops)
                s["hops_p50_ms"] = {k: statistics.median(h[k] for h in hops) * 1e3 for k in HOPS}
                s["hops_mean_ms"] = {k: statistics.fmean(h[k] for h in hops) * 1e3 for k in HOPS}
            summary[conc][name] = s
        if floor_runs := [r["floor"] for r in rounds if "floor" in r]:
            summary[conc]["floor"] = cpu_summary(floor_runs)
    return summary


def cpu_summary(runs: list[dict]) -> dict:
    """CPU ms per request of each process group and the machine's busy share, mean over `runs` (rounds)."""
    runs = [r for r in runs if "cpu_ms_per_request" in r]
    if not runs:
        return {}
    names = dict.fromkeys(n for r in runs for n in r["cpu_ms_per_request"])
    return {"cpu_ms_per_request": {n: statistics.fmean(r["cpu_ms_per_request"].get(n, 0.0) for r in runs)
                                   for n in names},
            "busy": statistics.fmean(r["busy"] for r in runs)}


def _rounded(x):
    """Floats to 7 decimals (0.1 µs of a time in seconds), so the per-request JSON stays small."""
    if isinstance(x, float):
        return round(x, 7)
    if isinstance(x, dict):
        return {k: _rounded(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_rounded(v) for v in x]
    return x


def target_ms(stack: str) -> float:
    """Issue 14's target for `stack` (its mode's: `colocated-router` has colocated's), ms above the floor."""
    return TARGET_MS[stack.partition("-")[0]]


def write_reports(results: dict, out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    summary = summarise_all(results)
    results["summary"] = summary
    paths = [out / "control_plane.json", out / "control_plane.md", out / "control_plane.png"]
    paths[0].write_text(json.dumps(_rounded(results), indent=1))
    meta = results["meta"]
    stacks = [s for s in results["servers"] if s != "floor"]
    f1 = lambda v: "–" if v is None else f"{v:.1f}"  # noqa: E731
    lines = [
        "# Control-plane overhead above the HTTP floor", "",
        f"Generated by `{meta['command']}` on {meta['when']} ({meta['machine']}; commit {meta['commit']}): "
        f"model tiny, {meta['rounds']} rounds × {meta['num_prompts']} random prompts of {meta['input_len']} "
        f"tokens ({meta['output_len']} output tokens) per concurrency and server. Load average (1 min) at "
        f"start / end {meta['loadavg'][0]:.2f} / {meta.get('loadavg_end', [float('nan')])[0]:.2f} "
        "(shared 2-core machine).", "",
        "- **overhead** = client TTFT − the prefill worker's forward (`PrefillCompleted.prefill_s`) − "
        "exposed transfer (the coordinator's breakdown), per request. **floor** = client TTFT of a bare "
        "FastAPI SSE server (one chunk streamed at once, uvicorn as the gateway runs it) with the same "
        "client, concurrency and run. **above floor** = overhead percentile − floor percentile (all "
        "rounds pooled; in brackets each round's p50 gap). A stack named *-router is the same stack with "
        "a router service (`--routers 1`) that the coordinator asks for each placement, where the others "
        "place in the coordinator's process.",
        "- Phases (p50 / mean ms) add up to the overhead in the mean: client↔gateway = client TTFT − the "
        "server's TTFT (which ends when the first token leaves the decode worker): HTTP in and the "
        "gateway's work before its receive stamp, then the token's way back (worker → NATS → gateway → "
        "SSE → client); queue = gateway receive → coordinator starts routing; route, reserve = those "
        "round trips; prefill dispatch = the coordinator's prefill phase − the worker's forward; start "
        "decode = colocated only: the StartDecode hop, which the breakdown books as exposed transfer when no "
        "KV moves (for disaggregated it sits in first token); first "
        "token = transfer done → first token leaves the decode worker.", "",
        "| concurrency | stack | overhead p50 / p99 ms | floor p50 / p99 ms | above floor p50 ms (rounds) "
        "| above floor p99 ms | target p50 | forward p50 ms | failed |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for conc, by in summary.items():
        for name in stacks:
            s = by[name]
            rounds = ", ".join(f"{x:.1f}" for x in s["above_floor_p50_ms_rounds"])
            target = target_ms(name)
            met = "met" if s["above_floor_p50_ms"] <= target else "NOT met"
            lines.append(
                f"| {conc} | {name} | {f1(s['overhead_p50_ms'])} / {f1(s['overhead_p99_ms'])} | "
                f"{f1(s['floor_p50_ms'])} / {f1(s['floor_p99_ms'])} | **{f1(s['above_floor_p50_ms'])}** "
                f"({rounds}) | {f1(s['above_floor_p99_ms'])} | ≤ {target:.0f} ({met}) | "
                f"{f1(s['forward_p50_ms'])} | {s['failed']} |")
    lines += ["", "Where the overhead goes (p50 / mean ms per phase):", "",
              "| concurrency | stack | " + " | ".join(PHASE_LABELS[p] for p in PHASES) + " | overhead mean |",
              "|---|---|" + "---|" * (len(PHASES) + 1)]
    for conc, by in summary.items():
        for name in stacks:
            s = by[name]
            cells = " | ".join(f"{s['phases_p50_ms'][p]:.2f} / {s['phases_mean_ms'][p]:.2f}" for p in PHASES)
            lines.append(f"| {conc} | {name} | {cells} | {s['overhead_mean_ms']:.2f} |")
    hop_rows = [(conc, name, by[name]) for conc, by in summary.items() for name in stacks
                if "hops_p50_ms" in by[name]]
    if hop_rows:
        lines += ["", "The same way hop by hop, from the start of one span of the request's trace to the "
                  "start of the next (p50 / mean ms; libs/pdserve/bench/hops.py says what each holds): a hop "
                  "between two services holds the message, the receiver waking up and its decoding.", "",
                  "| concurrency | stack | " + " | ".join(HOP_LABELS[h] for h in HOPS) + " | requests |",
                  "|---|---|" + "---|" * (len(HOPS) + 1)]
        for conc, name, s in hop_rows:
            cells = " | ".join(f"{s['hops_p50_ms'][h]:.2f} / {s['hops_mean_ms'][h]:.2f}" for h in HOPS)
            lines.append(f"| {conc} | {name} | {cells} | {s['hops_requests']} |")
    if cpu_rows := [(conc, name, by[name]) for conc, by in summary.items() for name in results["servers"]
                    if by.get(name, {}).get("cpu_ms_per_request")]:
        seen = {g for *_, s in cpu_rows for g in s["cpu_ms_per_request"]}
        groups = [g for g in CPU_GROUPS if g in seen] + sorted(seen - set(CPU_GROUPS))
        lines += ["", "CPU each process spent per request (ms, user + system, all its threads; mean over "
                  "rounds; libs/pdserve/bench/cpu_time.py), and the share of the machine's cores all of them "
                  "kept busy during the load: on two cores, the time a process waits for one is part of "
                  "every hop after it. The workers' time holds the forward; NATS and Postgres are the "
                  "machine's own when the stacks use them (the idle stacks' heartbeats count too).", "",
                  "| concurrency | server | " + " | ".join(groups) + " | all | machine busy |",
                  "|---|---|" + "---|" * (len(groups) + 2)]
        for conc, name, s in cpu_rows:
            cpu = s["cpu_ms_per_request"]
            cells = " | ".join(f"{cpu[g]:.1f}" if g in cpu else "–" for g in groups)
            lines.append(f"| {conc} | {name} | {cells} | {sum(cpu.values()):.1f} | {s['busy']:.0%} |")
    if floors := results.get("bus_floor"):
        raw = " / ".join(f"{f['raw_round_trip_p50_ms']:.2f}" for f in floors)
        typed = " / ".join(f"{f['typed_round_trip_p50_ms']:.2f}" for f in floors)
        path = {stack: " and ".join(f"{f[f'critical_path_ms_raw_{stack}']:.1f}–"
                                    f"{f[f'critical_path_ms_typed_{stack}']:.1f}" for f in floors)
                for stack in CRITICAL_PATH_MESSAGES}
        lines += ["", "The bus under it, measured in the same run (before / after the rounds; "
                  "libs/pdserve/bench/bus_floor.py): one NATS request/reply between two processes takes "
                  f"{raw} ms p50 bare (nats-py) and {typed} ms typed (`Bus.request` → `Bus.serve`). A "
                  "request's way to its first token is "
                  f"{CRITICAL_PATH_MESSAGES['disaggregated']} one-way messages through NATS disaggregated "
                  "(Submit, the lease claimed and acked while the route is asked and the RequestReceived "
                  "stored, reserve, "
                  f"prefill, the first token) and {CRITICAL_PATH_MESSAGES['colocated']} colocated (the "
                  "prefill command reserves), so the messages alone put **"
                  f"{path['disaggregated']} ms** disaggregated and **{path['colocated']} ms** colocated "
                  "(before and after the rounds, bare–typed) above the HTTP floor before any service does "
                  "any work: the colocated target (≤ 2 ms) is at "
                  "or under that floor on this machine with these hops, and meeting it takes fewer hops, "
                  "not faster ones."]
    paths[1].write_text("\n".join(lines) + "\n")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    concs = list(summary)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    ax = axes[0]
    width = 0.8 / max(1, len(stacks))
    for j, name in enumerate(stacks):
        xs = [i + j * width for i in range(len(concs))]
        bars = ax.bar(xs, [summary[c][name]["above_floor_p50_ms"] for c in concs], width, label=f"{name} p50")
        ax.bar_label(bars, fmt="%.1f", fontsize=8)
        ax.scatter(xs, [summary[c][name]["above_floor_p99_ms"] for c in concs], marker="_", s=300, c="k")
        for x, name_target in zip(xs, [target_ms(name)] * len(xs), strict=True):
            ax.hlines(name_target, x - width / 2, x + width / 2, colors="r", linestyles="--")
    ax.set_xticks([i + width * (len(stacks) - 1) / 2 for i in range(len(concs))], [f"c={c}" for c in concs])
    ax.set_ylabel("overhead − floor (ms)")
    ax.set_title("above the FastAPI SSE floor (bars p50, black p99, red target)", fontsize=9)
    ax.legend(fontsize=8)
    ax = axes[1]
    labels, bottoms = [], None
    groups = [(c, n) for c in concs for n in stacks]
    import numpy as np

    bottoms = np.zeros(len(groups))
    for p in PHASES:
        vals = np.array([summary[c][n]["phases_mean_ms"][p] for c, n in groups])
        ax.bar(range(len(groups)), vals, bottom=bottoms, label=PHASE_LABELS[p])
        bottoms += vals
    labels = [f"{n[:5]} c={c}" for c, n in groups]
    ax.set_xticks(range(len(groups)), labels, fontsize=8)
    ax.set_ylabel("mean ms")
    ax.set_title("overhead by phase (mean)", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(paths[2], dpi=110)
    plt.close(fig)
    return paths


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join(__doc__.splitlines()[1:]))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--num-prompts", type=int, default=100, help="requests per round, concurrency and server")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=8)
    ap.add_argument("--servers", nargs="+", choices=SERVERS, default=list(SERVERS))
    ap.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    ap.add_argument("--var-dir", type=Path, default=Path("var/bench/control_plane"))
    ap.add_argument("--from-json", type=Path, help="re-render the reports from an earlier run's JSON")
    args = ap.parse_args()
    if args.from_json:
        for p in write_reports(json.loads(args.from_json.read_text()), args.out):
            console.print(f"wrote {p}")
        return 0
    if "floor" not in args.servers:
        ap.error("the floor is what every figure is measured against: keep it in --servers")
    var_dir = args.var_dir.resolve()
    var_dir.mkdir(parents=True, exist_ok=True)
    results: dict = {
        "meta": {"command": "python benchmarks/control_plane.py " + " ".join(sys.argv[1:]),
                 "when": time.strftime("%Y-%m-%d %H:%M"),
                 "machine": f"{cpu_model()}, {os.cpu_count()} cores",
                 "commit": code_commit(), "rounds": args.rounds, "num_prompts": args.num_prompts,
                 "input_len": args.input_len, "output_len": args.output_len, "loadavg": os.getloadavg()},
        "servers": list(args.servers), "runs": {str(c): [] for c in args.concurrency},
    }
    results["bus_floor"] = [measure_bus_floor(var_dir)]  # again after the rounds: the machine drifts
    with contextlib.ExitStack() as up:
        urls: dict[str, str] = {}
        dbs: dict[str, str | None] = {}
        traces: dict[str, Path] = {}  # a pdserve stack's span files (the floor has none)
        meters: dict[str, CpuMeter] = {}
        for name in args.servers:
            t0 = time.monotonic()
            if name == "floor":
                (urls[name], pid), dbs[name] = up.enter_context(floor_server(var_dir / "floor.log")), None
                meters[name] = process_meter(pid, "floor server")
            else:
                mode, _, placement = name.partition("-")
                routers = ("--routers", "1") if placement == "router" else ()
                stack = up.enter_context(pdserve_stack(mode, "tiny", var_dir / name, up_args=routers))
                urls[name], dbs[name] = stack.state.gateway_url, stack.state.database_url or None
                traces[name] = stack.var_dir / "traces"
                meters[name] = stack_meter(stack.state)
                if not dbs[name]:
                    raise RuntimeError(f"the {name} stack reports no database: the breakdown cannot be read")
            # (the floor streams one token, not the warm-up's eight: it needs no warming)
            if name != "floor" and (err := asyncio.run(warm_up(urls[name]))) is not None:
                raise RuntimeError(f"{name} did not serve the warm-up requests: {err}")
            console.print(f"{name} up at {urls[name]} in {time.monotonic() - t0:.0f} s")
        for r in range(args.rounds):
            for ci, conc in enumerate(args.concurrency):
                entry: dict = {"_order": round_order(args.servers, r, ci)}
                for name in entry["_order"]:
                    console.print(f"round {r + 1}/{args.rounds} concurrency {conc}: [bold]{name}[/]")
                    entry[name] = asyncio.run(one_run(urls[name], dbs[name], args.num_prompts, args.input_len,
                                                      args.output_len, conc, seed=1000 * r + ci,
                                                      meter=meters[name], trace_dir=traces.get(name)))
                    entry[name]["loadavg_1min_after"] = os.getloadavg()[0]
                results["runs"][str(conc)].append(entry)
                results["meta"]["loadavg_end"] = os.getloadavg()
                write_reports(results, args.out)
    results["bus_floor"].append(measure_bus_floor(var_dir))
    for p in write_reports(results, args.out):
        console.print(f"wrote {p}")
    console.print((args.out / "control_plane.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
