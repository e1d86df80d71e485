"""Coordinator (the transfer-coordinator): owns each request's lifecycle across the pools, and at start
resumes every request the event log shows unfinished."""

from __future__ import annotations

from pdserve.bus import Bus
from pdserve.config import CoordinatorSettings
from pdserve.lifecycle.coordinator import Coordinator
from pdserve.service import run_service
from pdserve.store.queries import make_db


def main() -> None:
    settings = CoordinatorSettings()

    async def setup(bus: Bus):
        db = make_db(settings.database_url)  # read only: recovery folds the log from it
        coordinator = Coordinator(bus, settings, db)
        await coordinator.serve()

        async def cleanup() -> None:
            await coordinator.stop()
            await db.dispose()

        return cleanup

    run_service("coordinator", settings, setup)


if __name__ == "__main__":
    main()
