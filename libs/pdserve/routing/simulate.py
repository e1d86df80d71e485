"""Discrete-event simulation of prefill placement: the router's real `Placer` (KV index, bookings,
policy) in front of N prefill workers modelled by `PrefixCacheModel`s, in virtual time.

Used by `benchmarks/routing.py` (synthetic workloads) and `pdserve replay --routing` (logged requests).
Each prefill worker runs one prefill at a time, first come first served, taking
`prefill_fixed_s + prefill_s_per_token · uncached tokens`; its prefix cache is looked up when the prefill
starts and the resulting KV events reach the router when it ends (blocks are published once computed),
as do the worker's heartbeats every `heartbeat_s`. One decode worker holds each request for
`decode_s` after its prefill.

Two ceilings. The issue's, and the headline: per decision, the most cached tokens any worker held when the
request was routed (`RouteDecision.best_cached_tokens`, what `pdserve report routing` sums from the log);
it follows the policy's own placements, so it asks "did the router find the best cache there was?". The
pooled one: a single LRU cache of all workers' capacity together fed the same requests in arrival order, a
router that never computes a block twice; it is the same for every policy and can be above or below the
other (pooling also pools the capacity: no prefix is ever duplicated).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from pdserve.config import RouterSettings
from pdserve.messages import CompatibilityDescriptor, Heartbeat, Role, RouteRequest
from pdserve.routing.cache_model import PrefixCacheModel
from pdserve.routing.router import Placer


@dataclass(frozen=True)
class SimRequest:
    """One request: arrival (seconds from the start), prompt length (tokens), its full blocks' hashes."""

    request_id: str
    arrival_s: float
    num_prompt_tokens: int
    block_hashes: tuple[int, ...]


@dataclass(frozen=True)
class SimConfig:
    num_prefill_workers: int = 4
    capacity_blocks: int = 128
    block_size: int = 16
    prefill_fixed_s: float = 0.01
    prefill_s_per_token: float = 0.0004
    decode_s: float = 1.0
    heartbeat_s: float = 0.5


@dataclass
class SimOutcome:
    """Per request: chosen worker, predicted / actual / best-any-worker cached tokens, prefill latency
    (arrival → prefill end, seconds); per prefill worker, the active requests it had at each decision."""

    policy: str
    worker: dict[str, str] = field(default_factory=dict)
    predicted: dict[str, int] = field(default_factory=dict)
    actual: dict[str, int] = field(default_factory=dict)
    best: dict[str, int] = field(default_factory=dict)
    latency_s: dict[str, float] = field(default_factory=dict)
    prompt: dict[str, int] = field(default_factory=dict)
    active: dict[str, list[int]] = field(default_factory=dict)
    prompt_tokens: int = 0
    ceiling_tokens: int = 0

    def summary(self, worker_ids: Sequence[str]) -> dict:
        """Hit rates (cached / prompt tokens) against both ceilings (module docstring), prediction
        accuracy, load balance. `max_min_active_requests`: each worker's mean active requests (queued or
        running prefills) over the routing decisions, max/min, as `pdserve report routing` computes it;
        `max_min_requests`: requests routed per worker, max/min."""
        cached = sum(self.actual.values())
        best = sum(self.best.values())
        counts = {w: 0 for w in worker_ids}
        computed = {w: 0 for w in worker_ids}
        for r, w in self.worker.items():
            counts[w] += 1
            computed[w] += self.prompt[r] - self.actual[r]
        mean_active = {w: sum(a) / len(a) if a else 0.0 for w in worker_ids for a in [self.active.get(w, [])]}
        exact = sum(self.predicted[r] == self.actual[r] for r in self.actual)
        lat = sorted(self.latency_s.values())
        return {
            "policy": self.policy,
            "requests": len(self.actual),
            "hit_rate": cached / self.prompt_tokens,
            "ceiling_hit_rate": best / self.prompt_tokens,
            "of_ceiling": cached / best if best else 1.0,
            "gap_tokens": sum(max(self.best[r] - self.actual[r], 0) for r in self.actual),
            "above_ceiling_requests": sum(self.actual[r] > self.best[r] for r in self.actual),
            "pooled_ceiling_hit_rate": self.ceiling_tokens / self.prompt_tokens,
            "of_pooled_ceiling": cached / self.ceiling_tokens if self.ceiling_tokens else 1.0,
            "prediction_exact": exact / len(self.actual),
            "prediction_mae_tokens": sum(abs(self.predicted[r] - self.actual[r]) for r in self.actual)
            / len(self.actual),
            "requests_per_worker": counts,
            "computed_tokens_per_worker": computed,
            "mean_active_requests_per_worker": mean_active,
            "max_min_active_requests": _max_min(mean_active.values()),
            "max_min_requests": _max_min(counts.values()),
            "max_min_computed_tokens": _max_min(computed.values()),
            "prefill_latency_p50_s": lat[len(lat) // 2],
            "prefill_latency_p90_s": lat[int(len(lat) * 0.9)],
        }


def _max_min(values: Iterable[float]) -> float:
    """max / min of non-negative values; inf when the min is 0 and the max is not, 1 when all are 0."""
    vs = list(values)
    hi, lo = max(vs), min(vs)
    return hi / lo if lo > 0 else (float("inf") if hi > 0 else 1.0)


def sim_descriptor(block_size: int) -> CompatibilityDescriptor:
    """The one descriptor every simulated worker shares (all compatible)."""
    return CompatibilityDescriptor(
        model="sim",
        weights_hash="sim",
        dtype="float32",
        block_size=block_size,
        num_layers=1,
        num_kv_heads=1,
        head_dim=1,
        hash_seed=0,
        layout_version=1,
    )


def ceiling_tokens(requests: Sequence[SimRequest], config: SimConfig) -> int:
    """Cached tokens a perfect router reaches: one LRU cache of every worker's capacity together."""
    pooled = PrefixCacheModel("pooled", config.capacity_blocks * config.num_prefill_workers)
    pooled.start()
    total = 0
    for r in sorted(requests, key=lambda r: r.arrival_s):
        hit, _ = pooled.prefill(r.block_hashes, (r.num_prompt_tokens - 1) // config.block_size)
        total += hit * config.block_size
    return total


def simulate(
    requests: Sequence[SimRequest], settings: RouterSettings, config: SimConfig, ceiling: int | None = None
) -> SimOutcome:
    """Route and serve `requests` with the router configured by `settings`; returns the outcome.
    `ceiling` (tokens) skips recomputing `ceiling_tokens` when running several policies."""
    now = [0.0]
    placer = Placer(settings, clock=lambda: now[0])
    desc = sim_descriptor(config.block_size)
    bs = config.block_size
    wids = [f"prefill-{i}" for i in range(config.num_prefill_workers)]
    caches = {w: PrefixCacheModel(w, config.capacity_blocks) for w in wids}
    queue: dict[str, list[SimRequest]] = {w: [] for w in wids}
    busy: dict[str, bool] = dict.fromkeys(wids, False)
    out = SimOutcome(policy=placer.policy.name, prompt_tokens=sum(r.num_prompt_tokens for r in requests))
    out.ceiling_tokens = ceiling if ceiling is not None else ceiling_tokens(requests, config)
    heap: list[tuple[float, int, str, object]] = []
    counter = [0]

    def push(t: float, kind: str, item: object) -> None:
        counter[0] += 1
        heapq.heappush(heap, (t, counter[0], kind, item))

    def heartbeat(wid: str, role: Role) -> Heartbeat:
        running = int(busy.get(wid, False))
        waiting = len(queue.get(wid, ()))
        return Heartbeat(
            worker_id=wid,
            role=role,
            descriptor=desc,
            num_running=running,
            num_waiting=waiting,
            kv_capacity_tokens=config.capacity_blocks * bs,
            kv_free_tokens=config.capacity_blocks * bs,
            ts=now[0],
        )

    def start_next(wid: str) -> None:
        if busy[wid] or not queue[wid]:
            return
        r = queue[wid].pop(0)
        busy[wid] = True
        hit, batch = caches[wid].prefill(r.block_hashes, (r.num_prompt_tokens - 1) // bs)
        out.actual[r.request_id] = hit * bs
        duration = config.prefill_fixed_s + config.prefill_s_per_token * (r.num_prompt_tokens - hit * bs)
        push(now[0] + duration, "prefilled", (wid, r, batch))

    for w in wids:
        placer.observe_kv_events(caches[w].start())
        placer.observe_heartbeat(heartbeat(w, Role.PREFILL))
    placer.observe_heartbeat(heartbeat("decode-0", Role.DECODE))
    for r in requests:
        push(r.arrival_s, "arrive", r)
    push(config.heartbeat_s, "heartbeat", None)
    pending = len(requests)
    while heap and pending:
        now[0], _, kind, item = heapq.heappop(heap)
        if kind == "arrive":
            r = item  # type: ignore[assignment]
            d = placer.route(
                RouteRequest(request_id=r.request_id, num_prompt_tokens=r.num_prompt_tokens),
                block_hashes=r.block_hashes,
            )
            out.worker[r.request_id] = d.prefill_worker_id
            for c in d.candidates:
                if c.role is Role.PREFILL:
                    out.active.setdefault(c.worker_id, []).append(c.active_requests)
            out.predicted[r.request_id] = d.predicted_cached_tokens
            out.best[r.request_id] = d.best_cached_tokens
            out.prompt[r.request_id] = r.num_prompt_tokens
            queue[d.prefill_worker_id].append(r)
            start_next(d.prefill_worker_id)
        elif kind == "prefilled":
            wid, r, batch = item  # type: ignore[misc]
            if batch is not None:
                placer.observe_kv_events(batch)
            placer.prefill_done(r.request_id)
            out.latency_s[r.request_id] = now[0] - r.arrival_s
            busy[wid] = False
            pending -= 1
            push(now[0] + config.decode_s, "decoded", r.request_id)
            start_next(wid)
        elif kind == "decoded":
            placer.release(item)  # type: ignore[arg-type]
        elif kind == "heartbeat":
            for w in wids:
                placer.observe_heartbeat(heartbeat(w, Role.PREFILL))
            placer.observe_heartbeat(heartbeat("decode-0", Role.DECODE))
            push(now[0] + config.heartbeat_s, "heartbeat", None)
    return out
