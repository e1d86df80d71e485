"""Placement policies: which prefill worker and which decode worker serve a request.

`RoutingPolicy.choose` sees the live workers and returns a `RouteDecision` with every candidate's cost,
so the decision is auditable from the `RequestRouted` event. Only compatible pairs are ever chosen
(equal `CompatibilityDescriptor`s).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from pdserve.bus import RejectedError
from pdserve.messages import CandidateCost, RejectCode, Role, RouteDecision, RouteRequest
from pdserve.routing.registry import WorkerRegistry, WorkerState


def candidate_cost(state: WorkerState) -> CandidateCost:
    """Load cost = active requests + KV usage fraction (the fraction only breaks ties)."""
    return CandidateCost(
        worker_id=state.heartbeat.worker_id,
        role=state.heartbeat.role,
        cost=state.active_requests + state.kv_usage,
        active_requests=state.active_requests,
        kv_usage=state.kv_usage,
    )


class RoutingPolicy(ABC):
    """Decides placement. Lifecycle: constructed once per router; `choose` is called per request and
    must not block (it runs on the router's event loop)."""

    @abstractmethod
    def choose(self, request: RouteRequest, registry: WorkerRegistry) -> RouteDecision:
        """Raises `RejectedError(NO_WORKERS)` when no compatible placement exists."""


class LeastLoaded(RoutingPolicy):
    """Least cost first, ties broken by worker id. Disaggregated when a compatible prefill+decode pair
    is live; colocated on unified workers otherwise."""

    def choose(self, request: RouteRequest, registry: WorkerRegistry) -> RouteDecision:
        prefill, decode = registry.live(Role.PREFILL), registry.live(Role.DECODE)
        pairs = [
            (candidate_cost(p), candidate_cost(d))
            for p in prefill
            for d in decode
            if WorkerRegistry.compatible(p.heartbeat.descriptor, d.heartbeat.descriptor)
        ]
        if pairs:
            p, d = min(pairs, key=lambda pd: (pd[0].cost, pd[1].cost, pd[0].worker_id, pd[1].worker_id))
            seen = {c.worker_id: c for pair in pairs for c in pair}
            return RouteDecision(
                request_id=request.request_id, mode="disaggregated", prefill_worker_id=p.worker_id,
                decode_worker_id=d.worker_id, candidates=tuple(seen.values()),
            )
        unified = [candidate_cost(s) for s in registry.live(Role.UNIFIED)]
        if unified:
            u = min(unified, key=lambda c: (c.cost, c.worker_id))
            return RouteDecision(
                request_id=request.request_id, mode="colocated", prefill_worker_id=u.worker_id,
                decode_worker_id=u.worker_id, candidates=tuple(unified),
            )
        raise RejectedError(RejectCode.NO_WORKERS, "no live compatible prefill+decode pair or unified worker")
