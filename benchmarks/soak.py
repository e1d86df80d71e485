"""A bounded chaos soak: greedy requests at a steady rate while a seeded schedule of faults fires.

    python benchmarks/soak.py [--requests 2000] [--rate 4] [--max-tokens 16] [--seed 7]
                              [--fault-every 20] [--out docs/benchmarks]

One stack of its own (tiny model; 2 prefill + 2 decode workers, 2 coordinators, 2 routers, recorder,
gateway) on an embedded NATS and an embedded Postgres that this script stops and starts itself
(`pdserve.embedded`). `--requests` streamed greedy completions (`ignore_eos`, exactly `--max-tokens`
tokens) go out open loop at `--rate` per second, each from one of `--prompts` distinct prompts; a client
whose stream breaks (its gateway died) resumes it with Last-Event-ID (tests/faults/load.py), and one whose
connection is refused before any response (no gateway listening) tries again for 30 s. Every
`--fault-every` seconds one fault from the schedule fires — drawn with `random.Random(--seed)` and printed
before the run, so a run can be repeated:

- `kill`: kill -9 of one service of the stack, drawn at random (workers, coordinators, routers, recorder,
  gateway), started again 1 s later under the same name (as `pdserve up`'s supervisor does);
- `postgres`: Postgres stopped for 10 s, then started;
- `nats`: kill -9 of one server of the NATS cluster, started again 5 s later (on one host without
  namespaces: the one NATS server, restarted at once);
- `link`: the prefill or the decode host's link cut for 5 s, then restored (namespace hosts only).

With root (`--hosts auto`, the default, where network namespaces can be made) the stack runs on three
test hosts (tests/hosts): control (gateway, recorder, coordinator, router), prefill (both prefill
workers, coordinator-1), decode (both decode workers, router-1), a 3-server NATS cluster across them
with the events stream and the lease bucket on 3 replicas, Postgres relayed onto their bridge.

Reported (soak.json, soak.md, soak.png under `--out`): requests completed / failed with a reason / hung
(no terminal event in the log and no answer: must be 0); events lost (messages in the JetStream stream
minus rows in Postgres's `events` once the recorder caught up: must be 0); completed outputs that differ
from the greedy reference (`tests/oracle.py`, one process, no transfer: the uninterrupted greedy run;
must be 0); and per fault kind the recovery time — from the fault until the first request submitted after
it completes — beside the latency of the requests in flight at the fault, as a ratio to the run's
undisturbed requests' median latency (requests that overlapped no fault window), measured in the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from rich.console import Console
from rich.table import Table
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdserve.bus import Bus  # noqa: E402
from pdserve.config import CommonSettings  # noqa: E402
from pdserve.embedded import EmbeddedServer, free_port, start_nats, start_postgres  # noqa: E402
from pdserve.events import TERMINAL_TYPES  # noqa: E402
from pdserve.store import queries  # noqa: E402
from pdserve.store.migrate import create_database, upgrade  # noqa: E402
from pdserve.store.queries import make_db  # noqa: E402
from pdserve.store.recorder import caught_up  # noqa: E402
from tests.e2e.stack import Stack  # noqa: E402
from tests.faults.load import Result, stream_one  # noqa: E402

console = Console()
KINDS = ("kill", "postgres", "nats", "link")
KIND_WEIGHTS = (5, 1, 2, 2)
KILL_DOWN_S = 1.0
PG_DOWN_S = 10.0
NATS_DOWN_S = 5.0
LINK_DOWN_S = 5.0
HOST_NAMES = ["control", "prefill", "decode"]
# On the namespace hosts, the second coordinator and router sit with the pools: a link cut isolates them too.
PLACEMENT = {"coordinator-1": "prefill", "router-1": "decode"}
CONNECT_RETRY_S = 30.0
WORDS = ("the sea", "a river", "the old house", "seven stones", "a quiet city", "the first snow",
         "my brother", "a letter", "the last train", "a small garden", "the north wind", "two birds",
         "the market")


@dataclass
class Fault:
    at_s: float  # seconds after the load started
    kind: str
    target: str = ""
    fired_ts: float = 0.0  # UNIX seconds
    restored_ts: float = 0.0
    recovery_s: float | None = None
    in_flight: int = 0
    in_flight_max_latency_s: float | None = None
    error: str = ""


@dataclass
class Outcome:
    index: int
    prompt: str
    submitted_ts: float = 0.0
    ended_ts: float = 0.0
    result: Result | None = None
    outcome: str = ""  # completed, failed, hung
    reason: str = ""
    differs: bool = False


@dataclass
class Servers:
    """The stack's servers, which the faults stop and start: an embedded Postgres, and either one embedded
    NATS (`nats`) or, on namespace hosts, a 3-server cluster across them (`cluster`, `hosts`)."""

    root: Path
    pg: EmbeddedServer
    nats_port: int = 0
    nats: EmbeddedServer | None = None
    hosts: Any = None  # tests.hosts.netns.Hosts
    cluster: Any = None  # tests.hosts.nats_cluster.NatsCluster
    relay: subprocess.Popen | None = None

    def nats_fault(self, target: str) -> None:
        if self.cluster is not None:
            host = self.hosts[target]
            self.cluster.kill(host)
            time.sleep(NATS_DOWN_S)
            self.cluster.restart(host)
        else:
            assert self.nats is not None
            self.nats.stop()
            self.nats = start_nats(self.root / "nats", self.nats_port)

    def link_fault(self, target: str) -> None:
        host = self.hosts[target]
        host.cut_link()
        try:
            time.sleep(LINK_DOWN_S)
        finally:
            host.restore_link()

    def stop(self) -> None:
        if self.relay is not None:
            self.relay.terminate()
            self.relay.wait(10)
        if self.cluster is not None:
            self.cluster.stop()
        if self.hosts is not None:
            self.hosts.destroy()
        if self.nats is not None:
            self.nats.stop()
        self.pg.stop()

    def stop_pg(self) -> None:
        self.pg.stop()

    def start_pg(self) -> None:
        self.pg = start_postgres(self.root / "pg")


def prompts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [f"Tell me about {rng.choice(WORDS)} and {rng.choice(WORDS)}, number {i}." for i in range(n)]


def schedule(seed: int, duration_s: float, every_s: float, services: list[str],
             on_hosts: bool) -> list[Fault]:
    """The faults, one every `every_s` from `every_s` on, none in the last 1.5 intervals (the run's tail
    has to show recovery too). Link cuts only on namespace hosts (of a pool's host: the control host
    carries the gateway the client talks to)."""
    rng = random.Random(seed)
    kinds = [(k, w) for k, w in zip(KINDS, KIND_WEIGHTS, strict=True) if on_hosts or k != "link"]
    out: list[Fault] = []
    t = every_s
    while t < duration_s - 1.5 * every_s:
        kind = rng.choices([k for k, _ in kinds], [w for _, w in kinds])[0]
        target = {"kill": lambda: rng.choice(services), "postgres": lambda: "postgres",
                  "nats": lambda: rng.choice(HOST_NAMES) if on_hosts else "nats",
                  "link": lambda: rng.choice(HOST_NAMES[1:])}[kind]()
        out.append(Fault(round(t, 1), kind, target))
        t += every_s
    return out


def print_schedule(faults: list[Fault], seed: int) -> None:
    table = Table(title=f"fault schedule (seed {seed})")
    for col in ("#", "at s", "kind", "target"):
        table.add_column(col)
    for i, f in enumerate(faults):
        table.add_row(str(i), f"{f.at_s:.1f}", f.kind, f.target)
    console.print(table)


def one_request(url: str, o: Outcome, max_tokens: int) -> Outcome:
    o.submitted_ts = time.time()
    deadline = time.monotonic() + CONNECT_RETRY_S
    while True:
        result = stream_one(url, o.prompt, max_tokens, lambda _: None)
        refused = not result.request_id and result.error is not None and "ConnectError" in result.error
        if not refused or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    o.result, o.ended_ts = result, time.time()
    return o


def fire(f: Fault, stack: Stack, servers: Servers) -> None:
    f.fired_ts = time.time()
    try:
        if f.kind == "kill":
            stack.kill(f.target)
            time.sleep(KILL_DOWN_S)
            stack.start_service(next(s for s in stack.plan if s.name == f.target))
        elif f.kind == "postgres":
            servers.stop_pg()
            time.sleep(PG_DOWN_S)
            servers.start_pg()
        elif f.kind == "nats":
            servers.nats_fault(f.target)
        elif f.kind == "link":
            servers.link_fault(f.target)
    except Exception as e:  # recorded: the soak goes on
        f.error = f"{type(e).__name__}: {e}"
    f.restored_ts = time.time()


def supervise(stack: Stack, t0: float, restarts: list[dict]) -> None:
    """Start again any service that exited without a fault of the schedule (as `pdserve up`'s supervisor
    does); each such restart is reported."""
    for name, proc in list(stack.procs.items()):
        if proc.poll() is not None:
            restarts.append({"at_s": round(time.time() - t0, 1), "service": name, "rc": proc.returncode})
            console.print(f"[red]{name} exited ({proc.returncode}) outside the schedule: started again[/]")
            stack.start_service(next(s for s in stack.plan if s.name == name))


def run_faults(faults: list[Fault], t0: float, stack: Stack, servers: Servers, stop: threading.Event,
               restarts: list[dict]) -> None:
    pending = list(faults)
    # This thread lives to the end of the run: a server it started dies with it (PR_SET_PDEATHSIG follows
    # the thread that forked, pdserve.embedded.child_dies_with_parent).
    while not stop.wait(0.1):
        supervise(stack, t0, restarts)
        if pending and time.time() >= t0 + pending[0].at_s:
            f = pending.pop(0)
            console.print(f"[yellow]fault[/] {f.kind} {f.target} at {time.time() - t0:.1f} s")
            fire(f, stack, servers)


async def log_check(settings: CommonSettings, db_url: str, outcomes: list[Outcome]) -> dict:
    """Wait for the recorder to catch up; then each request's terminal event and the events lost."""
    db = make_db(db_url)
    bus = await Bus.connect(settings, "soak")
    try:
        deadline = time.monotonic() + 180
        while not await caught_up(bus) and time.monotonic() < deadline:
            await asyncio.sleep(1.0)
        info = await bus.js.stream_info(settings.events_stream)
        async with db.connect() as conn:
            rows = (await conn.execute(sa.text("SELECT count(*) FROM events"))).scalar_one()
        terminal: dict[str, tuple[str, str]] = {}
        for o in outcomes:
            rid = o.result.request_id if o.result else ""
            if not rid:
                continue
            events = await queries.lifecycle(db, rid)
            ends = [e for e in events if e.type in TERMINAL_TYPES]
            if ends:
                p = ends[0].payload
                terminal[rid] = (ends[0].type, p.get("reason") or p.get("finish_reason") or "")
        return {"stream_messages": info.state.messages, "recorded_events": rows, "terminal": terminal}
    finally:
        await bus.close()
        await db.dispose()


def classify(o: Outcome, expected: dict[str, str], terminal: dict[str, tuple[str, str]]) -> None:
    r = o.result
    assert r is not None
    end = terminal.get(r.request_id)
    if r.error is None and r.finish_reason == "length":
        o.outcome = "completed"
        o.differs = r.text != expected[o.prompt]
    elif end is not None and end[0] != "RequestCompleted":
        o.outcome, o.reason = "failed", f"{end[0]}: {end[1]}"
    elif not r.request_id and r.error:  # never admitted: the client was told why (status or refusal)
        o.outcome, o.reason = "failed", f"HTTP {r.status}: {r.error[:120]}"
    elif end is not None:  # completed in the log, but the client's stream did not end (resume gave up)
        o.outcome, o.reason = "failed", f"client stream: {r.error}"
    else:
        o.outcome, o.reason = "hung", r.error or "no terminal event"


def recovery(faults: list[Fault], outcomes: list[Outcome]) -> None:
    done = [o for o in outcomes if o.outcome == "completed"]
    for f in faults:
        after = [o.ended_ts for o in done if o.submitted_ts >= f.fired_ts]
        f.recovery_s = round(min(after) - f.fired_ts, 3) if after else None
        flying = [o for o in outcomes if o.submitted_ts < f.fired_ts < o.ended_ts]
        f.in_flight = len(flying)
        lat = [o.ended_ts - o.submitted_ts for o in flying if o.outcome == "completed"]
        f.in_flight_max_latency_s = round(max(lat), 3) if lat else None


def undisturbed(faults: list[Fault], outcomes: list[Outcome], margin_s: float = 2.0) -> list[float]:
    windows = [(f.fired_ts - margin_s, f.restored_ts + 10.0) for f in faults]
    return [o.ended_ts - o.submitted_ts for o in outcomes if o.outcome == "completed"
            and not any(a < o.ended_ts and o.submitted_ts < b for a, b in windows)]


def summarize(faults: list[Fault], outcomes: list[Outcome], log: dict, args: argparse.Namespace,
              wall_s: float) -> dict:
    counts = {k: sum(o.outcome == k for o in outcomes) for k in ("completed", "failed", "hung")}
    base = undisturbed(faults, outcomes)
    base_p50 = statistics.median(base) if base else None
    kinds: dict[str, dict] = {}
    for kind in sorted({f.kind for f in faults}):
        fs = [f for f in faults if f.kind == kind]
        rec = [f.recovery_s for f in fs if f.recovery_s is not None]
        lat = [f.in_flight_max_latency_s for f in fs if f.in_flight_max_latency_s is not None]
        kinds[kind] = {
            "faults": len(fs),
            "recovery_s_mean": round(statistics.mean(rec), 3) if rec else None,
            "recovery_s_max": round(max(rec), 3) if rec else None,
            "in_flight_max_latency_s": round(max(lat), 3) if lat else None,
            "in_flight_max_latency_x_undisturbed_p50":
                round(max(lat) / base_p50, 2) if lat and base_p50 else None,
        }
    reasons: dict[str, int] = {}
    for o in outcomes:
        if o.outcome == "failed":
            key = o.reason.split(" (")[0][:100]
            reasons[key] = reasons.get(key, 0) + 1
    return {
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "wall_s": round(wall_s, 1),
        "requests": len(outcomes),
        **counts,
        "failure_reasons": reasons,
        "events_lost": log["stream_messages"] - log["recorded_events"],
        "stream_messages": log["stream_messages"],
        "recorded_events": log["recorded_events"],
        "outputs_differ": sum(o.differs for o in outcomes),
        "undisturbed_latency_p50_s": round(base_p50, 3) if base_p50 else None,
        "undisturbed_requests": len(base),
        "by_kind": kinds,
        "faults": [asdict(f) for f in faults],
        "requests_log": [  # [submitted s after the first, latency s, outcome]
            [round(o.submitted_ts - outcomes[0].submitted_ts, 2), round(o.ended_ts - o.submitted_ts, 3),
             o.outcome] for o in outcomes],
    }


def write(summary: dict, outcomes: list[Outcome], t0: float, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "soak.json").write_text(json.dumps(summary, indent=2) + "\n")
    c = summary["config"]
    lines = [
        "# Chaos soak",
        "",
        f"`python benchmarks/soak.py --requests {c['requests']} --rate {c['rate']} --max-tokens "
        f"{c['max_tokens']} --seed {c['seed']} --fault-every {c['fault_every']}` — tiny model, 2 prefill "
        f"+ 2 decode workers, 2 coordinators, 2 routers; "
        + ("3 network-namespace hosts (control: gateway, recorder, coordinator, router; prefill: the prefill "
           "workers, coordinator-1; decode: the decode workers, router-1), a 3-server NATS cluster across "
           "them (events stream and leases on 3 replicas), Postgres relayed onto their bridge; "
           if c.get("on_hosts") else "one embedded NATS server and Postgres; ")
        + f"{summary['machine']['cpus']} shared CPUs; {summary['wall_s']} s.",
        "",
        "| requests | completed | failed (with a reason) | hung | events lost | outputs ≠ greedy reference |",
        "|---|---|---|---|---|---|",
        f"| {summary['requests']} | {summary['completed']} | {summary['failed']} | {summary['hung']} | "
        f"{summary['events_lost']} ({summary['stream_messages']} published, {summary['recorded_events']} "
        f"recorded) | {summary['outputs_differ']} |",
        "",
        f"Undisturbed requests (no fault window overlapping them: {summary['undisturbed_requests']}): median "
        f"latency {summary['undisturbed_latency_p50_s']} s, the baseline below.",
        "",
        "| fault kind | faults | recovery mean s | recovery max s | slowest in-flight request s "
        "| × undisturbed p50 |",
        "|---|---|---|---|---|---|",
    ]
    for kind, k in summary["by_kind"].items():
        lines.append(f"| {kind} | {k['faults']} | {k['recovery_s_mean']} | {k['recovery_s_max']} | "
                     f"{k['in_flight_max_latency_s']} | {k['in_flight_max_latency_x_undisturbed_p50']} |")
    lines += ["", "Recovery: from the fault until the first request submitted after it completes (normal "
              "latency included). Failure reasons:", ""]
    lines += [f"- {n} × {reason}" for reason, n in sorted(summary["failure_reasons"].items())] or ["- none"]
    lines += ["", "Services that exited outside the schedule (started again, as a supervisor would): "
              + (", ".join(f"{r['service']} at {r['at_s']} s (rc {r['rc']})"
                           for r in summary.get("restarts_outside_schedule", [])) or "none") + "."]
    lines += ["", "| # | at s | kind | target | recovery s | in flight | slowest in-flight s | error |",
              "|---|---|---|---|---|---|---|---|"]
    for i, f in enumerate(summary["faults"]):
        lines.append(f"| {i} | {f['at_s']} | {f['kind']} | {f['target']} | {f['recovery_s']} | "
                     f"{f['in_flight']} | {f['in_flight_max_latency_s']} | {f['error']} |")
    (out / "soak.md").write_text("\n".join(lines) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 4))
    base = summary["undisturbed_latency_p50_s"] or 1.0
    for kind, color in (("completed", "tab:blue"), ("failed", "tab:red"), ("hung", "black")):
        pts = [(o.submitted_ts - t0, (o.ended_ts - o.submitted_ts) / base)
               for o in outcomes if o.outcome == kind]
        if pts:
            ax.scatter(*zip(*pts, strict=True), s=4, color=color, label=kind)
    colors = {"kill": "tab:orange", "postgres": "tab:green", "nats": "tab:purple"}
    for f in summary["faults"]:
        ax.axvline(f["fired_ts"] - t0, color=colors.get(f["kind"], "gray"), lw=0.8, alpha=0.7)
    ax.set_xlabel("submitted at, s (vertical lines: faults — orange kill, green postgres, purple nats)")
    ax.set_ylabel("latency ÷ undisturbed p50")
    ax.set_yscale("log")
    ax.legend(loc="upper right")
    ax.set_title("chaos soak: every request's latency relative to the run's undisturbed median")
    fig.tight_layout()
    fig.savefig(out / "soak.png", dpi=110)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--rate", type=float, default=4.0, help="requests per second, open loop")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--prompts", type=int, default=40, help="distinct prompts")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--fault-every", type=float, default=20.0, help="seconds between faults")
    p.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    p.add_argument("--hosts", choices=("auto", "on", "off"), default="auto",
                   help="run on 3 network-namespace hosts with a 3-server NATS cluster (auto: where root "
                   "can make them)")
    args = p.parse_args()

    root = Path(tempfile.mkdtemp(prefix="pds-soak-"))
    os.environ["PDS_COMMIT_EVERY_TOKENS"] = "8"
    from tests.hosts.netns import unavailable

    reason = unavailable() if args.hosts != "off" else "--hosts off"
    if reason and args.hosts == "on":
        raise SystemExit(f"no namespace hosts: {reason}")
    on_hosts = not reason
    servers = Servers(root, start_postgres(root / "pg"))
    db_url = create_database(servers.pg.url, "pdserve_soak")
    upgrade(db_url)
    base = {"subject_prefix": "soak", "events_stream": "PDS_EVENTS_SOAK", "var_dir": root / "var"}
    n = {"model": "tiny", "n_prefill": 2, "n_decode": 2, "n_coordinators": 2, "n_routers": 2}
    if on_hosts:
        stack = on_namespace_hosts(servers, db_url, base, n)
    else:
        console.print(f"[yellow]no namespace hosts ({reason}): one host, one NATS server[/]")
        servers.nats_port = free_port()
        servers.nats = start_nats(root / "nats", servers.nats_port)
        settings = CommonSettings(nats_url=servers.nats.url, database_url=db_url, **base)
        stack = Stack(settings, root / "stack", **n)
    settings = stack.settings
    texts = prompts(args.prompts, args.seed)
    duration = args.requests / args.rate
    services = [s.name for s in stack.plan]
    faults = schedule(args.seed, duration, args.fault_every, services, on_hosts)
    print_schedule(faults, args.seed)
    args.on_hosts = on_hosts
    try:
        console.print(f"stack under {root} (logs there); computing the greedy reference …")
        expected = reference_texts(texts, args.max_tokens, settings.var_dir)
        stack.start()
        outcomes = [Outcome(i, texts[i % len(texts)]) for i in range(args.requests)]
        stop = threading.Event()
        t0 = time.time()
        restarts: list[dict] = []
        chaos = threading.Thread(target=run_faults, args=(faults, t0, stack, servers, stop, restarts),
                                 daemon=True)
        chaos.start()
        bar = tqdm(total=args.requests, desc="requests", mininterval=5)
        with ThreadPoolExecutor(256) as pool, bar:
            futures = []
            for o in outcomes:
                delay = t0 + o.index / args.rate - time.time()
                if delay > 0:
                    time.sleep(delay)
                fut = pool.submit(one_request, stack.url, o, args.max_tokens)
                fut.add_done_callback(lambda _: bar.update())
                futures.append(fut)
            for fut in futures:
                fut.result()
        stop.set()
        chaos.join()
        wall = time.time() - t0
        log = asyncio.run(log_check(settings, db_url, outcomes))
        for o in outcomes:
            classify(o, expected, log["terminal"])
        recovery(faults, outcomes)
        summary = summarize(faults, outcomes, log, args, wall)
        summary["restarts_outside_schedule"] = restarts
        write(summary, outcomes, t0, args.out)
    finally:
        stack.stop()
        servers.stop()
    console.print_json(json.dumps({k: v for k, v in summary.items()
                                   if k not in ("faults", "config", "requests_log")}))
    ok = summary["hung"] == 0 and summary["events_lost"] == 0 and summary["outputs_differ"] == 0
    console.print("[green]soak passed[/]" if ok else "[red]soak failed[/]")
    return 0 if ok else 1


def on_namespace_hosts(servers: Servers, db_url: str, base: dict, n: dict) -> Stack:
    """The stack on three namespace hosts (tests/hosts): a NATS cluster across them, the events stream
    and the lease bucket on 3 replicas, Postgres relayed onto their bridge."""
    from sqlalchemy.engine import make_url

    from tests.hosts.nats_cluster import NatsCluster
    from tests.hosts.netns import ROOT, Hosts
    from tests.hosts.stack import HostStack

    servers.hosts = hosts = Hosts.create(HOST_NAMES)
    servers.cluster = NatsCluster(list(hosts), servers.root / "nats-cluster", f"pds{hosts.tag}").start()
    url = make_url(db_url)
    target = f"{url.query['host']}/.s.PGSQL.{url.port or 5432}" if url.query.get("host") else \
        f"{url.host}:{url.port or 5432}"
    servers.relay = subprocess.Popen(
        [sys.executable, "-m", "tests.hosts.relay", hosts.gateway_address, target], cwd=ROOT,
        stdout=subprocess.PIPE, text=True)
    line = servers.relay.stdout.readline().split() if servers.relay.stdout else []
    assert line and line[0] == "listening", "the Postgres relay did not start"
    relayed = url.set(host=hosts.gateway_address, port=int(line[1]),
                      query={k: v for k, v in url.query.items() if k != "host"})
    settings = CommonSettings(nats_url=servers.cluster.url, database_url=relayed.render_as_string(
        hide_password=False), events_replicas=3, **base)
    return HostStack(settings, servers.root / "stack", hosts, placement=PLACEMENT, **n)


def reference_texts(texts: list[str], max_tokens: int, cache: Path) -> dict[str, str]:
    """The greedy output text of each prompt from one process without transfer (tests/oracle.py), as the
    gateway encodes a completion's prompt."""
    import torch

    from tests import oracle

    torch.set_num_threads(1)
    loaded, model = oracle.reference("tiny", cache / "weights")
    tok = loaded.tokenizer
    return {t: tok.decode(oracle.greedy(model, tok.encode(t), max_tokens))
            for t in tqdm(texts, desc="reference")}


if __name__ == "__main__":
    sys.exit(main())
