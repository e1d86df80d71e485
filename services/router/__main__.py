"""Router: placement as a service of its own (`pdserve up --routers N`), for coordinators started with
`PDS_PLACEMENT=router`; by default each coordinator places in-process. Live workers from heartbeats, the KV
index from their KV events and digests, its own load bookings and those its peers publish
(`pds.router.booked`), released by the lifecycle events (`pdserve.routing.live`); answers placement
requests (`pds.router.route`). Several routers share the `router` queue group."""

from __future__ import annotations

from pdserve.bus import Bus
from pdserve.config import RouterSettings
from pdserve.messages import RouteRequest
from pdserve.routing.live import LivePlacer
from pdserve.service import run_service


async def setup(bus: Bus, settings: RouterSettings):
    placer = LivePlacer(bus, settings, settings.worker_id)
    await placer.start()
    await bus.serve(bus.subjects.route, RouteRequest, placer.place, queue="router")
    return placer.stop


def main() -> None:
    settings = RouterSettings()
    run_service("router", settings, lambda bus: setup(bus, settings))


if __name__ == "__main__":
    main()
