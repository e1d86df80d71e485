"""Must-show of `pdserve advise`: three workloads on real stacks here, the stage advise names from each
stack's event log, and the measured comparison of the candidate stages on the same workload.

- chat (short in, long out) and RAG (10:1 in:out), SmolLM2: a colocated stack (stage 1: one pool, prefix
  caching, chunked prefill) and a disaggregated one (stage 3), each started by `pdserve up` as `pdserve bench
  compare` starts them (`bench.compare.StackRun`: each pool pinned to its own core), the same `bench serve`
  random workload against both. Advise reads the colocated stack's log (the baseline the method measures
  first) with the client's ITL and an engine profile taken at the start of the run
  (`benchmarks/pinned_profile.py`: `pdserve advise --profile`, the simulated split of the same fleet); the
  comparison is disaggregated ÷ colocated goodput at the SLO, TTFT and TPOT.
- agentic shared-prefix traffic (`shared_prefix`: each session a 1,024-token context of its own, 3 turns
  that grow it, short outputs), tiny model, one stack of 4 prefill replicas + 1 decode worker
  (`benchmarks/routing_stack.RoutingStack`): round robin (stage 3, no cache-aware routing) then kv routing
  (stage 4), each with its own seed (no prefix of one run is cached for the other). Advise reads the round
  robin window; the comparison is kv ÷ round robin hit rate and prefill tokens computed (TTFT beside it).

Agreement: advise's stage for the workload is the candidate the measurement favours (disaggregated wins
when its goodput is ≥ 1.1 × colocated's; kv routing wins when its hit rate is ≥ 1.1 × round robin's).

Writes docs/benchmarks/advise_workloads.{json,md,png} and the table between the markers of docs/advise.md.
Needs NATS and Postgres: PDS_TEST_NATS_URL / PDS_TEST_DATABASE_URL (defaults: the machine's own).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.pinned_profile import profile_here  # noqa: E402
from benchmarks.routing_stack import RoutingStack  # noqa: E402
from pdserve.advise.decide import Advice, advise  # noqa: E402
from pdserve.advise.evidence import ClientITL, load_events, measure  # noqa: E402
from pdserve.advise.plot import plot_advice  # noqa: E402
from pdserve.advise.whatif import with_split  # noqa: E402
from pdserve.bench.compare import CompareConfig, StackRun, code_commit, warm_up  # noqa: E402
from pdserve.bench.pinning import pin_pools  # noqa: E402
from pdserve.bench.serve import ServeConfig, run_serve  # noqa: E402
from pdserve.cli.advise import THIS_MACHINE_LINK, host_accelerator_memory, model_spec, worker_shape  # noqa: E402
from pdserve.config import CommonSettings  # noqa: E402
from pdserve.embedded import free_port  # noqa: E402
from pdserve.hardware.links import link  # noqa: E402
from pdserve.sim.profile import HardwareProfile  # noqa: E402
from pdserve.store.migrate import create_database, drop_database, upgrade  # noqa: E402
from pdserve.store.queries import make_db  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "benchmarks"
STEM = "advise_workloads"
SLO_MS = {"ttft": 2000.0, "tpot": 200.0}  # bench compare's; --slo-ttft-ms / --slo-tpot-ms to change
MARK_START, MARK_END = "<!-- advise-workloads:start -->", "<!-- advise-workloads:end -->"


async def window_advice(
    database_url: str,
    since: datetime,
    until: datetime,
    model: str,
    itl: ClientITL | None,
    hardware: HardwareProfile | None = None,
) -> Advice:
    """`pdserve advise` on the window's log (with `--profile`'s what-if when `hardware` is given)."""
    db = make_db(database_url)
    try:
        evts = await load_events(db, since, until)
    finally:
        await db.dispose()
    memory, source = host_accelerator_memory()
    ev = measure(evts, itl, SLO_MS)
    fleet = max(2, len(set(ev.prefill_workers) | set(ev.decode_workers)))
    shm = link(THIS_MACHINE_LINK)
    if hardware is not None:
        ev = with_split(ev, evts, hardware, shm, fleet, SLO_MS, worker_shape(), "pdserve profile, this run")
    return advise(ev, model_spec(model, None, None), shm, fleet, memory, source)


def summary(report) -> dict:
    m = report.metrics
    lat = {k: {"p50": d.median_ms, "p99": d.p(99)} for k, d in m.latency.items()}
    return {
        "completed": m.completed,
        "failed": m.failed,
        "duration_s": m.duration_s,
        "request_goodput": m.request_goodput,
        "request_throughput": m.request_throughput,
        "output_throughput": m.output_throughput,
        "latency_ms": lat,
        "itl_count": m.latency["itl"].count,
    }


def client_itl(report, label: str) -> ClientITL:
    d = report.metrics.latency["itl"]
    return ClientITL(
        p50_ms=d.median_ms,
        p99_ms=d.p(99),
        samples=d.count,
        source=f"client ITL, bench serve {label} (docs/benchmarks/{STEM}.json)",
    )


def advice_row(a: Advice) -> dict:
    return {
        "stage": a.stage,
        "verdict": a.verdict,
        "stages": [v.model_dump() for v in a.stages],
        "checks": [c.model_dump() for c in a.checks],
        "measurements": {k: v.model_dump() for k, v in a.measurements.items()},
    }


def run_pools(
    name: str, n_in: int, n_out: int, args, env: dict[str, str], tag: str, hardware: HardwareProfile
) -> dict:
    """One workload against a colocated and a disaggregated SmolLM2 stack; advise on each log, with the
    split what-if simulated on `hardware` (this run's engine profile)."""
    out: dict = {
        "workload": name,
        "model": args.model,
        "input_len": n_in,
        "output_len": n_out,
        "num_prompts": args.num_prompts,
        "request_rate": args.rate,
        "modes": {},
    }
    for mode in ("colocated", "disaggregated"):
        cfg = CompareConfig(model=args.model, port=free_port(), var_dir=ROOT / "var" / "bench-advise" / name)
        with StackRun(mode, cfg, env, f"{tag}{name[:3]}") as stack:
            state = stack.state
            if (error := asyncio.run(warm_up(state.gateway_url))) is not None:
                raise RuntimeError(f"{name} {mode}: warm-up failed: {error}")
            pin_pools(state)
            since = datetime.now(UTC)
            serve = ServeConfig(
                base_url=state.gateway_url,
                dataset="random",
                num_prompts=args.num_prompts,
                input_len=n_in,
                output_len=n_out,
                request_rate=args.rate,
                seed=args.seed,
                goodput_slo_ms=SLO_MS,
                percentiles=[50.0, 99.0],
                database_url=None,
                read_timeout_s=300.0,
            )
            report = asyncio.run(run_serve(serve, progress=False))
            time.sleep(1.5)  # the recorder's last batch reaches Postgres
            a = asyncio.run(
                window_advice(
                    state.database_url,
                    since,
                    datetime.now(UTC),
                    args.model,
                    client_itl(report, f"{name} {mode}"),
                    hardware,
                )
            )
            plot_advice(a, OUT / f"{STEM}-{name}-{mode}.png", title=f"{name}, {mode}: stage {a.stage}")
            out["modes"][mode] = {"bench": summary(report), "advice": advice_row(a)}
            s = out["modes"][mode]["bench"]
            print(
                f"{name} {mode}: goodput {s['request_goodput']:.3f} req/s, TTFT p50 "
                f"{s['latency_ms']['ttft']['p50']:.0f} ms, ITL p50/p99 {s['latency_ms']['itl']['p50']:.0f}/"
                f"{s['latency_ms']['itl']['p99']:.0f} ms; advise: stage {a.stage} ({a.verdict})",
                flush=True,
            )
    return judge_pools(out)


def judge_pools(out: dict) -> dict:
    """The measured winner between stage 1 (colocated) and stage 3 (disaggregated), and whether advise's
    stage-3 verdict on the colocated log picks it. Disaggregation wins at goodput ≥ 1.1 × colocated's; when
    neither stack met the SLO for a single request (goodput cannot tell them apart), it wins when its TTFT
    p50 and TPOT p50 are both ≤ 1/1.1 of colocated's."""
    co, di = (out["modes"][m]["bench"] for m in ("colocated", "disaggregated"))
    g_co, g_di = co["request_goodput"] or 0.0, di["request_goodput"] or 0.0
    lat = {k: di["latency_ms"][k]["p50"] / co["latency_ms"][k]["p50"] for k in ("ttft", "tpot")}
    out["latency_p50_ratio_disagg_over_colocated"] = lat
    if g_co > 0:
        out["goodput_ratio_disagg_over_colocated"] = g_di / g_co
        out["criterion"] = "goodput"
        wins = g_di / g_co >= 1.1
    elif g_di > 0:
        out["goodput_ratio_disagg_over_colocated"], out["criterion"], wins = float("inf"), "goodput", True
    else:
        out["goodput_ratio_disagg_over_colocated"] = None
        out["criterion"] = "TTFT p50 and TPOT p50 (no request of either stack met the SLO)"
        wins = lat["ttft"] <= 1 / 1.1 and lat["tpot"] <= 1 / 1.1
    out["measured_winner_stage"] = 3 if wins else 1
    s3 = next(v for v in out["modes"]["colocated"]["advice"]["stages"] if v["stage"] == 3)
    out["advised_stage"] = out["modes"]["colocated"]["advice"]["stage"]
    out["advised_between_1_and_3"] = 3 if s3["status"] == "warranted" else 1
    out["agree"] = out["advised_between_1_and_3"] == out["measured_winner_stage"]
    return out


def run_agentic(args) -> dict:
    admin_url = os.environ.get(
        "PDS_TEST_DATABASE_URL", "postgresql+asyncpg://postgres@127.0.0.1:5432/postgres"
    )
    nats_url = os.environ.get("PDS_TEST_NATS_URL", "nats://127.0.0.1:4222")
    tag = f"adv{uuid.uuid4().hex[:8]}"
    db = f"pdserve_bench_{tag}"
    settings = CommonSettings(
        nats_url=nats_url,
        var_dir=(ROOT / "var").resolve(),
        database_url=create_database(admin_url, db),
        subject_prefix=tag,
        events_stream=f"PDS_EVENTS_{tag}",
    )
    upgrade(settings.database_url)
    stack = RoutingStack(
        settings,
        (ROOT / "var" / "bench-advise" / "agentic").resolve(),
        model="tiny",
        mode="disaggregated",
        n_prefill=4,
        n_decode=1,
        capacity_tokens=32768,
    )
    out: dict = {"workload": "agentic", "model": "tiny", "prefill_replicas": 4, "policies": {}}
    try:
        stack.start(timeout_s=300)
        for i, policy in enumerate(("round_robin", "kv")):
            stack.restart_router(policy)
            since = datetime.now(UTC)
            serve = ServeConfig(
                base_url=stack.url,
                dataset="shared_prefix",
                num_prompts=args.conversations,
                num_turns=3,
                prefix_len=1024,
                input_len=48,
                output_len=8,
                num_prefixes=args.conversations,
                request_rate=args.agentic_rate,
                seed=args.seed + 100 + i,
                goodput_slo_ms=SLO_MS,
                percentiles=[50.0, 99.0],
                read_timeout_s=120.0,
                model=stack.served_model,
            )
            report = asyncio.run(run_serve(serve, progress=False))
            time.sleep(1.5)
            a = asyncio.run(window_advice(settings.database_url, since, datetime.now(UTC), "tiny", None))
            plot_advice(a, OUT / f"{STEM}-agentic-{policy}.png", title=f"agentic, {policy}: stage {a.stage}")
            out["policies"][policy] = {"bench": summary(report), "advice": advice_row(a)}
            m = a.measurements
            print(
                f"agentic {policy}: TTFT p50 {report.metrics.latency['ttft'].median_ms:.0f} ms, hit rate "
                f"{m['hit_rate'].value:.3f} / ceiling {m['router_ceiling_hit_rate'].value:.3f}; "
                f"advise: stage {a.stage} ({a.verdict})",
                flush=True,
            )
    finally:
        stack.stop()
        drop_database(admin_url, db)
    rr, kv = out["policies"]["round_robin"], out["policies"]["kv"]
    hit = {p: out["policies"][p]["advice"]["measurements"]["hit_rate"]["value"] for p in out["policies"]}
    ttft = {p: out["policies"][p]["bench"]["latency_ms"]["ttft"]["p50"] for p in out["policies"]}
    out["hit_rate_kv_over_rr"] = hit["kv"] / hit["round_robin"] if hit["round_robin"] else float("inf")
    out["ttft_p50_kv_over_rr"] = ttft["kv"] / ttft["round_robin"]
    computed = {
        p: out["policies"][p]["advice"]["measurements"]["computed_to_output_ratio"]["value"]
        for p in out["policies"]
    }
    out["computed_prefill_kv_over_rr"] = computed["kv"] / computed["round_robin"]
    # the stage's measured benefit is the prefill work it saves (TTFT of the tiny model is noise-bound here)
    out["measured_winner_stage"] = 4 if hit["kv"] >= 1.1 * hit["round_robin"] else 3
    out["advised_stage"] = rr["advice"]["stage"]
    out["agree"] = out["advised_stage"] == out["measured_winner_stage"]
    del kv
    return out


def markdown(results: dict) -> str:
    lines = [
        f"Generated by `{results['command']}` on {results['started_at']} (commit {results['commit']}; "
        f"{os.cpu_count()} cores, load average {results['loadavg_at_start'][0]:.2f} at start).",
        "",
        *[
            f"- {w['workload']}: `{w['run']['command']}` at {w['run']['started_at']} (load average "
            f"{w['run']['loadavg_at_start'][0]:.1f})"
            for w in results["workloads"]
            if "run" in w
        ],
        "",
        "| workload | stacks (model) | advise on the baseline's log | why (the checks that decided) | "
        "measured: candidate stages | measured favours | agree |",
        "|---|---|---|---|---|---|---|",
    ]
    for w in results["workloads"]:
        if w["workload"] == "agentic":
            rr, kv = w["policies"]["round_robin"], w["policies"]["kv"]
            m = rr["advice"]["measurements"]
            why = (
                f"4 replicas; hit rate {m['hit_rate']['value']:.1%} vs perfect-router ceiling "
                f"{m['router_ceiling_hit_rate']['value']:.1%} (gap {m['routing_gap_share']['value']:.1%} of "
                "prompt tokens)"
            )
            meas = (
                f"kv ÷ round robin: hit rate {w['hit_rate_kv_over_rr']:.2f}× "
                f"({kv['advice']['measurements']['hit_rate']['value']:.1%} vs {m['hit_rate']['value']:.1%}), "
                f"prefill tokens computed {w['computed_prefill_kv_over_rr']:.2f}×, "
                f"TTFT p50 {w['ttft_p50_kv_over_rr']:.2f}× "
                f"({kv['bench']['latency_ms']['ttft']['p50']:.0f} vs "
                f"{rr['bench']['latency_ms']['ttft']['p50']:.0f} ms)"
            )
            lines.append(
                f"| agentic: {rr['bench']['completed']} requests, 3 turns, a 1,024-token context per "
                "session | 4 prefill + 1 decode, "
                f"round robin then kv (tiny) | stage {w['advised_stage']} | {why} | {meas} | "
                f"stage {w['measured_winner_stage']} | {'yes' if w['agree'] else 'no'} |"
            )
            continue
        co, di = w["modes"]["colocated"], w["modes"]["disaggregated"]
        dl = di["bench"]["latency_ms"]
        m = co["advice"]["measurements"]
        answered = [c for c in co["advice"]["checks"] if c["stage"] == 3 and c["answer"] != "unknown"]
        decided = [c for c in answered if c["answer"] == "no"] or answered  # any "no" holds stage 3 back
        why = "; ".join(f"{c['question'].split('?')[0]}: {c['answer']} ({c['because']})" for c in decided)
        judge_pools(w)
        g = lambda b: b["request_goodput"] or 0.0  # noqa: E731
        ratio = w["goodput_ratio_disagg_over_colocated"]
        lat = w["latency_p50_ratio_disagg_over_colocated"]
        meas = (
            f"disaggregated ÷ colocated: goodput {'—' if ratio is None else f'{ratio:.2f}×'} "
            f"({g(di['bench']):.3f} vs {g(co['bench']):.3f} req/s at TTFT ≤ "
            f"{results['slo_ms']['ttft']:g} ms, "
            f"TPOT ≤ {results['slo_ms']['tpot']:g} ms); TTFT p50 {lat['ttft']:.2f}× "
            f"({dl['ttft']['p50']:.0f} vs {co['bench']['latency_ms']['ttft']['p50']:.0f} ms), TPOT p50 "
            f"{lat['tpot']:.2f}×; ITL p99/p50 {dl['itl']['p99'] / dl['itl']['p50']:.1f} vs "
            f"{m['itl_p99_over_p50']['value']:.1f}; decided on {w['criterion']}"
        )
        s3 = next(v for v in co["advice"]["stages"] if v["stage"] == 3)
        lines.append(
            f"| {w['workload']} ({w['input_len']} in : {w['output_len']} out, {w['num_prompts']} requests "
            f"at {w['request_rate']:g}/s) | colocated vs disaggregated ({w['model']}) | stage "
            f"{w['advised_stage']}; stage 3 {s3['status']} | {why} | {meas} | "
            f"stage {w['measured_winner_stage']} | "
            f"{'yes' if w['agree'] else 'no'} |"
        )
    return "\n".join(lines) + "\n"


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.5))
    names, vals, colours, labels = [], [], [], []
    for w in results["workloads"]:
        if w["workload"] == "agentic":
            names.append("agentic: kv ÷ rr\nhit rate")
            vals.append(w["hit_rate_kv_over_rr"])
            labels.append(f"{vals[-1]:.2f}×")
            names.append("agentic: rr ÷ kv\nTTFT p50")
            vals.append(1 / w["ttft_p50_kv_over_rr"])
            labels.append(f"{vals[-1]:.2f}×")
            colours += ["#2ca02c" if w["advised_stage"] == 4 else "#1f77b4"] * 2
        else:
            judge_pools(w)
            ratio = w["goodput_ratio_disagg_over_colocated"]
            if ratio is None:  # no goodput on either: the TTFT ratio, inverted so > 1 favours disaggregation
                names.append(f"{w['workload']}: coloc ÷ disagg\nTTFT p50 (no goodput)")
                vals.append(1 / w["latency_p50_ratio_disagg_over_colocated"]["ttft"])
                labels.append(f"{vals[-1]:.2f}×")
            else:
                names.append(f"{w['workload']}: disagg ÷ coloc\ngoodput")
                vals.append(min(ratio, 10.0))
                labels.append(f"{ratio:.2f}×" if ratio < 10 else "colocated: 0 req/s")
            colours.append("#d62728" if w["advised_between_1_and_3"] == 3 else "#1f77b4")
    ax.bar(names, vals, color=colours)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.axhline(1.1, color="grey", ls=":", lw=0.8)
    for i, (v, label) in enumerate(zip(vals, labels, strict=True)):
        ax.text(i, v, label, ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("candidate ÷ baseline (same run)")
    ax.set_title(
        "measured benefit of the next stage (> 1: it pays); colour = advise's pick (red 3, green 4, blue 1)",
        fontsize=9,
    )
    ax.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def merged(results: dict) -> dict:
    """`results` with the workloads of an earlier run's JSON that this run did not measure (kept with their
    own command and time: `runs`)."""
    path = OUT / f"{STEM}.json"
    if not path.exists():
        return results
    old = json.loads(path.read_text())
    mine = {w["workload"] for w in results["workloads"]}
    order = {"chat": 0, "rag": 1, "agentic": 2}
    keep = [w for w in old.get("workloads", []) if w["workload"] not in mine]
    for w in keep:
        w.setdefault("run", {k: old.get(k) for k in ("command", "started_at", "commit", "loadavg_at_start")})
    out = dict(results)
    out["workloads"] = sorted(keep + results["workloads"], key=lambda w: order.get(w["workload"], 9))
    return out


def write(results: dict) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"{STEM}.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    table = markdown(results)
    (OUT / f"{STEM}.md").write_text("# pdserve advise on three workloads\n\n" + table)
    plot(results, OUT / f"{STEM}.png")
    doc = ROOT / "docs" / "advise.md"
    if doc.exists():
        text = doc.read_text()
        if MARK_START in text and MARK_END in text:
            head, rest = text.split(MARK_START, 1)
            _, tail = rest.split(MARK_END, 1)
            doc.write_text(head + MARK_START + "\n" + table + MARK_END + tail)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model", default="smollm2", choices=("smollm2", "tiny"), help="chat and RAG stacks' model"
    )
    p.add_argument("--num-prompts", type=int, default=12)
    p.add_argument("--rate", type=float, default=1.0, help="chat and RAG request rate, req/s")
    p.add_argument(
        "--conversations",
        type=int,
        default=15,
        help="agentic conversations, 3 turns each (not a multiple of 4: round robin would then send "
        "every turn of a conversation to the same replica by accident)",
    )
    p.add_argument("--agentic-rate", type=float, default=6.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slo-ttft-ms", type=float, default=SLO_MS["ttft"])
    p.add_argument("--slo-tpot-ms", type=float, default=SLO_MS["tpot"])
    p.add_argument("--workloads", nargs="+", default=["chat", "rag", "agentic"])
    p.add_argument("--render", metavar="JSON", help="only re-render the Markdown and PNG of a results JSON")
    args = p.parse_args()
    if args.render:
        write(json.loads(Path(args.render).read_text()))
        return 0
    SLO_MS.update({"ttft": args.slo_ttft_ms, "tpot": args.slo_tpot_ms})
    env = {**os.environ}
    env.setdefault("PDS_NATS_URL", os.environ.get("PDS_TEST_NATS_URL", "nats://127.0.0.1:4222"))
    env.setdefault(
        "PDS_DATABASE_URL",
        os.environ.get("PDS_TEST_DATABASE_URL", "postgresql+asyncpg://postgres@127.0.0.1:5432/postgres"),
    )
    tag = uuid.uuid4().hex[:6]
    env.update({"PDS_SUBJECT_PREFIX": f"pdsadv{tag}", "PDS_EVENTS_STREAM": f"PDS_ADVISE_{tag}"})
    results = {
        "command": "python " + " ".join(["benchmarks/advise_workloads.py", *sys.argv[1:]]),
        "started_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "commit": code_commit(),
        "loadavg_at_start": os.getloadavg(),
        "slo_ms": SLO_MS,
        "workloads": [],
    }
    random.seed(args.seed)
    shapes = {"chat": (16, 160), "rag": (200, 20)}
    hardware = None
    if set(args.workloads) & set(shapes):
        print(f"pdserve profile of {args.model} (core 0)", flush=True)
        hardware = profile_here(ROOT / "var" / "bench-advise" / "profile.json", args.model).measured
    for name in args.workloads:
        if name == "agentic":
            results["workloads"].append(run_agentic(args))
        else:
            results["workloads"].append(run_pools(name, *shapes[name], args, env, tag, hardware))
        for w in results["workloads"]:
            w.setdefault(
                "run", {k: results[k] for k in ("command", "started_at", "commit", "loadavg_at_start")}
            )
        write(merged(results))
    for path in (f"{STEM}.json", f"{STEM}.md", f"{STEM}.png"):
        print(f"wrote docs/benchmarks/{path}")
    agree = sum(bool(w["agree"]) for w in results["workloads"])
    print(f"advise agrees with the measurement on {agree} of {len(results['workloads'])} workloads")
    return 0  # a disagreement is a result (docs/advise.md), not a failed run


if __name__ == "__main__":
    sys.exit(main())
