"""Router: keeps the live workers from their heartbeats and answers placement requests."""

from __future__ import annotations

from opentelemetry import trace

from pdserve.bus import Bus
from pdserve.config import RouterSettings
from pdserve.messages import Heartbeat, RouteDecision, RouteRequest
from pdserve.routing.policy import LeastLoaded
from pdserve.routing.registry import WorkerRegistry
from pdserve.service import run_service

tracer = trace.get_tracer("pdserve.router")


async def setup(bus: Bus, settings: RouterSettings):
    registry = WorkerRegistry(settings.heartbeat_timeout_s)
    policy = LeastLoaded()

    async def on_heartbeat(hb: Heartbeat) -> None:
        registry.observe(hb)

    async def route(req: RouteRequest) -> RouteDecision:
        with tracer.start_as_current_span("router.route") as span:
            span.set_attribute("pdserve.request_id", req.request_id)
            decision = policy.choose(req, registry)
            span.set_attribute("pdserve.mode", decision.mode)
            return decision

    sub = await bus.subscribe(bus.subjects.heartbeat(), Heartbeat, on_heartbeat)
    await bus.serve(bus.subjects.route, RouteRequest, route, queue="router")

    async def cleanup() -> None:
        await sub.unsubscribe()

    return cleanup


def main() -> None:
    settings = RouterSettings()
    run_service("router", settings, lambda bus: setup(bus, settings))


if __name__ == "__main__":
    main()
