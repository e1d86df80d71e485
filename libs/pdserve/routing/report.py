"""Routing quality from the event log: per-replica prefix-cache hit rate against the perfect-router
ceiling, the prefill tokens the gap cost, how well the router predicted hits, and load balance.

Input: the `RequestRouted` and `PrefillCompleted` events of each request (and `RequestReceived` for the
prompt length). Hit rate = cached prompt tokens / prompt tokens. The ceiling of a request is
`RequestRouted.best_cached_tokens`, the most any candidate worker held when it was routed; the gap is
ceiling − actual cached tokens (clipped at 0), i.e. prompt tokens computed that a perfect router would
have served from cache. Prediction = `predicted_cached_tokens` against `PrefillCompleted.num_cached_tokens`.
Load = requests routed per replica and the mean `active_requests` the candidates reported, max/min.

A hybrid's hit is a pair (docs/architecture.md §12): beside the KV hit L (`num_cached_tokens`) each
request has the state checkpoint C <= L its prefill resumed from (`PrefillCompleted.num_checkpoint_tokens`,
predicted as `RequestRouted.predicted_checkpoint_tokens`); it computed prompt − C. Llama's C is its L.
Tiers (issue 16): the cached tokens are split by where their KV came from (`PrefillCompleted.
cached_tokens_by_tier`: "pool", "offload", ...; events recorded before that field count as "pool"), so the
hit rate is reported per tier beside the ceiling (which counts a block in any tier of any candidate).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from pdserve.events import Event
from pdserve.routing.kv_index import TIER_RANK


@dataclass
class RoutedRequest:
    """One request's routing facts, folded from its events. `actual_cached_tokens` is None until its
    prefill completed."""

    request_id: str
    ts: float
    mode: str
    policy: str
    replica: str  # the worker that ran the prefill (the decode worker for local / colocated)
    prompt_tokens: int
    predicted_cached_tokens: int
    best_cached_tokens: int
    actual_cached_tokens: int | None
    block_size: int = 0
    block_hashes: tuple[int, ...] = ()
    candidate_active: dict[str, int] = field(default_factory=dict)
    prefill_s: float | None = None
    predicted_checkpoint_tokens: int = 0
    actual_checkpoint_tokens: int | None = None  # a hybrid's C (None: not prefilled yet, or no state)
    computed_tokens: int | None = None
    cached_tokens_by_tier: dict[str, int] = field(default_factory=dict)


def _by_tier(payload: dict) -> dict[str, int]:
    by_tier = {k: int(v) for k, v in (payload.get("cached_tokens_by_tier") or {}).items() if v}
    cached = int(payload["num_cached_tokens"])
    if not by_tier and cached:
        by_tier = {"pool": cached}  # recorded before tiers existed: the pool was the only one
    return by_tier


def _sum_tiers(rows: Iterable[dict[str, int]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for row in rows:
        for k, v in row.items():
            out[k] = out.get(k, 0) + v
    rank = {t: i for i, t in enumerate(TIER_RANK)}
    return dict(sorted(out.items(), key=lambda kv: (rank.get(kv[0], len(rank)), kv[0])))  # pool first


def fold_routed(events: Iterable[Event]) -> list[RoutedRequest]:
    """Requests with a `RequestRouted` event, from events in stream order (several requests interleaved).
    The last route and the last prefill of a request count (a retried prefill replaces the first)."""
    received: dict[str, int] = {}
    routed: dict[str, RoutedRequest] = {}
    prefilled: dict[str, tuple[int, int, float, int, dict[str, int]]] = {}
    for e in events:
        p = e.payload
        if e.type == "RequestReceived":
            received[e.request_id] = int(p["num_prompt_tokens"])
        elif e.type == "RequestRouted":
            routed[e.request_id] = RoutedRequest(
                request_id=e.request_id,
                ts=e.ts,
                mode=p["mode"],
                policy=p.get("policy", ""),
                replica=p["prefill_worker_id"],
                prompt_tokens=0,
                predicted_cached_tokens=int(p.get("predicted_cached_tokens", 0)),
                best_cached_tokens=int(p.get("best_cached_tokens", 0)),
                actual_cached_tokens=None,
                block_size=int(p.get("block_size", 0)),
                block_hashes=tuple(p.get("prompt_block_hashes", ())),
                candidate_active={c["worker_id"]: int(c["active_requests"]) for c in p.get("candidates", [])},
                predicted_checkpoint_tokens=int(p.get("predicted_checkpoint_tokens", 0)),
            )
        elif e.type == "PrefillCompleted":
            prefilled[e.request_id] = (
                int(p["num_cached_tokens"]),
                int(p["num_computed_tokens"]),
                float(p.get("prefill_s", 0.0)),
                int(p.get("num_checkpoint_tokens", 0)),
                _by_tier(p),
            )
    for rid, r in routed.items():
        if rid in prefilled:
            cached, computed, prefill_s, checkpoint, by_tier = prefilled[rid]
            r.actual_cached_tokens, r.prefill_s, r.computed_tokens = cached, prefill_s, computed
            r.cached_tokens_by_tier = by_tier
            r.prompt_tokens = received.get(rid, cached + computed)
            # A hybrid computed prompt − C (C <= L); one whose C and L are both 0 reads as a model without
            # state, and counts nothing either way.
            if checkpoint or r.predicted_checkpoint_tokens or computed > r.prompt_tokens - cached:
                r.actual_checkpoint_tokens = checkpoint
        else:
            r.prompt_tokens = received.get(rid, 0)
    return sorted(routed.values(), key=lambda r: r.ts)


@dataclass(frozen=True)
class ReplicaStats:
    replica: str
    requests: int
    prompt_tokens: int
    cached_tokens: int
    ceiling_tokens: int
    mean_active_requests: float
    checkpoint_tokens: int = 0  # a hybrid's: prompt tokens its prefills resumed past (sum of C)
    cached_tokens_by_tier: dict[str, int] = field(default_factory=dict)

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def hit_rate_by_tier(self) -> dict[str, float]:
        """Cached tokens from each tier / prompt tokens; the values sum to `hit_rate`."""
        if not self.prompt_tokens:
            return {}
        return {t: n / self.prompt_tokens for t, n in self.cached_tokens_by_tier.items()}

    @property
    def ceiling_hit_rate(self) -> float:
        return self.ceiling_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass(frozen=True)
class RoutingReport:
    """Totals over the requests whose prefill completed; `replicas` sorted by id."""

    requests: int
    unfinished: int
    prompt_tokens: int
    cached_tokens: int
    ceiling_tokens: int
    gap_tokens: int
    prediction_exact: float
    prediction_mae_tokens: float
    replicas: tuple[ReplicaStats, ...]
    modes: dict[str, int]
    policies: dict[str, int]
    hybrid_requests: int = 0  # requests of a model with state (their hit is a pair)
    checkpoint_tokens: int = 0  # their sum of C
    hybrid_cached_tokens: int = 0  # their sum of L
    checkpoint_prediction_exact: float = 1.0
    cached_tokens_by_tier: dict[str, int] = field(default_factory=dict)

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def hit_rate_by_tier(self) -> dict[str, float]:
        """Cached tokens from each tier ("pool", "offload", ...) / prompt tokens; sums to `hit_rate`."""
        if not self.prompt_tokens:
            return {}
        return {t: n / self.prompt_tokens for t, n in self.cached_tokens_by_tier.items()}

    @property
    def ceiling_hit_rate(self) -> float:
        return self.ceiling_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def of_ceiling(self) -> float:
        return self.cached_tokens / self.ceiling_tokens if self.ceiling_tokens else 1.0

    @property
    def max_min_requests(self) -> float:
        counts = [r.requests for r in self.replicas]
        return max(counts) / max(min(counts), 1) if counts else 1.0

    @property
    def max_min_active_requests(self) -> float:
        act = [r.mean_active_requests for r in self.replicas]
        return max(act) / min(act) if act and min(act) > 0 else float("inf") if act and max(act) > 0 else 1.0


def summarize(requests: Sequence[RoutedRequest]) -> RoutingReport:
    """The report over `requests` (those without a completed prefill count only as `unfinished`)."""
    done = [r for r in requests if r.actual_cached_tokens is not None]
    replicas: dict[str, list[RoutedRequest]] = {}
    active: dict[str, list[int]] = {}
    for r in done:
        replicas.setdefault(r.replica, []).append(r)
        for wid, n in r.candidate_active.items():
            active.setdefault(wid, []).append(n)
    stats = tuple(
        ReplicaStats(
            replica=wid,
            requests=len(rs),
            prompt_tokens=sum(r.prompt_tokens for r in rs),
            cached_tokens=sum(r.actual_cached_tokens or 0 for r in rs),
            ceiling_tokens=sum(r.best_cached_tokens for r in rs),
            mean_active_requests=sum(active.get(wid, [0])) / max(len(active.get(wid, [])), 1),
            checkpoint_tokens=sum(r.actual_checkpoint_tokens or 0 for r in rs),
            cached_tokens_by_tier=_sum_tiers(r.cached_tokens_by_tier for r in rs),
        )
        for wid, rs in sorted(replicas.items())
    )
    cached = sum(r.actual_cached_tokens or 0 for r in done)
    errors = [abs(r.predicted_cached_tokens - (r.actual_cached_tokens or 0)) for r in done]
    hybrid = [r for r in done if r.actual_checkpoint_tokens is not None]
    modes: dict[str, int] = {}
    policies: dict[str, int] = {}
    for r in done:
        modes[r.mode] = modes.get(r.mode, 0) + 1
        policies[r.policy or "?"] = policies.get(r.policy or "?", 0) + 1
    return RoutingReport(
        requests=len(done),
        unfinished=len(requests) - len(done),
        prompt_tokens=sum(r.prompt_tokens for r in done),
        cached_tokens=cached,
        ceiling_tokens=sum(r.best_cached_tokens for r in done),
        gap_tokens=sum(max(r.best_cached_tokens - (r.actual_cached_tokens or 0), 0) for r in done),
        prediction_exact=sum(e == 0 for e in errors) / len(errors) if errors else 1.0,
        prediction_mae_tokens=sum(errors) / len(errors) if errors else 0.0,
        replicas=stats,
        modes=modes,
        policies=policies,
        hybrid_requests=len(hybrid),
        checkpoint_tokens=sum(r.actual_checkpoint_tokens or 0 for r in hybrid),
        hybrid_cached_tokens=sum(r.actual_cached_tokens or 0 for r in hybrid),
        checkpoint_prediction_exact=(
            sum(r.predicted_checkpoint_tokens == r.actual_checkpoint_tokens for r in hybrid) / len(hybrid)
            if hybrid else 1.0),
        cached_tokens_by_tier=_sum_tiers(r.cached_tokens_by_tier for r in done),
    )
