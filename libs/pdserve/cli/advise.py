"""`pdserve advise`: which deployment stage (1-4) a stack's event log justifies, and the numbers behind
each step (`pdserve.advise`); `pdserve advise economics`: exercises A and E for a model.

The database is found as for `pdserve replay` (`--database-url`, `$PDS_DATABASE_URL`, the running stack's,
the default).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
from datetime import datetime
from pathlib import Path

from pydantic import ValidationError
from rich.table import Table
from sqlalchemy.exc import DBAPIError

from pdserve.advise.decide import Advice, Thresholds, advise
from pdserve.advise.economics import (
    CHECKLIST_PREFILL_TOK_S,
    H100_MEMORY_BYTES,
    Economics,
    economics,
    measure_prefill_s,
)
from pdserve.advise.evidence import DEFAULT_SLO_MS, client_itl_from_bench, load_events, measure
from pdserve.advise.models import ModelSpec, llama_3_70b, served_spec
from pdserve.advise.plot import plot_advice, plot_economics
from pdserve.cli.output import make_console
from pdserve.cli.replay import parse_since, resolve_database_url
from pdserve.config import ModelSettings, WorkerSettings
from pdserve.hardware.links import LINKS, link
from pdserve.store.queries import make_db

console = make_console()
THIS_MACHINE_LINK = "UCX shared memory (this machine)"


def model_spec(name: str, kv_dtype: str | None, weight_dtype: str | None) -> ModelSpec:
    """`llama-3-70b` (published config; FP8 KV and weights unless told), or a model pdserve serves (fp32)."""
    if name.lower() in ("llama-3-70b", "llama3-70b"):
        return llama_3_70b(kv_dtype or "fp8", weight_dtype or "fp8")
    return served_spec(name, ModelSettings().weights_cache_dir, kv_dtype or "fp32", weight_dtype or "fp32")


def host_accelerator_memory() -> tuple[float, str]:
    """This machine as a fleet: each core one 'accelerator' with an equal share of RAM (pdserve pins a pool
    to a core here), from os.sysconf."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    cores = os.cpu_count() or 1
    return total / cores, f"this machine: {total / 2**30:.1f} GiB RAM / {cores} cores (os.sysconf)"


def worker_shape() -> dict[str, int]:
    """Each replica's limits as a worker started in this environment runs them (`WorkerSettings`'
    defaults unless PDS_MAX_NUM_SEQS, PDS_MAX_NUM_BATCHED_TOKENS, PDS_KV_CAPACITY_TOKENS, PDS_BLOCK_SIZE
    say otherwise): the simulated replicas' `PoolConfig` limits."""
    fields = WorkerSettings.model_fields
    keys = ("max_num_seqs", "max_num_batched_tokens", "kv_capacity_tokens", "block_size")
    return {k: int(os.environ.get(f"PDS_{k.upper()}", fields[k].default)) for k in keys}


async def _load(url: str, since: datetime | None, until: datetime | None):
    db = make_db(url)
    try:
        return await load_events(db, since, until)
    finally:
        await db.dispose()


def print_advice(a: Advice) -> None:
    console.print(f"[bold]stage {a.stage}[/]: {a.verdict}")
    console.print(
        f"{a.requests} requests ({a.completed} completed) · "
        + ", ".join(f"{k} {v}" for k, v in sorted(a.modes.items()))
    )
    st = Table("stage", "", "status", "because", title="stages", title_justify="left", header_style="bold")
    for v in a.stages:
        st.add_row(str(v.stage), v.name, v.status, v.because)
    console.print(st)
    ct = Table(
        "stage", "question", "answer", "because", title="checks", title_justify="left", header_style="bold"
    )
    for c in a.checks:
        ct.add_row(str(c.stage), c.question, c.answer, c.because)
    console.print(ct)
    mt = Table(
        "measurement",
        "value",
        "unit",
        "n",
        "measured at",
        "note",
        title="measurements",
        title_justify="left",
        header_style="bold",
    )
    for x in a.measurements.values():
        v = "—" if x.value is None else f"{x.value:.4g}"
        mt.add_row(x.name, v, x.unit, str(x.samples or ""), x.source, x.note)
    console.print(mt)


def run_advise(args: argparse.Namespace) -> int:
    """Exit status: 0 done, 2 the database or the profile could not be read, 3 no request in the window."""
    hw = None
    if args.profile:
        from pdserve.sim.profile import Profile

        try:
            hw = Profile.read(args.profile).measured
        except (OSError, ValidationError) as e:
            console.print(f"[red]cannot read the profile {args.profile}: {type(e).__name__}: {e}[/red]")
            return 2
    url = resolve_database_url(args.database_url, args.var_dir)
    try:
        evts = asyncio.run(_load(url, args.since, args.until))
    except (DBAPIError, OSError) as e:
        console.print(f"[red]cannot read the event store at {url}: {type(e).__name__}: {e}[/red]")
        return 2
    if not evts:
        console.print("no request in the window: nothing to advise on")
        return 3
    itl = None
    if args.itl_from:
        itl = client_itl_from_bench(
            json.loads(Path(args.itl_from).read_text()), f"client ITL, pdserve bench serve ({args.itl_from})"
        )
    slo = {"ttft": args.slo_ttft_ms, "tpot": args.slo_tpot_ms}
    ev = measure(evts, itl, slo)
    memory, source = host_accelerator_memory()
    if args.accelerator_memory_gb:
        memory, source = args.accelerator_memory_gb * 1e9, "--accelerator-memory-gb"
    fleet = args.fleet or max(2, len(set(ev.prefill_workers) | set(ev.decode_workers)))
    if hw is not None:
        from pdserve.advise.whatif import with_split

        ev = with_split(ev, evts, hw, link(args.link), fleet, slo, worker_shape(), f"profile {args.profile}")
    a = advise(ev, model_spec(args.model, None, None), link(args.link), fleet, memory, source, Thresholds())
    if args.plot:
        plot_advice(a, Path(args.plot), title=args.title or "")
    if args.json:
        print(a.model_dump_json(indent=1))
    else:
        print_advice(a)
    return 0


def _prompt_lens(items: list[str]) -> list[tuple[str, int]]:
    out = []
    for item in items:
        label, _, n = item.rpartition("=")
        out.append((label or n, int(n)))
    return out


def print_economics(e: Economics) -> None:
    s = e.model
    console.print(
        f"[bold]{s.name}[/] ({s.family}): {s.kv_bytes_per_token} B/token KV over {s.num_paged_layers} "
        f"paged layers ({s.kv_dtype}), {s.state_bytes_per_request} B recurrent state per request, "
        f"{s.num_params:,} parameters = {s.weight_bytes / 1e9:.2f} GB ({s.weight_dtype}); {s.source}"
    )
    console.print(f"prefill: {e.prefill_source}")
    for p in e.prompts:
        t = Table(
            "link",
            "GB/s",
            "RDMA",
            "transfer ms",
            "layer-wise exposed ms",
            "prefill ms",
            "× prefill",
            "cheaper",
            title=f"{p.label}: {p.num_tokens} tokens, KV {p.kv_bytes / 1e6:.2f} MB "
            f"= {p.kv_bytes / 1024:,.0f} KiB + state {p.state_bytes / 1e3:.1f} kB",
            title_justify="left",
            header_style="bold",
        )
        for r in p.rows:
            t.add_row(
                r.link,
                f"{r.achievable_GB_s:g}",
                "yes" if r.rdma_class else "no",
                f"{r.transfer_s * 1e3:.2f}",
                f"{r.exposed_layerwise_s * 1e3:.3f}",
                f"{r.prefill_s * 1e3:.1f}",
                f"{r.transfer_over_prefill:.3f}",
                "yes" if r.cheaper_than_recompute else "no",
            )
        console.print(t)
    d = e.duplication
    console.print(
        f"weight duplication: {d.weight_bytes / 1e9:.2f} GB per copy, {d.accelerator_memory_bytes / 1e9:.0f} "
        f"GB per accelerator ({d.accelerator_source}); the second copy is ≤ {d.threshold:.0%} of the "
        f"fleet's memory from {d.fleet_for_threshold} accelerators"
    )
    t = Table("fleet", "weight copy share", header_style="bold")
    for r in d.rows:
        t.add_row(str(r.fleet_accelerators), f"{r.weight_share:.2%}")
    console.print(t)


def economics_for(args: argparse.Namespace) -> Economics:
    spec = model_spec(args.model, args.kv_dtype, args.weight_dtype)
    lens = _prompt_lens(
        args.prompt_lens or (["4000"] if spec.name == "Llama-3-70B" else ["p50=512", "p95=2048"])
    )
    if args.prefill_tok_s:
        rate, source = args.prefill_tok_s, f"{args.prefill_tok_s:g} tok/s (--prefill-tok-s)"
        prefill = [n / rate for _, n in lens]
    elif spec.name == "Llama-3-70B":
        rate = CHECKLIST_PREFILL_TOK_S
        source = f"{rate:g} tok/s, the checklist's Llama-3-70B recompute rate"
        prefill = [n / rate for _, n in lens]
    else:
        rate = None
        prefill = [measure_prefill_s(args.model, n, ModelSettings().weights_cache_dir) for _, n in lens]
        source = "measured here: this engine, fp32 CPU, one unchunked prefill (best of 2 after a warm-up)"
    links = [link(n) for n in args.links] if args.links else list(LINKS)
    kw = {}
    if args.accelerator_memory_gb:
        kw = {
            "accelerator_memory_bytes": args.accelerator_memory_gb * 1e9,
            "accelerator_source": "--accelerator-memory-gb",
        }
    return economics(spec, lens, prefill, rate, source, links, **kw)


def run_economics(args: argparse.Namespace) -> int:
    e = economics_for(args)
    if args.plot:
        plot_economics([e], Path(args.plot))
    if args.json:
        print(e.model_dump_json(indent=1))
    else:
        print_economics(e)
    return 0


def add_parsers(subparsers: argparse._SubParsersAction) -> None:
    """Register `advise` and `advise economics` on the `pdserve` command line."""
    p = subparsers.add_parser("advise", help="Which deployment stage (1-4) the event log justifies, and why.")
    p.add_argument(
        "--since",
        type=parse_since,
        default=None,
        help="Requests received at or after this time: ISO 8601 or an age (15m, 2h, 1d).",
    )
    p.add_argument("--until", type=parse_since, default=None, help="Requests received before this time.")
    p.add_argument(
        "--model",
        default=os.environ.get("PDS_MODEL", "smollm2"),
        help="the served model (its KV and weight bytes): smollm2, tiny, kimi-tiny, a directory",
    )
    p.add_argument(
        "--link",
        default=THIS_MACHINE_LINK,
        help=f"the interconnect a disaggregated deployment would use (default: {THIS_MACHINE_LINK}); "
        "one of: " + ", ".join(c.name for c in LINKS),
    )
    p.add_argument(
        "--fleet", type=int, default=None, help="accelerators in the fleet (default: workers seen)"
    )
    p.add_argument(
        "--accelerator-memory-gb",
        type=float,
        default=None,
        help="memory per accelerator (default: this machine's RAM per core)",
    )
    p.add_argument("--itl-from", default=None, help="a `pdserve bench serve` result JSON: its client ITL")
    p.add_argument(
        "--profile",
        type=Path,
        default=None,
        help="an engine profile (`pdserve profile --out`): simulate splitting the fleet on the log",
    )
    p.add_argument(
        "--slo-ttft-ms", type=float, default=DEFAULT_SLO_MS["ttft"], help="the SLO attainment's TTFT bound"
    )
    p.add_argument(
        "--slo-tpot-ms", type=float, default=DEFAULT_SLO_MS["tpot"], help="the SLO attainment's TPOT bound"
    )
    p.add_argument("--json", action="store_true", help="Print the advice as JSON.")
    p.add_argument("--plot", default=None, help="write a PNG of the advice here")
    p.add_argument("--title", default=None, help="the plot's title")
    p.add_argument("--database-url", default=None, help="SQLAlchemy asyncpg URL (default as pdserve replay).")
    p.add_argument("--var-dir", type=Path, default=None, help="Where to look for run/stack.json.")
    p.set_defaults(func=run_advise)
    sub = p.add_subparsers(dest="advise_what")
    e = sub.add_parser(
        "economics",
        help="Exercises A and E: KV transfer per link against prefill; weight "
        "duplication against fleet size.",
    )
    e.add_argument(
        "--model", default="llama-3-70b", help="llama-3-70b, smollm2, tiny, kimi-tiny or a directory"
    )
    e.add_argument(
        "--prompt-lens",
        nargs="+",
        metavar="[LABEL=]N",
        help="prompt lengths, e.g. p50=512 p95=2048 (default: 4000 for Llama-3-70B)",
    )
    e.add_argument(
        "--prefill-tok-s",
        type=float,
        default=None,
        help="prefill rate (default: the checklist's 28,000 for Llama-3-70B; measured here otherwise)",
    )
    e.add_argument("--kv-dtype", choices=("fp32", "bf16", "fp16", "fp8"), default=None)
    e.add_argument("--weight-dtype", choices=("fp32", "bf16", "fp16", "fp8"), default=None)
    e.add_argument("--links", nargs="+", default=None, help="link names (default: the whole table)")
    e.add_argument("--accelerator-memory-gb", type=float, default=None, help="default: H100 SXM's 80 GB")
    e.add_argument("--json", action="store_true")
    e.add_argument("--plot", default=None, help="write a PNG here")
    e.set_defaults(func=run_economics)


__all__ = ["H100_MEMORY_BYTES", "add_parsers"]
