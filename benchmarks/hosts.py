"""KV transfer and TTFT between hosts: SmolLM2 on three network-namespace hosts, each host's outgoing
packets delayed by 0 / 1 / 2 / 5 ms.

    python benchmarks/hosts.py [--delays 0 1 2 5] [--rounds 5] [--prompt-tokens 512] [--out docs/benchmarks]

The stack is must-show 1's (tests/hosts): recorder, router, coordinator and gateway on `control`,
prefill-0 on `prefill`, decode-0 on `decode`, one NATS server per host clustered (events stream on 3
replicas), Postgres relayed onto the bridge, the KV over UCX on TCP between the prefill and the decode
host's addresses. A delay d applies to every packet leaving every host (netem where the kernel has it,
else an NFQUEUE delayer, tests/hosts/netns.py), so host to host is d one-way, 2d a round trip, measured
each time (median TCP connect from the prefill host to the decode host = one round trip).

Rounds are interleaved: round i measures every delay once, the order rotated every round, each with a
fresh prompt of random token ids (no prefix hit) as a one-token completion, so the delays of a round are
a sample paired in time; every figure is reported beside its ratio to the 0 ms delay of the same run.
TTFT and its phases are the coordinator's `RequestCompleted.ttft`; the transfer tail is
`TransferCompleted.ts − PrefillCompleted.ts` (the decode worker holds every layer verified that long
after the prefill worker's compute ended; negative: before), `transfer_s` the decode worker's own
`TransferCompleted.transfer_s` (first chunk expected → last verified). Writes hosts.json, .md and .png.
Needs root (network namespaces).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pdserve.config import CommonSettings  # noqa: E402
from pdserve.store.migrate import create_database, drop_database, upgrade  # noqa: E402
from tests.hosts.conftest import _target, relayed  # noqa: E402
from tests.hosts.nats_cluster import CLIENT_PORT, NatsCluster  # noqa: E402
from tests.hosts.netns import Hosts, netem_available, unavailable  # noqa: E402
from tests.hosts.stack import HostStack  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"
PHASES = ("queue_s", "route_s", "reserve_s", "prefill_s", "exposed_transfer_s", "first_token_s")
_RTT = ("import socket, statistics, sys, time\nts = []\nfor _ in range(15):\n t = time.perf_counter()\n"
        " socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=2).close()\n"
        " ts.append(time.perf_counter() - t)\nprint(statistics.median(ts))")


def rtt_s(hosts: Hosts) -> float:
    """Median TCP connect time from the prefill host to the decode host's NATS port: one round trip."""
    out = hosts["prefill"].run([sys.executable, "-c", _RTT, hosts["decode"].address, str(CLIENT_PORT)])
    return float(out.stdout)


def lifecycle(url: str, request_id: str, timeout_s: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        r = httpx.get(f"{url}/v1/requests/{request_id}", timeout=10)
        if r.status_code == 200:
            events = r.json()["events"]
            by = {e["type"]: e for e in events}
            if "RequestCompleted" in by and "TransferCompleted" in by and "PrefillCompleted" in by:
                return {"ttft": by["RequestCompleted"]["payload"]["ttft"],
                        "mode": by["RequestRouted"]["payload"]["mode"],
                        "transfer_s": by["TransferCompleted"]["payload"]["transfer_s"],
                        "kv_bytes": by["TransferCompleted"]["payload"]["kv_bytes"],
                        "tail_s": by["TransferCompleted"]["ts"] - by["PrefillCompleted"]["ts"]}
        time.sleep(0.3)
    raise TimeoutError(f"lifecycle of {request_id} not recorded in {timeout_s} s")


def one_request(stack: HostStack, prompt: list[int]) -> dict:
    t = time.perf_counter()
    r = httpx.post(f"{stack.url}/v1/completions", timeout=300, json={
        "model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0, "ignore_eos": True})
    r.raise_for_status()
    client_s = time.perf_counter() - t
    return {**lifecycle(stack.url, r.headers["x-request-id"]), "client_s": client_s}


def run(args) -> dict:
    from tqdm import tqdm

    admin = os.environ.get("PDS_TEST_DATABASE_URL", "postgresql+asyncpg://postgres@127.0.0.1:5432/postgres")
    work = (ROOT / "var" / "bench" / "hosts").resolve()
    subprocess.run(["rm", "-rf", str(work)], check=True)
    work.mkdir(parents=True)
    hosts = Hosts.create(["control", "prefill", "decode"])
    relay = db = None
    raw: dict[str, list[dict]] = {f"{d:g}": [] for d in args.delays}
    try:
        cluster = NatsCluster(list(hosts), work / "nats", f"pds{hosts.tag}").start()
        relay = subprocess.Popen([sys.executable, "-m", "tests.hosts.relay", hosts.gateway_address,
                                  _target(admin)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
        relay_port = int(relay.stdout.readline().split()[1])
        db = f"pdserve_bench_hosts_{hosts.tag}"
        url = create_database(admin, db)
        upgrade(url)
        settings = CommonSettings(nats_url=cluster.url, subject_prefix=f"bh{hosts.tag}",
                                  database_url=relayed(url, (hosts.gateway_address, relay_port)),
                                  events_stream=f"PDS_EVENTS_bh{hosts.tag}", events_replicas=3, var_dir=work)
        stack = HostStack(settings, work / "stack", hosts, model=args.model)
        rng = random.Random(0)
        try:
            stack.start(timeout_s=300)
            one_request(stack, [rng.randrange(1000, 40000) for _ in range(64)])  # warm-up
            with tqdm(total=args.rounds * len(args.delays), desc="requests") as bar:
                for i in range(args.rounds):
                    prompts = [rng.randrange(1000, 40000) for _ in range(args.prompt_tokens)]
                    k = i % len(args.delays)
                    for d in args.delays[k:] + args.delays[:k]:
                        hosts.set_delay_ms(d)
                        rtt = rtt_s(hosts)
                        # the same length, not the same tokens: a repeat would be a prefix-cache hit
                        prompt = [(t + int(d * 7919)) % 40000 + 1000 for t in prompts]
                        raw[f"{d:g}"].append({**one_request(stack, prompt), "rtt_s": rtt})
                        bar.update()
        finally:
            hosts.set_delay_ms(0)
            stack.stop()
            cluster.stop()
    finally:
        if relay is not None:
            relay.terminate()
            relay.wait(10)
        hosts.destroy()
        if db is not None:
            drop_database(admin, db)
    return raw


def summarise(raw: dict[str, list[dict]], delays: list[float]) -> list[dict]:
    med = statistics.median
    rows = []
    for d in delays:
        pts, base = raw[f"{d:g}"], raw[f"{delays[0]:g}"]
        row = {"delay_ms": d, "rtt_ms": med(p["rtt_s"] for p in pts) * 1e3,
               "mode": sorted({p["mode"] for p in pts}), "kv_bytes": int(med(p["kv_bytes"] for p in pts))}
        for key in ("client_s", "transfer_s", "tail_s"):
            row[key] = med(p[key] for p in pts)
        row["ttft_s"] = med(p["ttft"]["ttft_s"] for p in pts)
        for phase in PHASES:
            row[phase] = med(p["ttft"][phase] for p in pts)
        # paired ratios: each round's value over the same round's 0 ms value, then the median
        for key, get in (("ttft_s", lambda p: p["ttft"]["ttft_s"]), ("transfer_s", lambda p: p["transfer_s"]),
                         ("client_s", lambda p: p["client_s"])):
            row[f"{key}_ratio"] = med(get(p) / get(b) for p, b in zip(pts, base, strict=True))
        control = lambda p: sum(p["ttft"][k] for k in ("queue_s", "route_s", "reserve_s"))  # noqa: E731
        row["control_s"] = med(control(p) for p in pts)
        row["control_s_ratio"] = med(control(p) / control(b) for p, b in zip(pts, base, strict=True))
        row["ttft_diff_s"] = med(p["ttft"]["ttft_s"] - b["ttft"]["ttft_s"]
                                 for p, b in zip(pts, base, strict=True))
        rows.append(row)
    return rows


def write_reports(rows: list[dict], raw: dict, meta: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "hosts.json").write_text(json.dumps({"meta": meta, "rows": rows, "raw": raw}, indent=2))
    ms = lambda s: f"{s * 1e3:.1f}"  # noqa: E731
    base = rows[0]["delay_ms"]
    lines = [
        "# KV transfer and TTFT between hosts",
        "",
        f"Generated by `python benchmarks/hosts.py --rounds {meta['rounds']} --prompt-tokens "
        f"{meta['prompt_tokens']}` on {meta['when']} ({meta['machine']}), model {meta['model']}: control "
        "plane, prefill worker and decode worker on three network-namespace hosts (tests/hosts), a 3-server "
        "NATS cluster across them, KV over UCX on TCP between the prefill and the decode host. Each "
        f"point: median of {meta['rounds']} one-token requests of {meta['prompt_tokens']} fresh random "
        "tokens, rounds interleaved across the delays (order rotated each round); ratios are paired per "
        f"round against the {base:g} ms delay of the same run. Link delay by {meta['delay_method']}. Load "
        "average (1 min) {:.2f} before, {:.2f} after (shared machine).".format(*meta["load_avg_1min"]),
        "",
        "- **delay** = added to every packet leaving every host (one-way host to host); **RTT** = measured "
        "median TCP connect prefill host → decode host (one round trip, ≈ 2 × delay + the delayer's own "
        "latency where it is the NFQUEUE one).",
        "- **TTFT** and its phases = the coordinator's `RequestCompleted.ttft` (gateway receive → first "
        "token); **exposed transfer** its `exposed_transfer_s`; **tail** = `TransferCompleted.ts − "
        "PrefillCompleted.ts` (negative: the decode worker held the whole KV, verified, before the prefill "
        "worker had its first token); **transfer** = the decode worker's `TransferCompleted.transfer_s`; "
        "**control plane** = queue + route + reserve, the phases made only of hops between hosts.",
        "- Every control-plane hop (gateway → coordinator → router, reserve, prefill dispatch) crosses "
        "hosts too, and each JetStream publish waits for a replica on another host: the TTFT difference is "
        "the delay paid by those round trips, not by the transfer, which overlaps the prefill.",
        "",
        "| delay ms | RTT ms | KV MiB | TTFT ms (× 0 ms) | TTFT − TTFT(0 ms) ms | queue | route | reserve "
        "| prefill | exposed transfer | first token | control plane ms (× 0 ms) | tail ms "
        "| transfer ms (× 0 ms) | client ms (× 0 ms) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['delay_ms']:g} | {r['rtt_ms']:.2f} | {r['kv_bytes'] / 2**20:.1f} | {ms(r['ttft_s'])} "
            f"({r['ttft_s_ratio']:.2f}×) | {ms(r['ttft_diff_s'])} | "
            + " | ".join(ms(r[p]) for p in PHASES)
            + f" | {ms(r['control_s'])} ({r['control_s_ratio']:.2f}×) | {ms(r['tail_s'])}"
            f" | {ms(r['transfer_s'])} ({r['transfer_s_ratio']:.2f}×) | "
            f"{ms(r['client_s'])} ({r['client_s_ratio']:.2f}×) |")
    (out / "hosts.md").write_text("\n".join(lines) + "\n")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4.5))
    xs = [f"{r['delay_ms']:g} ms" for r in rows]
    bottom = [0.0] * len(rows)
    for phase in PHASES:
        vals = [r[phase] * 1e3 for r in rows]
        ax.bar(xs, vals, bottom=bottom, label=phase.removesuffix("_s").replace("_", " "))
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    ax.set_xlabel("added one-way delay between hosts")
    ax.set_ylabel("ms")
    ax.set_title("TTFT by phase (medians)")
    ax.legend(fontsize=8)
    ax2.plot([r["delay_ms"] for r in rows], [r["ttft_s_ratio"] for r in rows], marker="o", label="TTFT")
    ax2.plot([r["delay_ms"] for r in rows], [r["transfer_s_ratio"] for r in rows], marker="o",
             label="KV transfer_s")
    ax2.plot([r["delay_ms"] for r in rows], [r["control_s_ratio"] for r in rows], marker="o",
             label="control plane (queue + route + reserve)")
    ax2.set_xlabel("added one-way delay (ms)")
    ax2.set_ylabel(f"× the {base:g} ms delay, same run")
    ax2.set_title("ratio to no added delay")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "hosts.png", dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--delays", type=float, nargs="+", default=[0, 1, 2, 5], help="one-way ms; first = base")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    ap.add_argument("--from-json", type=Path, help="re-render the reports from an earlier run's JSON")
    args = ap.parse_args()
    if args.from_json:
        saved = json.loads(args.from_json.read_text())
        delays = [float(d) for d in saved["raw"]]
        write_reports(summarise(saved["raw"], delays), saved["raw"], saved["meta"], args.out)
        return
    if reason := unavailable():
        sys.exit(f"benchmarks/hosts.py: {reason}")
    load_before = os.getloadavg()[0]
    raw = run(args)
    meta = {"when": time.strftime("%Y-%m-%d %H:%M"),
            "machine": f"{platform.machine()}, {os.cpu_count()} cores",
            "model": args.model, "rounds": args.rounds, "prompt_tokens": args.prompt_tokens,
            "delay_method": "tc netem" if netem_available() else "NFQUEUE delayer (this kernel has no netem)",
            "load_avg_1min": [load_before, os.getloadavg()[0]]}
    rows = summarise(raw, args.delays)
    write_reports(rows, raw, meta, args.out)
    print((args.out / "hosts.md").read_text())


if __name__ == "__main__":
    main()
