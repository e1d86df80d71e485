"""The measurements `pdserve advise` decides from, read out of a stack's event log.

Each `Measurement` names where it was measured (`source`: event type and field, or the client's bench
result) and over how many samples; one that could not be measured has `value` None and says why in `note`.
The folding is a pure function of the events (`measure`), so a scripted log gives exact numbers; `load`
reads them from the event store the way `pdserve report routing` does.

KV tiers: a `PrefillCompleted` whose payload carries `cached_tokens_by_tier` ({tier: tokens}, summing to
num_cached_tokens: "pool" is the prefill worker's paged pool, "offload", "store", ... the tiers below it)
counts each tier's hits; without it, or with only the pool, the log shows no tier.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime

import sqlalchemy as sa
from pydantic import BaseModel, ConfigDict
from sqlalchemy.ext.asyncio import AsyncEngine

from pdserve.events import Event
from pdserve.routing.report import RoutingReport, fold_routed, summarize
from pdserve.store.rows import row_event
from pdserve.store.tables import events

TIER_FIELD = "cached_tokens_by_tier"
BASE_TIERS = frozenset({"pool", "gpu", "device"})  # the prefill worker's paged pool itself, not an added tier


class Measurement(BaseModel):
    """One number and where it came from. `value` None: not measured, `note` says why."""

    model_config = ConfigDict(frozen=True)

    name: str
    value: float | None
    unit: str
    source: str
    samples: int = 0
    note: str = ""


def measured(name: str, value: float, unit: str, source: str, samples: int, note: str = "") -> Measurement:
    return Measurement(name=name, value=value, unit=unit, source=source, samples=samples, note=note)


def missing(name: str, unit: str, source: str, why: str) -> Measurement:
    return Measurement(name=name, value=None, unit=unit, source=source, note=why)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100) by linear interpolation between closest ranks (numpy's default)."""
    xs = sorted(values)
    if not xs:
        raise ValueError("no values")
    k = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


@dataclass
class RequestFacts:
    """One request's facts folded from its events (None / 0 where its log has no such event)."""

    request_id: str
    prompt_tokens: int = 0
    received_ts: float | None = None  # RequestReceived, UNIX seconds
    block_hashes: tuple[int, ...] = ()  # RequestRouted.prompt_block_hashes
    mode: str | None = None
    prefill_worker: str | None = None
    decode_worker: str | None = None
    completion_tokens: int | None = None
    computed_tokens: int | None = None
    cached_tokens: int | None = None
    cached_by_tier: dict[str, int] = field(default_factory=dict)
    prefill_s: float | None = None
    transfer_bytes: int | None = None
    kv_bytes: int | None = None
    state_bytes: int = 0
    transfer_s: float | None = None
    exposed_transfer_s: float | None = None
    ttft_s: float | None = None
    queue_s: float | None = None  # RequestCompleted.ttft.queue_s: waiting for a worker to admit it
    e2e_s: float | None = None
    deferrals: int = 0
    failed_reason: str | None = None
    migrations: int = 0
    commits: list[tuple[float, int]] = field(default_factory=list)  # (ts, tokens) per TokensCommitted


def fold(evts: Iterable[Event]) -> dict[str, RequestFacts]:
    """Per request, from events in stream order (requests interleaved)."""
    out: dict[str, RequestFacts] = {}
    for e in evts:
        r = out.setdefault(e.request_id, RequestFacts(e.request_id))
        p = e.payload
        if e.type == "RequestReceived":
            r.prompt_tokens, r.received_ts = int(p["num_prompt_tokens"]), e.ts
        elif e.type == "RequestRouted":
            r.block_hashes = tuple(int(h) for h in p.get("prompt_block_hashes") or ())
            r.mode, r.prefill_worker, r.decode_worker = (
                p["mode"],
                p["prefill_worker_id"],
                p["decode_worker_id"],
            )
        elif e.type == "AdmissionDeferred":
            r.deferrals += 1
        elif e.type == "PrefillCompleted":
            r.cached_tokens, r.computed_tokens = int(p["num_cached_tokens"]), int(p["num_computed_tokens"])
            r.prefill_s = float(p["prefill_s"])
            r.cached_by_tier = {str(k): int(v) for k, v in (p.get(TIER_FIELD) or {}).items()}
        elif e.type == "TransferCompleted":
            r.kv_bytes, r.state_bytes = int(p["kv_bytes"]), int(p.get("state_bytes", 0))
            r.transfer_bytes, r.transfer_s = r.kv_bytes + r.state_bytes, float(p["transfer_s"])
        elif e.type == "TokensCommitted":
            r.commits.append((e.ts, len(p["token_ids"])))
        elif e.type == "RequestMigrated":
            r.migrations += 1
        elif e.type == "RequestCompleted":
            r.completion_tokens = int(p["completion_tokens"])
            r.prompt_tokens = r.prompt_tokens or int(p["prompt_tokens"])
            t = p["ttft"]
            r.ttft_s, r.exposed_transfer_s = float(t["ttft_s"]), float(t["exposed_transfer_s"])
            r.queue_s = float(t["queue_s"])
            r.e2e_s = float(p["e2e_s"])
            if r.prefill_s is None:
                r.prefill_s = float(t["prefill_s"])
        elif e.type == "RequestFailed":
            r.failed_reason = f"{p['phase']}: {p['reason']}"
    return out


class ClientITL(BaseModel):
    """ITL as a client measured it (`pdserve bench serve`'s result JSON: metrics.latency.itl), ms."""

    model_config = ConfigDict(frozen=True)

    p50_ms: float
    p99_ms: float
    samples: int
    source: str


@dataclass(frozen=True)
class Evidence:
    """Everything measured, by name, plus the folded requests and the routing report."""

    requests: int
    completed: int
    modes: dict[str, int]
    prefill_workers: tuple[str, ...]
    decode_workers: tuple[str, ...]
    m: dict[str, Measurement]
    routing: RoutingReport
    tiers: dict[str, int]

    def value(self, name: str) -> float | None:
        return self.m[name].value if name in self.m else None


def _itl_from_commits(facts: Iterable[RequestFacts]) -> list[float]:
    """Mean inter-token latency of each commit window after a request's first: (ts_k − ts_{k−1}) /
    tokens_k, seconds."""
    out = []
    for r in facts:
        for (t0, _), (t1, n) in zip(r.commits, r.commits[1:], strict=False):
            if n > 0 and t1 > t0:
                out.append((t1 - t0) / n)
    return out


def tpot_s(r: RequestFacts) -> float:
    """Time per output token after the first, seconds: (e2e − TTFT) / (completion_tokens − 1), vLLM's TPOT;
    0 for a request with one output token (vLLM's convention too)."""
    n = r.completion_tokens or 0
    return (r.e2e_s - r.ttft_s) / (n - 1) if n > 1 and r.e2e_s is not None and r.ttft_s is not None else 0.0


DEFAULT_SLO_MS = {"ttft": 2000.0, "tpot": 200.0}  # `pdserve bench compare`'s default goodput SLO


def _reuse_ceiling(routed_events: Iterable[Event]) -> tuple[int, int]:
    """(prompt tokens whose block an earlier request of the window had already computed, prompt tokens):
    the hit rate of one infinite cache holding every block ever computed (`RequestRouted.
    prompt_block_hashes`, chained hashes: a hash match is a whole-prefix match)."""
    seen: set[int] = set()
    reusable = total = 0
    for e in routed_events:
        if e.type != "RequestRouted":
            continue
        bs, hashes = int(e.payload.get("block_size", 0)), e.payload.get("prompt_block_hashes", ())
        total += bs * len(hashes)
        for h in hashes:
            if h in seen:
                reusable += bs
            else:
                seen.add(h)
    return reusable, total


def measure(
    evts: Sequence[Event], client_itl: ClientITL | None = None, slo_ms: dict[str, float] | None = None
) -> Evidence:
    """Every measurement advise uses, from `evts` (stream order). `slo_ms`: the SLO attainment is counted
    at ({"ttft": ms, "tpot": ms}; default `DEFAULT_SLO_MS`)."""
    facts = fold(evts)
    done = [r for r in facts.values() if r.completion_tokens is not None]
    modes: dict[str, int] = {}
    for r in facts.values():
        if r.mode:
            modes[r.mode] = modes.get(r.mode, 0) + 1
    m: dict[str, Measurement] = {}

    def put(x: Measurement) -> None:
        m[x.name] = x

    # transfer: bytes and GB/s
    xfer = [r for r in facts.values() if r.transfer_s and r.transfer_bytes]
    src_x = "TransferCompleted (kv_bytes + state_bytes) / transfer_s"
    if xfer:
        gbs = [r.transfer_bytes / r.transfer_s / 1e9 for r in xfer]
        note = (
            "transfer_s runs from the reservation to the last layer verified, so with layer-wise "
            "streaming it spans the prefill: a lower bound on the link's bandwidth"
        )
        put(measured("transfer_GB_s_p50", percentile(gbs, 50), "GB/s", src_x, len(xfer), note))
        put(measured("transfer_GB_s_max", max(gbs), "GB/s", src_x, len(xfer), note))
        for q in (50, 95):
            put(
                measured(
                    f"transfer_bytes_p{q}",
                    percentile([r.transfer_bytes for r in xfer], q),
                    "B",
                    "TransferCompleted.kv_bytes + state_bytes",
                    len(xfer),
                )
            )
            put(
                measured(
                    f"transfer_s_p{q}",
                    percentile([r.transfer_s for r in xfer], q),
                    "s",
                    "TransferCompleted.transfer_s",
                    len(xfer),
                )
            )
        put(
            measured(
                "state_bytes_p50",
                percentile([r.state_bytes for r in xfer], 50),
                "B",
                "TransferCompleted.state_bytes",
                len(xfer),
            )
        )
    else:
        why = "no TransferCompleted in the window: no request was disaggregated (colocated or local prefill)"
        put(missing("transfer_GB_s_max", "GB/s", src_x, why))
    exposed = [
        r.exposed_transfer_s for r in done if r.exposed_transfer_s is not None and r.mode == "disaggregated"
    ]
    if exposed:
        put(
            measured(
                "exposed_transfer_s_p95",
                percentile(exposed, 95),
                "s",
                "RequestCompleted.ttft.exposed_transfer_s (disaggregated requests)",
                len(exposed),
            )
        )

    # prompt lengths and prefill time
    prompts = [r.prompt_tokens for r in done if r.prompt_tokens]
    prefills = [r.prefill_s for r in done if r.prefill_s]
    for q in (50, 95):
        if prompts:
            put(
                measured(
                    f"prompt_tokens_p{q}",
                    percentile(prompts, q),
                    "tokens",
                    "RequestCompleted.prompt_tokens",
                    len(prompts),
                )
            )
        if prefills:
            put(
                measured(
                    f"prefill_s_p{q}",
                    percentile(prefills, q),
                    "s",
                    "PrefillCompleted.prefill_s, else RequestCompleted.ttft.prefill_s",
                    len(prefills),
                )
            )
    if not prompts:
        put(missing("prompt_tokens_p50", "tokens", "RequestCompleted", "no completed request in the window"))

    # prefill:decode ratio
    prompt_sum = sum(r.prompt_tokens for r in done)
    out_sum = sum(r.completion_tokens or 0 for r in done)
    if done and out_sum:
        put(
            measured(
                "prompt_to_output_ratio",
                prompt_sum / out_sum,
                "×",
                "Σ RequestCompleted.prompt_tokens / Σ completion_tokens",
                len(done),
            )
        )
        computed = [r for r in done if r.computed_tokens is not None]
        if computed:
            put(
                measured(
                    "computed_to_output_ratio",
                    sum(r.computed_tokens for r in computed)
                    / max(sum(r.completion_tokens or 0 for r in computed), 1),
                    "×",
                    "Σ PrefillCompleted.num_computed_tokens / Σ RequestCompleted.completion_tokens",
                    len(computed),
                )
            )
    else:
        put(missing("prompt_to_output_ratio", "×", "RequestCompleted", "no completed request with output"))

    # interference: ITL p99 / p50
    if client_itl is not None:
        put(measured("itl_p50_ms", client_itl.p50_ms, "ms", client_itl.source, client_itl.samples))
        put(measured("itl_p99_ms", client_itl.p99_ms, "ms", client_itl.source, client_itl.samples))
        put(
            measured(
                "itl_p99_over_p50",
                client_itl.p99_ms / client_itl.p50_ms,
                "×",
                client_itl.source,
                client_itl.samples,
            )
        )
    else:
        windows = _itl_from_commits(done)
        src = "TokensCommitted: (ts_k − ts_k−1) / tokens_k per commit window after a request's first"
        if len(windows) >= 2:
            p50, p99 = percentile(windows, 50), percentile(windows, 99)
            note = (
                "a window's mean over its tokens (16 by default): a single-token stall is diluted, so "
                "this understates the p99/p50 a client sees; pass --itl-from a bench serve result"
            )
            put(measured("itl_p50_ms", p50 * 1e3, "ms", src, len(windows), note))
            put(measured("itl_p99_ms", p99 * 1e3, "ms", src, len(windows), note))
            put(
                measured("itl_p99_over_p50", p99 / p50 if p50 > 0 else math.inf, "×", src, len(windows), note)
            )
        else:
            put(
                missing(
                    "itl_p99_over_p50",
                    "×",
                    src,
                    "fewer than two commit windows after the first: outputs "
                    "too short for the log to show ITL; pass --itl-from a bench serve result",
                )
            )

    # SLO attainment (DistServe's goodput counts the requests that meet it)
    slo = slo_ms or DEFAULT_SLO_MS
    ended = [r for r in facts.values() if r.completion_tokens is not None or r.failed_reason]
    if ended:
        met = [
            r.completion_tokens is not None
            and r.ttft_s * 1e3 <= slo["ttft"]
            and tpot_s(r) * 1e3 <= slo["tpot"]
            for r in ended
        ]
        put(
            measured(
                "slo_attainment",
                sum(met) / len(ended),
                "of requests",
                f"RequestCompleted.ttft.ttft_s ≤ {slo['ttft']:g} ms and (e2e_s − ttft_s) / "
                f"(completion_tokens − 1) ≤ {slo['tpot']:g} ms; a RequestFailed misses it",
                len(ended),
                "TTFT from the gateway's receive to the first token leaving the decode worker: a client's "
                "TTFT less its HTTP and SSE hops",
            )
        )
    else:
        put(missing("slo_attainment", "of requests", "RequestCompleted", "no request ended in the window"))

    # capacity headroom
    n = len(facts)
    deferred = sum(r.deferrals > 0 for r in facts.values())
    put(
        measured(
            "admission_deferred_share",
            deferred / n if n else 0.0,
            "of requests",
            "AdmissionDeferred (requests with at least one)",
            n,
        )
    )
    failed = [r for r in facts.values() if r.failed_reason]
    put(
        measured(
            "failed_share",
            len(failed) / n if n else 0.0,
            "of requests",
            "RequestFailed",
            n,
            "; ".join(sorted({r.failed_reason for r in failed})[:3]),
        )
    )
    put(
        missing(
            "preemptions",
            "count",
            "engine (LLMEngine.stats.num_preemptions)",
            "preemptions are an engine counter, not an event: the log cannot show them",
        )
    )

    # routing: hit rate per replica against the ceilings
    routed_evts = [e for e in evts if e.type in ("RequestReceived", "RequestRouted", "PrefillCompleted")]
    routing = summarize(fold_routed(routed_evts))
    if routing.requests and routing.prompt_tokens:
        src = "PrefillCompleted.num_cached_tokens / prompt tokens"
        put(measured("hit_rate", routing.hit_rate, "of prompt tokens", src, routing.requests))
        put(
            measured(
                "router_ceiling_hit_rate",
                routing.ceiling_hit_rate,
                "of prompt tokens",
                "RequestRouted.best_cached_tokens (the most any candidate held) / prompt tokens",
                routing.requests,
            )
        )
        put(
            measured(
                "routing_gap_share",
                routing.gap_tokens / routing.prompt_tokens,
                "of prompt tokens",
                "Σ (best_cached_tokens − num_cached_tokens)⁺ / prompt tokens",
                routing.requests,
            )
        )
        reusable, total = _reuse_ceiling(routed_evts)
        if total:
            put(
                measured(
                    "reuse_ceiling_hit_rate",
                    reusable / total,
                    "of prompt tokens",
                    "RequestRouted.prompt_block_hashes seen earlier in the window (one infinite cache)",
                    routing.requests,
                )
            )
            put(
                measured(
                    "eviction_gap_share",
                    max(reusable / total - routing.ceiling_hit_rate, 0.0),
                    "of prompt tokens",
                    "reuse ceiling − router ceiling: blocks computed before but held "
                    "by no worker when routed",
                    routing.requests,
                )
            )
    else:
        put(
            missing(
                "hit_rate",
                "of prompt tokens",
                "PrefillCompleted",
                "no PrefillCompleted in the window: a colocated or local prefill does not report its "
                "cached tokens to the log",
            )
        )

    tiers: dict[str, int] = {}
    for r in done:
        for t, k in r.cached_by_tier.items():
            if t not in BASE_TIERS:
                tiers[t] = tiers.get(t, 0) + k
    if tiers and prompt_sum:
        for t, k in sorted(tiers.items()):
            put(
                measured(
                    f"tier_hit_rate[{t}]",
                    k / prompt_sum,
                    "of prompt tokens",
                    f"PrefillCompleted.{TIER_FIELD}[{t}]",
                    len(done),
                )
            )
    return Evidence(
        requests=n,
        completed=len(done),
        modes=modes,
        prefill_workers=tuple(
            sorted(
                {r.prefill_worker for r in facts.values() if r.prefill_worker and r.mode == "disaggregated"}
            )
        ),
        decode_workers=tuple(sorted({r.decode_worker for r in facts.values() if r.decode_worker})),
        m=m,
        routing=routing,
        tiers=tiers,
    )


async def load_events(
    db: AsyncEngine, since: datetime | None = None, until: datetime | None = None
) -> list[Event]:
    """Every event of the requests received in [since, until) (a `RequestReceived` in the window), in
    stream order. Raises `sqlalchemy.exc.DBAPIError` / `OSError` when the store cannot be read."""
    window = sa.select(events.c.request_id).where(events.c.type == "RequestReceived")
    if since is not None:
        window = window.where(events.c.ts >= since)
    if until is not None:
        window = window.where(events.c.ts < until)
    q = (
        sa.select(events)
        .where(events.c.request_id.in_(window.distinct().scalar_subquery()))
        .order_by(events.c.stream_seq)
    )
    async with db.connect() as conn:
        rows = (await conn.execute(q)).mappings().all()
    return [row_event(r).event for r in rows]


def client_itl_from_bench(result: dict, source: str) -> ClientITL:
    """ITL percentiles out of a `pdserve bench serve` result JSON (`metrics.latency.itl`, seconds inside;
    `percentiles_ms` keyed by '50'/'99' or p50/p99). Raises KeyError when it has none."""
    itl = result["metrics"]["latency"]["itl"]
    pct = itl.get("percentiles_ms") or {}
    p50 = pct.get("50.0") or pct.get("50") or itl["median_ms"]
    p99 = pct.get("99.0") or pct.get("99")
    if p99 is None:
        raise KeyError("the bench result has no ITL p99 (run bench serve with --percentiles 50 99)")
    return ClientITL(p50_ms=float(p50), p99_ms=float(p99), samples=int(itl.get("count", 0)), source=source)
