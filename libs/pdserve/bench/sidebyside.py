"""Pieces for benchmarks that put several servers side by side in one run and drive them with the same
client (benchmarks/vs_vllm.py, benchmarks/control_plane.py): which NATS and Postgres the pdserve stacks
use, a `pdserve up` stack of its own per server, the order servers take within a round, and the figures
read from one `bench serve` report."""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pdserve.bench.compare import CompareConfig, StackRun

NATS_URL = "nats://127.0.0.1:4222"
DATABASE_URL = "postgresql+asyncpg://postgres@127.0.0.1:5432/postgres"


def _answers(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1):
            return True
    except OSError:
        return False


def server_env() -> dict[str, str]:
    """PDS_NATS_URL / PDS_DATABASE_URL for the stacks: the caller's when set, else this machine's NATS
    (4222) and Postgres (5432) when they answer, else nothing (each `pdserve up` embeds its own)."""
    env: dict[str, str] = {}
    if url := os.environ.get("PDS_NATS_URL"):
        env["PDS_NATS_URL"] = url
    elif _answers("127.0.0.1", 4222):
        env["PDS_NATS_URL"] = NATS_URL
    if url := os.environ.get("PDS_DATABASE_URL"):
        env["PDS_DATABASE_URL"] = url
    elif _answers("127.0.0.1", 5432):
        env["PDS_DATABASE_URL"] = DATABASE_URL
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pdserve_stack(mode: str, model: str, var_dir: Path, extra_env: dict[str, str] | None = None,
                  port: int | None = None, up_args: tuple[str, ...] = ()) -> StackRun:
    """A `pdserve up --mode <mode> [up_args]` stack (1 prefill + 1 decode worker, or as many unified ones,
    unless `up_args` says otherwise) with a subject prefix, events stream, database and port of its own,
    so several run at once on one NATS and Postgres. Use it as a context manager; `.state.gateway_url` is
    its URL once entered."""
    tag = uuid.uuid4().hex[:6]
    env = {**os.environ, **server_env(), "PDS_SUBJECT_PREFIX": f"pdsbx{tag}",
           "PDS_EVENTS_STREAM": f"PDS_BENCH_{tag}", **(extra_env or {})}
    cfg = CompareConfig(model=model, port=port or free_port(), var_dir=var_dir)
    return StackRun(mode, cfg, env, tag, up_args)


def round_order(names: Sequence[str], round_index: int, cell_index: int = 0) -> list[str]:
    """The order the servers of `names` take in one round of one cell: odd rounds run the previous
    round's order backwards (so two rounds already put every server's first run against another's last),
    and each pair of rounds is rotated one further (by cell too), so over rounds each server runs first,
    last and in the middle."""
    k = (round_index // 2 + cell_index) % len(names)
    order = list(names[k:]) + list(names[:k])
    return order[::-1] if round_index % 2 else order


def cell_figures(report: Any) -> dict[str, Any]:
    """The figures one `bench serve` report gives a side-by-side table (latencies ms, tokens/s)."""
    m = report.metrics
    lat = m.latency
    return {
        "completed": m.completed, "failed": m.failed, "duration_s": m.duration_s,
        "output_throughput": m.output_throughput, "request_throughput": m.request_throughput,
        "ttft_p50_ms": lat["ttft"].median_ms, "ttft_p99_ms": lat["ttft"].p(99),
        "tpot_p50_ms": lat["tpot"].median_ms, "itl_p50_ms": lat["itl"].median_ms,
        "itl_p99_ms": lat["itl"].p(99),
        "e2el_p50_ms": lat["e2el"].median_ms, "max_concurrent_requests": m.max_concurrent_requests,
        "errors": sorted({r.error[:200] for r in report.records if not r.success})[:3],
    }


def ratio(value: float | None, peer: float | None) -> float | None:
    """value / peer, None when either is missing or the peer is 0."""
    if value is None or peer is None or peer == 0:
        return None
    return value / peer
