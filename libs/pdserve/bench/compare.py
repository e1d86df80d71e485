"""`pdserve bench compare`: the same workloads against a colocated and a disaggregated stack.

For each mode: `pdserve up --mode <mode>` (a detached supervisor; NATS and Postgres from PDS_NATS_URL /
PDS_DATABASE_URL when set, embedded otherwise; this run's own subject prefix and events stream), each
worker pool pinned to its own core (`pinning`), two warm-up requests, then every input:output ratio ×
request rate as one `bench serve` run of `num_prompts` random requests, then `pdserve down`.
Writes <out>/colocated-vs-disaggregated.{json,md,png}; the JSON is rewritten after every point, so an
interrupted sweep keeps what it measured.
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rich.console import Console
from sqlalchemy.engine import make_url

from pdserve.bench.breakdown import mean_stages_ms
from pdserve.bench.compare_report import write_compare
from pdserve.bench.datasets import SampleRequest
from pdserve.bench.pinning import pin_pools
from pdserve.bench.runner import LoadSpec, run_load
from pdserve.bench.serve import ServeConfig, run_serve
from pdserve.config import nats_servers
from pdserve.stack_state import StackState, read_state

console = Console(highlight=False, soft_wrap=True)
STEM = "colocated-vs-disaggregated"


@dataclass
class CompareConfig:
    """The sweep. `ratios`: (input, output) weights, e.g. (10, 1); each request has `tokens_per_request`
    tokens split by the ratio. `rates`: requests/s. `goodput_slo_ms`: the SLO goodput is counted at."""

    model: str = "smollm2"
    modes: list[str] = field(default_factory=lambda: ["colocated", "disaggregated"])
    ratios: list[tuple[int, int]] = field(default_factory=lambda: [(10, 1), (1, 1), (1, 20)])
    rates: list[float] = field(default_factory=lambda: [0.25, 0.5, 1.0])
    num_prompts: int = 20
    tokens_per_request: int = 220
    burstiness: float = 1.0
    seed: int = 0
    goodput_slo_ms: dict[str, float] = field(default_factory=lambda: {"ttft": 2000.0, "tpot": 200.0})
    port: int = 18700
    var_dir: Path = Path("var/bench-compare")
    pin_cores: bool = True
    read_timeout_s: float = 120.0


def parse_ratio(text: str) -> tuple[int, int]:
    """'10:1' → (10, 1). Raises ValueError unless both sides are positive integers."""
    left, sep, right = text.partition(":")
    try:
        ratio = (int(left), int(right))
    except ValueError:
        ratio = (0, 0)
    if not sep or min(ratio) < 1:
        raise ValueError(f"ratio {text!r}: expected INPUT:OUTPUT with positive integers, e.g. 10:1")
    return ratio


def split_tokens(total: int, ratio: tuple[int, int]) -> tuple[int, int]:
    """(input_len, output_len) summing to about `total` in proportion `ratio`, each at least 1."""
    n_in = max(1, round(total * ratio[0] / sum(ratio)))
    return n_in, max(1, total - n_in)


class StackRun:
    """One `pdserve up` stack for the duration of a `with` block (stopped by `pdserve down`), on a fresh
    event store: its own database when PDS_DATABASE_URL names a server (dropped afterwards), else an
    embedded Postgres in a cleared var dir. A store reused across events streams would collide on
    stream sequence numbers."""

    def __init__(self, mode: str, cfg: CompareConfig, env: dict[str, str], tag: str,
                 up_args: tuple[str, ...] = ()) -> None:
        self.mode, self.cfg, self.up_args = mode, cfg, up_args
        self.var_dir = cfg.var_dir / mode
        self.env = dict(env)
        self.database: tuple[str, str] | None = None  # (admin URL, database name) to drop at exit
        if server_url := env.get("PDS_DATABASE_URL"):
            url = make_url(server_url)
            name = f"pdserve_bench_{tag}_{mode}"
            self.env["PDS_DATABASE_URL"] = url.set(database=name).render_as_string(hide_password=False)
            self.database = (url.set(database="postgres").render_as_string(hide_password=False), name)

    def _cli(self, *args: str, timeout_s: float) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "pdserve.cli.main", *args, "--var-dir", str(self.var_dir)]
        return subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=timeout_s)

    def __enter__(self) -> StackRun:
        shutil.rmtree(self.var_dir, ignore_errors=True)
        out = self._cli("up", "--mode", self.mode, "--model", self.cfg.model, "--port", str(self.cfg.port),
                        *self.up_args, timeout_s=600)
        if out.returncode != 0:
            self._cli("down", timeout_s=120)
            raise RuntimeError(f"pdserve up --mode {self.mode} failed:\n{out.stdout}\n{out.stderr}")
        return self

    def __exit__(self, *exc: object) -> None:
        self._cli("down", timeout_s=120)
        if self.database is not None:
            from pdserve.store.migrate import drop_database

            drop_database(*self.database)
        if nats_url := self.env.get("PDS_NATS_URL"):
            asyncio.run(_delete_stream(nats_url, self.env["PDS_EVENTS_STREAM"]))

    @property
    def state(self) -> StackState:
        state = read_state(self.var_dir)
        if state is None:
            raise RuntimeError(f"the {self.mode} stack has no state in {self.var_dir}")
        return state


def point_summary(mode: str, ratio: tuple[int, int], rate: float, report: Any) -> dict[str, Any]:
    """The numbers the comparison reads from one `bench serve` report (latencies in ms)."""
    m = report.metrics
    lat = {k: {"p50": d.median_ms, "p99": d.p(99), "mean": d.mean_ms} for k, d in m.latency.items()}
    return {
        "mode": mode, "ratio": f"{ratio[0]}:{ratio[1]}", "request_rate": rate,
        "input_len": report.config["input_len"], "output_len": report.config["output_len"],
        "completed": m.completed, "failed": m.failed, "duration_s": m.duration_s,
        "request_throughput": m.request_throughput, "request_goodput": m.request_goodput,
        "goodput_fraction": (m.request_goodput or 0.0) * m.duration_s / max(1, m.completed + m.failed),
        "output_throughput": m.output_throughput, "latency_ms": lat,
        "itl_p99_over_p50": lat["itl"]["p99"] / lat["itl"]["p50"] if lat["itl"]["p50"] > 0 else None,
        "ttft_breakdown_mean_ms": mean_stages_ms(list(report.breakdowns.values())),
        "errors": sorted({r.error[:200] for r in report.records if not r.success})[:3],
    }


async def _delete_stream(nats_url: str, stream: str) -> None:
    """Delete this run's own JetStream stream from a shared NATS server (an embedded one goes with its
    var dir)."""
    import nats
    from nats.js.errors import NotFoundError

    nc = await nats.connect(nats_servers(nats_url))
    try:
        await nc.jetstream().delete_stream(stream)
    except NotFoundError:
        pass
    finally:
        await nc.close()


_WARM_UP_TIMEOUT_S = 30.0


async def warm_up(base_url: str) -> str | None:
    """Two short requests through the stack; None when both completed, else the first error (a stack
    that cannot serve them is reported as such instead of stalling every point of the sweep)."""
    samples = [SampleRequest([1000 + i for i in range(32)], 8) for _ in range(2)]
    load = LoadSpec(read_timeout_s=_WARM_UP_TIMEOUT_S)
    result = await run_load(base_url, samples, load, progress=False)
    bad = [r for r in result.records if not r.success or r.num_output_tokens < 8]
    return None if not bad else (bad[0].error or f"{bad[0].num_output_tokens} of 8 tokens came back")


def run_compare(cfg: CompareConfig, out_dir: Path,
                probe: Callable[[str, str], Any] | None = None) -> int:
    """Run the whole sweep and write the report; returns 0 when every point completed some request.
    `probe(mode, gateway_url)`, when given, runs on each stack after its warm-up and before the sweep;
    its result is kept in the JSON under `probes[mode]` (`benchmarks/sim_validation.py` calibrates the
    simulator's control-plane overheads on it, outside the sweep's cells)."""
    tag = uuid.uuid4().hex[:6]
    env = {**os.environ, "PDS_SUBJECT_PREFIX": f"pdscmp{tag}", "PDS_EVENTS_STREAM": f"PDS_COMPARE_{tag}"}
    results: dict[str, Any] = {
        "config": {**asdict(cfg), "var_dir": str(cfg.var_dir),
                   "ratios": [f"{a}:{b}" for a, b in cfg.ratios]},
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "loadavg_at_start": os.getloadavg(), "python": platform.python_version()},
        "started_at": datetime.now(UTC).isoformat(timespec="seconds"), "commit": code_commit(),
        "pinning": {}, "points": [], "command": " ".join(["pdserve", *sys.argv[1:]]),
    }
    started = time.monotonic()
    for mode in cfg.modes:
        console.print(f"[bold]{mode}[/]: starting the stack ({cfg.model})")
        with StackRun(mode, cfg, env, tag) as stack:
            base_url = stack.state.gateway_url
            if (error := asyncio.run(warm_up(base_url))) is not None:
                note = f"{mode}: the stack did not serve the warm-up requests ({error}); no points measured"
                console.print(f"[red]{note}[/]")
                results.setdefault("notes", []).append(note)
                continue
            if probe is not None:
                results.setdefault("probes", {})[mode] = probe(mode, base_url)
            for ratio in cfg.ratios:
                n_in, n_out = split_tokens(cfg.tokens_per_request, ratio)
                for rate in cfg.rates:
                    state = stack.state
                    if cfg.pin_cores:
                        results["pinning"][mode] = pin_pools(state)
                    serve_cfg = ServeConfig(
                        base_url=base_url, dataset="random", num_prompts=cfg.num_prompts, input_len=n_in,
                        output_len=n_out, request_rate=rate, burstiness=cfg.burstiness, seed=cfg.seed,
                        goodput_slo_ms=cfg.goodput_slo_ms, database_url=state.database_url or None,
                        read_timeout_s=cfg.read_timeout_s,
                    )
                    t0 = time.monotonic()
                    report = asyncio.run(run_serve(serve_cfg, progress=False))
                    point = point_summary(mode, ratio, rate, report)
                    results["points"].append(point)
                    results["elapsed_s"] = time.monotonic() - started
                    console.print(
                        f"  {mode} {point['ratio']} ({n_in}:{n_out} tokens) @ {rate:g} req/s: "
                        f"goodput {point['request_goodput']:.3f} req/s, "
                        f"TTFT p50 {point['latency_ms']['ttft']['p50']:.0f} ms, "
                        f"ITL p50/p99 {point['latency_ms']['itl']['p50']:.0f}/"
                        f"{point['latency_ms']['itl']['p99']:.0f} ms, failed {point['failed']} "
                        f"({time.monotonic() - t0:.0f} s)")
                    write_compare(results, out_dir, STEM, final=False)
    results["elapsed_s"] = time.monotonic() - started
    for path in write_compare(results, out_dir, STEM, final=True):
        console.print(f"wrote {path}")
    return 0 if all(p["completed"] for p in results["points"]) else 1


def cpu_model() -> str:
    """The CPU's name from /proc/cpuinfo, else the architecture: figures move with it (MKL's GEMM takes a
    generic path on AMD; an Intel host with AMX runs fp32 GEMMs at other rates), so reports name it."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


def code_commit() -> str:
    """The git commit of the pdserve code being measured: `git rev-parse` where the package lives, else
    $PDS_BENCH_COMMIT (set it when measuring an exported snapshot), else 'unknown'."""
    import pdserve

    try:
        where = str(Path(pdserve.__file__).parent)
        out = subprocess.run(["git", "-C", where, "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, timeout=10)
        if out.returncode == 0:
            dirty = subprocess.run(["git", "-C", where, "status", "--porcelain", "--untracked-files=no"],
                                   capture_output=True, text=True, timeout=10).stdout.strip()
            return out.stdout.strip() + (" + uncommitted changes in the tree" if dirty else "")
    except OSError:
        pass
    return os.environ.get("PDS_BENCH_COMMIT", "unknown")


def load_results(path: Path) -> dict[str, Any]:
    """A previously written colocated-vs-disaggregated.json (to re-render its Markdown and PNG)."""
    return json.loads(path.read_text())
