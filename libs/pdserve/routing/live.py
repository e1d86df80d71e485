"""A `Placer` on the bus: kept current from what the workers and the lifecycles publish, and asked in-process
or over `pds.router.route`.

Two processes run one (docs/architecture.md §5): a coordinator, which places its own requests in-process
(the default: no round trip to another process on a request's way to its first token, as Dynamo's
frontend runs its KV router), and the router service (`pdserve up --routers N`), which answers
coordinators started with `PDS_PLACEMENT=router`. Either way every placer hears the same inputs —
heartbeats, KV cache events and digests, the `PrefillCompleted` and terminal events that free a
request's load — and publishes each booking (`RouteBooked`) before acting on it, so several placers (the
coordinators, or the routers) see each other's placements (routing/active_load.py).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Awaitable, Callable

from opentelemetry import trace

from pdserve.bus import Bus
from pdserve.config import RouterSettings
from pdserve.events import TERMINAL_TYPES, Event
from pdserve.messages import Heartbeat, KVDigest, KVEvents, RouteBooked, RouteDecision, RouteRequest
from pdserve.routing.router import Placer
from pdserve.telemetry import metrics

tracer = trace.get_tracer("pdserve.router")
log = logging.getLogger(__name__)

EXPIRE_EVERY_S = 1.0  # how often silent workers' blocks and stale bookings are dropped


class LivePlacer:
    """Lifecycle: `LivePlacer(bus, settings, name)` → `await start()` (subscriptions, expiry) → `await
    place(req)` any number of times → `await stop()`. `name` identifies this placer's bookings to its peers
    (a random suffix keeps replicas that share a name apart). A worker that matches no live peer is logged
    and reported (`WorkerIncompatible` on `pds.incompatible.<worker>`) by every placer that sees it."""

    def __init__(self, bus: Bus, settings: RouterSettings, name: str) -> None:
        self.bus = bus
        self.placer = Placer(settings)
        self.placer_id = f"{name}.{secrets.token_hex(4)}"
        self._subs: list = []
        self._expiry: asyncio.Task | None = None

    async def place(self, req: RouteRequest) -> RouteDecision:
        """The placement of `req` (`Placer.route`: raises `RejectedError(NO_WORKERS)` when none exists), its
        booking published to the peers before it is returned, under the span `router.route`."""
        with tracer.start_as_current_span("router.route") as span:
            span.set_attribute("pdserve.request_id", req.request_id)
            decision = self.placer.route(req)
            if (booked := self.placer.booked(req.request_id, self.placer_id)) is not None:
                await self.bus.publish(self.bus.subjects.booked, booked)
            span.set_attribute("pdserve.mode", decision.mode)
            span.set_attribute("pdserve.predicted_cached_tokens", decision.predicted_cached_tokens)
            span.set_attribute("pdserve.best_cached_tokens", decision.best_cached_tokens)
            return decision

    async def start(self) -> None:
        metrics.init_router_series()
        s = self.bus.subjects
        events = s.all_events.removesuffix(">")
        handlers: list[tuple[str, type, Callable[..., Awaitable[None]]]] = [
            (s.heartbeat(), Heartbeat, self._on_heartbeat),
            (s.booked, RouteBooked, self._on_booked),
            (s.kv_events(), KVEvents, self._on_kv_events),
            (s.kv_digest(), KVDigest, self._on_kv_digest),
            *((f"{events}*.{t}", Event, self._on_lifecycle)
              for t in ("PrefillCompleted", *sorted(TERMINAL_TYPES))),
        ]
        self._subs = [await self.bus.subscribe(subject, kind, handler) for subject, kind, handler in handlers]
        self._expiry = asyncio.ensure_future(self._expire_forever())

    async def stop(self) -> None:
        if self._expiry is not None:
            self._expiry.cancel()
        for sub in self._subs:
            await sub.unsubscribe()
        self._subs = []

    async def _on_heartbeat(self, hb: Heartbeat) -> None:
        if (report := self.placer.observe_heartbeat(hb)) is not None:
            log.warning(
                "%s worker %s matches no live peer (%s): it is not paired while that lasts; differs in %s",
                report.role.value, report.worker_id, ", ".join(report.peers),
                ", ".join(f"{k} {mine} vs {theirs}" for k, (mine, theirs) in report.differences.items()),
            )
            await self.bus.publish(self.bus.subjects.incompatible(hb.worker_id), report)

    async def _on_kv_events(self, batch: KVEvents) -> None:
        self.placer.observe_kv_events(batch)

    async def _on_kv_digest(self, digest: KVDigest) -> None:
        if not self.placer.observe_kv_digest(digest):
            log.warning("KV digest of %s disagrees with the index at seq %d: its blocks count as cold "
                        "until a digest matches", digest.worker_id, digest.seq)

    async def _on_lifecycle(self, event: Event) -> None:
        if event.type == "PrefillCompleted":
            self.placer.prefill_done(event.request_id)
        elif event.type in TERMINAL_TYPES:
            self.placer.release(event.request_id)

    async def _on_booked(self, booked: RouteBooked) -> None:
        if booked.router_id != self.placer_id:
            self.placer.observe_booking(booked)

    async def _expire_forever(self) -> None:
        while True:
            await asyncio.sleep(EXPIRE_EVERY_S)
            self.placer.expire()
