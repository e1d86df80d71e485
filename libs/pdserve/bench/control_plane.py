"""Control-plane overhead of a request: what its TTFT spends outside the model's forward and the KV transfer.

Per request (seconds; the client's TTFT, the server's breakdown from the `requests` projection, and the
prefill worker's own `PrefillCompleted.prefill_s` from the `events` table):

    overhead = client TTFT − worker forward − exposed transfer

and the same split by phase, so the parts add up to `overhead`:

- `client_gateway`: client TTFT − server TTFT (the HTTP request in, the gateway's handling up to its
  receive stamp, and the first token's way back: decode worker → NATS → gateway → SSE → client),
- `queue`: gateway receive → the coordinator starts routing (gateway → coordinator hop, admission),
- `route`: the placement (in the coordinator's process, overlapping the lease claim's round trip; with
  `PDS_PLACEMENT=router`, the router's round trip),
- `reserve`: the decode worker's KV reservation round trip (0 for a local placement — colocated, or
  prefilled locally — whose prefill command reserves),
- `prefill_dispatch`: the coordinator's prefill phase − the worker's forward (dispatch to the prefill
  worker, a local placement's reservation, its PrefillStarted emit, and its reply back),
- `start_decode`: a request that moved no KV (colocated, or prefilled locally) has no transfer to expose,
  yet its breakdown's `exposed_transfer_s` is not 0: the worker stamps `transfer_done_ts` when the
  coordinator's StartDecode reaches it, so that field holds the StartDecode hop, which is control plane
  (for a disaggregated request that hop sits in `first_token`, and `exposed_transfer_s` is subtracted),
- `first_token`: transfer done → the first token leaves the decode worker (StartDecode hop, admission,
  the decode loop picking it up).

The floor (libs/pdserve/bench/sse_floor.py) is the client TTFT of a bare FastAPI SSE server driven by the
same client in the same run; `summarise` reports overhead − floor at p50 and p99 (each the difference of
the two distributions' percentiles: requests are not paired).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from pdserve.bench.breakdown import TTFTBreakdown
from pdserve.bench.metrics import RequestRecord

PHASES = ("client_gateway", "queue", "route", "reserve", "prefill_dispatch", "start_decode", "first_token")


async def fetch_worker_prefill_s(database_url: str, request_ids: Sequence[str]) -> dict[str, float]:
    """Each request's `prefill_s` from its last PrefillCompleted event (the prefill worker's forward,
    measured by the worker), keyed by request id. Raises what SQLAlchemy raises when Postgres fails."""
    import sqlalchemy as sa

    from pdserve.store.queries import make_db
    from pdserve.store.tables import events

    db = make_db(database_url)
    try:
        async with db.connect() as conn:
            q = (sa.select(events.c.request_id, events.c.payload)
                 .where(events.c.type == "PrefillCompleted",
                        events.c.request_id.in_(sorted(set(request_ids))))
                 .order_by(events.c.stream_seq))
            rows = (await conn.execute(q)).all()
    finally:
        await db.dispose()
    return {str(rid): float(payload["prefill_s"]) for rid, payload in rows}  # the last one wins


def request_overheads(records: Iterable[RequestRecord], breakdowns: Mapping[str, TTFTBreakdown],
                      worker_prefill_s: Mapping[str, float]) -> list[dict[str, float]]:
    """One row per successful request that has a full breakdown and a PrefillCompleted: `client_ttft`,
    `forward`, `exposed_transfer` (0 unless the request was disaggregated), `overhead` and every phase of
    PHASES, seconds."""
    rows = []
    for r in records:
        b = breakdowns.get(r.request_id or "")
        fwd = worker_prefill_s.get(r.request_id or "")
        if not r.success or not r.chunk_times_s or b is None or fwd is None or b.ttft_s is None:
            continue
        st = b.stages_s
        if any(st.get(k) is None for k in ("queue_s", "route_s", "reserve_s", "prefill_s",
                                           "exposed_transfer_s", "first_token_s")):
            continue
        client = r.ttft_s
        moved_kv = b.mode == "disaggregated"
        exposed = st["exposed_transfer_s"] if moved_kv else 0.0
        row = {
            "client_ttft": client, "server_ttft": b.ttft_s, "forward": fwd, "exposed_transfer": exposed,
            "overhead": client - fwd - exposed,
            "client_gateway": client - b.ttft_s, "queue": st["queue_s"], "route": st["route_s"],
            "reserve": st["reserve_s"], "prefill_dispatch": st["prefill_s"] - fwd,
            "start_decode": 0.0 if moved_kv else st["exposed_transfer_s"], "first_token": st["first_token_s"],
        }
        rows.append(row)
    return rows


def _pct(values: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(values, dtype=np.float64), q)) if len(values) else float("nan")


def summarise(rows: Sequence[Mapping[str, float]], floor_ttft_s: Sequence[float]) -> dict[str, Any]:
    """Milliseconds: p50 / p99 of the overhead and of the floor, their differences, and each phase's p50
    and mean (means add up to the mean overhead; medians need not)."""
    ms = 1e3
    over = [r["overhead"] for r in rows]
    out: dict[str, Any] = {
        "requests": len(rows), "floor_requests": len(floor_ttft_s),
        "overhead_p50_ms": _pct(over, 50) * ms, "overhead_p99_ms": _pct(over, 99) * ms,
        "floor_p50_ms": _pct(floor_ttft_s, 50) * ms, "floor_p99_ms": _pct(floor_ttft_s, 99) * ms,
        "client_ttft_p50_ms": _pct([r["client_ttft"] for r in rows], 50) * ms,
        "forward_p50_ms": _pct([r["forward"] for r in rows], 50) * ms,
        "exposed_transfer_p50_ms": _pct([r["exposed_transfer"] for r in rows], 50) * ms,
    }
    out["above_floor_p50_ms"] = out["overhead_p50_ms"] - out["floor_p50_ms"]
    out["above_floor_p99_ms"] = out["overhead_p99_ms"] - out["floor_p99_ms"]
    out["overhead_mean_ms"] = float(np.mean(over)) * ms if over else float("nan")
    out["phases_p50_ms"] = {p: _pct([r[p] for r in rows], 50) * ms for p in PHASES}
    out["phases_mean_ms"] = {p: (float(np.mean([r[p] for r in rows])) * ms if rows else float("nan"))
                             for p in PHASES}
    return out
