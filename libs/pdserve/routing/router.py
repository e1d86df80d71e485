"""The router: its decision for one request — mode, prefill worker, decode worker (a placement) — and the
state it decides from (live workers, the KV index, the router's own load bookings).

Disaggregated stack: the decode worker is the one with the fewest booked decode blocks (then fewest
active requests). Conditional disaggregation (Dynamo's disaggregated router: prefill remotely only when
the prefill is long, "max_local_prefill_length"): if the prompt's uncached tokens on that decode worker
are at most `local_prefill_max_tokens` and it has at most `local_prefill_max_active_requests` active
requests, it prefills locally (mode `local`). Otherwise the policy picks the prefill worker among those
compatible with the decode worker. Unified workers only: the policy picks one (mode `colocated`). Decode
workers but no live compatible prefill worker (all died, or none started yet): the least loaded decode
worker prefills locally rather than the request failing (Dynamo's disaggregated router likewise falls
back to local prefill when no prefill worker is available).

Every decision records each candidate's cost terms, the predicted cached tokens on the chosen prefill
worker, and the most cached tokens any candidate held (the perfect-router ceiling for this request).
A fully cached prompt still computes its last token, so a hit covers at most (n − 1) // block_size
blocks (as vLLM's prefix cache: `max_cache_hit_length = num_tokens − 1`). For a hybrid (a descriptor
with a state layout) the hit is a pair: the KV hit L and the longest state checkpoint C <= L the worker
published; the prefill computes prompt − C, which is what the cost counts and `RouteDecision` predicts
(`predicted_cached_tokens` L, `predicted_checkpoint_tokens` C).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from pdserve.bus import RejectedError
from pdserve.config import RouterSettings
from pdserve.engine.block_hash import hash_blocks
from pdserve.messages import (
    CompatibilityDescriptor,
    Heartbeat,
    KVDigest,
    KVEvents,
    RejectCode,
    Role,
    RouteBooked,
    RouteDecision,
    RouteRequest,
    WorkerIncompatible,
)
from pdserve.routing.active_load import ActiveLoad
from pdserve.routing.kv_index import KVIndex
from pdserve.routing.policy import Candidate, RoutingPolicy, make_policy
from pdserve.routing.registry import WorkerRegistry, WorkerState
from pdserve.telemetry import metrics


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class Placer:
    """The router's state and decision. Feed it with `observe_*`, `prefill_done` and `release`; ask it
    with `route`. `clock` (seconds) drives liveness and expiry, so a simulation can run it in virtual
    time. Not thread-safe: call from one event loop."""

    def __init__(
        self,
        settings: RouterSettings,
        policy: RoutingPolicy | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.policy = policy or make_policy(settings.policy, settings)
        self.registry = WorkerRegistry(settings.heartbeat_timeout_s, clock)
        self.index = KVIndex(settings.kv_index_ttl_s, clock)
        self.load = ActiveLoad(settings.booking_max_age_s, clock, settings.balance_window_requests)
        self._reported: dict[str, CompatibilityDescriptor] = {}  # workers reported as matching no peer
        self._counted: set[str] = set()  # workers whose placement series exist
        self.clock = clock
        self._started = clock()

    # ------------------------------------------------------------ inputs

    def observe_heartbeat(self, hb: Heartbeat) -> WorkerIncompatible | None:
        """Record the heartbeat. Returns a report the first time the worker, with this descriptor, matches
        no live worker of the other pool (it is never paired while that lasts); None otherwise."""
        self.registry.observe(hb)
        self.index.touch(hb.worker_id)
        if hb.worker_id not in self._counted:
            # its placement series exist at 0 before its first placement, so a rate sees that increase
            self._counted.add(hb.worker_id)
            metrics.ROUTER_PROMPT_TOKENS.labels(worker_id=hb.worker_id)
            metrics.ROUTER_CEILING_CACHED_TOKENS.labels(worker_id=hb.worker_id)
        report = self.registry.unmatched(hb)
        if report is None:
            self._reported.pop(hb.worker_id, None)
        elif self._reported.get(hb.worker_id) != hb.descriptor:
            self._reported[hb.worker_id] = hb.descriptor
            return report
        return None

    def observe_kv_events(self, batch: KVEvents) -> None:
        self.index.apply(batch)

    def observe_kv_digest(self, digest: KVDigest) -> bool:
        """False when the digest disagreed with the index (the worker's entries were dropped)."""
        return self.index.check_digest(digest)

    def prefill_done(self, request_id: str) -> None:
        self.load.prefill_done(request_id)

    def booked(self, request_id: str, router_id: str) -> RouteBooked | None:
        """What this router booked for `request_id`, as the message its peers book it from."""
        b = self.load.booking(request_id)
        if b is None:
            return None
        return RouteBooked(router_id=router_id, request_id=request_id, prefill_worker_id=b.prefill_worker_id,
                           prefill_blocks=b.prefill_blocks, decode_worker_id=b.decode_worker_id,
                           decode_blocks=b.decode_blocks)

    def observe_booking(self, b: RouteBooked) -> bool:
        """Book another router's placement (routing/active_load.py); False if its request already ended."""
        return self.load.book_peer(b.request_id, b.prefill_worker_id, b.prefill_blocks, b.decode_worker_id,
                                   b.decode_blocks)

    def release(self, request_id: str) -> None:
        self.load.release(request_id)

    def expire(self) -> None:
        """Drop silent workers' blocks and stale bookings (call periodically)."""
        self.index.expire()
        self.load.expire()

    # ------------------------------------------------------------ decision

    def _candidate(
        self, state: WorkerState, num_tokens: int, hashes: Sequence[int], decodes_here: bool
    ) -> Candidate:
        desc = state.heartbeat.descriptor
        wid = state.heartbeat.worker_id
        max_hit = max(num_tokens - 1, 0) // desc.block_size
        by_tier = self.index.overlaps_by_tier(hashes[:max_hit], wid)
        cached = sum(by_tier.values())
        prompt_blocks = _ceil_div(num_tokens, desc.block_size)
        # A hybrid resumes from its longest state checkpoint within the KV hit (the usable hit)
        checkpoint = self.index.checkpoint_blocks(hashes, wid, cached) if desc.state_layout else None
        return Candidate(
            worker_id=wid,
            role=state.heartbeat.role,
            prompt_blocks=prompt_blocks,
            cached_blocks=cached,
            active_prefill_blocks=self.load.prefill_blocks(wid),
            active_decode_blocks=self.load.kv_blocks(wid) + (prompt_blocks if decodes_here else 0),
            active_requests=max(state.active_requests, self.load.requests(wid)),
            kv_usage=state.kv_usage,
            recent_requests=self.load.recent_requests(wid),
            checkpoint_blocks=checkpoint,
            cached_blocks_by_tier=by_tier,
        )

    def route(self, req: RouteRequest, block_hashes: Sequence[int] | None = None) -> RouteDecision:
        """Place `req`. Its prompt's block hashes are computed from `req.prompt_token_ids` per compatible
        descriptor (block size, hash seed, `cache_salt`), unless `block_hashes` gives them (offline replay,
        one descriptor). Books the placement in `self.load`. Raises `RejectedError(NO_WORKERS)` when no
        live compatible placement exists."""
        memo: dict[tuple[int, int], list[int]] = {}

        def hashes_for(desc: CompatibilityDescriptor) -> list[int]:
            if block_hashes is not None:
                return list(block_hashes)
            key = (desc.block_size, desc.hash_seed)
            if key not in memo:
                memo[key] = hash_blocks(req.prompt_token_ids, desc.block_size, desc.hash_seed, req.cache_salt)
            return memo[key]

        prefill, decode = self.registry.live(Role.PREFILL), self.registry.live(Role.DECODE)
        paired = [
            d
            for d in decode
            if any(WorkerRegistry.compatible(p.heartbeat.descriptor, d.heartbeat.descriptor) for p in prefill)
        ]
        n = req.num_prompt_tokens
        if paired:
            d_state, d_cand, d_cands = self._decode_worker(paired, n, hashes_for)
            desc = d_state.heartbeat.descriptor
            local_ok = self.settings.local_prefill_max_tokens > 0
            if (
                local_ok
                and d_cand.uncached_blocks * desc.block_size <= self.settings.local_prefill_max_tokens
                and d_cand.active_requests <= self.settings.local_prefill_max_active_requests
            ):
                return self._decide(req, "local", d_cand, d_cand, [d_cand], [d_cands], desc, hashes_for(desc),
                                    "short_prompt")
            p_states = [p for p in prefill if WorkerRegistry.compatible(p.heartbeat.descriptor, desc)]
            p_cands = [self._candidate(p, n, hashes_for(desc), False) for p in p_states]
            chosen = p_cands[self.policy.select(p_cands)]
            ceiling = p_cands + ([d_cand] if local_ok else [])
            return self._decide(
                req, "disaggregated", chosen, d_cand, ceiling, [p_cands, d_cands], desc, hashes_for(desc)
            )
        unified = self.registry.live(Role.UNIFIED)
        if unified:
            u_cands = [self._candidate(u, n, hashes_for(u.heartbeat.descriptor), True) for u in unified]
            chosen = u_cands[self.policy.select(u_cands)]
            desc = unified[u_cands.index(chosen)].heartbeat.descriptor
            return self._decide(req, "colocated", chosen, chosen, u_cands, [u_cands], desc, hashes_for(desc))
        if decode and self.clock() - self._started < self.settings.heartbeat_timeout_s:
            # Not yet a whole liveness window since this router started: a prefill worker that is up may
            # just not have been heard yet. Wait for it (the coordinator retries) rather than prefill on a
            # decode worker.
            raise RejectedError(RejectCode.NO_WORKERS, "no prefill worker heard yet since the router started")
        if decode:  # no live compatible prefill worker: a decode worker prefills itself
            d_state, d_cand, d_cands = self._decode_worker(decode, n, hashes_for)
            desc = d_state.heartbeat.descriptor
            return self._decide(req, "local", d_cand, d_cand, d_cands, [d_cands], desc, hashes_for(desc),
                                "no_prefill_worker")
        raise RejectedError(RejectCode.NO_WORKERS, "no live decode worker or unified worker")

    def _decode_worker(
        self,
        states: list[WorkerState],
        num_tokens: int,
        hashes_for: Callable[[CompatibilityDescriptor], list[int]],
    ) -> tuple[WorkerState, Candidate, list[Candidate]]:
        """The decode worker among `states`: the fewest booked decode blocks, then the fewest active
        requests, then id order. Returns its state, its candidate and every state's candidate."""
        cands = [self._candidate(d, num_tokens, hashes_for(d.heartbeat.descriptor), True) for d in states]
        i = min(range(len(cands)), key=lambda i: (cands[i].active_decode_blocks, cands[i].active_requests, i))
        return states[i], cands[i], cands

    def _decide(
        self,
        req: RouteRequest,
        mode: str,
        prefill: Candidate,
        decode: Candidate,
        ceiling: list[Candidate],
        recorded: list[list[Candidate]],
        desc: CompatibilityDescriptor,
        hashes: list[int],
        reason: str = "policy",
    ) -> RouteDecision:
        """The decision, booked in the router's load and counted in `pdserve:router_placements` (`reason`:
        see there), `pdserve:router_prompt_tokens` and `pdserve:router_ceiling_cached_tokens`."""
        bs = desc.block_size
        # Each group scored on its own (the prefill candidates among themselves, as the policy chose).
        costs = [
            (c, sc) for group in recorded for c, sc in zip(group, self.policy.scores(group), strict=True)
        ]
        self.load.book(
            req.request_id, prefill.worker_id, prefill.uncached_blocks, decode.worker_id, decode.prompt_blocks
        )
        metrics.ROUTER_PLACEMENTS.labels(mode=mode, reason=reason).inc()
        metrics.ROUTER_PROMPT_TOKENS.labels(worker_id=prefill.worker_id).inc(req.num_prompt_tokens)
        metrics.ROUTER_CEILING_CACHED_TOKENS.labels(worker_id=prefill.worker_id).inc(
            max(c.cached_blocks for c in ceiling) * bs)
        return RouteDecision(
            request_id=req.request_id,
            mode=mode,
            prefill_worker_id=prefill.worker_id,  # type: ignore[arg-type]
            decode_worker_id=decode.worker_id,
            candidates=tuple(c.cost_record(sc) for c, sc in costs),
            predicted_cached_tokens=prefill.cached_blocks * bs,
            predicted_checkpoint_tokens=(prefill.checkpoint_blocks or 0) * bs,
            best_cached_tokens=max(c.cached_blocks for c in ceiling) * bs,
            policy=self.policy.name,
            block_size=bs,
            prompt_block_hashes=tuple(hashes),
        )
