"""Coordinator (the transfer-coordinator): owns each request's lifecycle across the pools."""

from __future__ import annotations

from pdserve.bus import Bus
from pdserve.config import CoordinatorSettings
from pdserve.lifecycle.coordinator import Coordinator
from pdserve.service import run_service


def main() -> None:
    settings = CoordinatorSettings()

    async def setup(bus: Bus):
        coordinator = Coordinator(bus, settings)
        await coordinator.serve()
        return coordinator.stop

    run_service("coordinator", settings, setup)


if __name__ == "__main__":
    main()
