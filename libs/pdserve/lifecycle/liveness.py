"""Which workers are alive, as the coordinator sees them: heartbeats on `pds.heartbeat.<worker_id>`.

UCX runs with endpoint error handling off (docs/architecture.md §10), so a worker that dies mid-transfer or
mid-decode is noticed only by its heartbeats stopping. A worker is dead once it has been silent for
`timeout_s` seconds — counted from its last heartbeat, or from when watching began if none was ever
heard (a coordinator that restarts must also notice workers that died while it was down).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from pdserve.bus import Bus
from pdserve.messages import Heartbeat, Role
from pdserve.telemetry import metrics


class WorkerLiveness:
    """Lifecycle: `WorkerLiveness(bus, timeout_s)` → `await start()` → `is_dead(id)` / `first_lost(...)`
    → `await stop()`."""

    def __init__(self, bus: Bus, timeout_s: float, poll_s: float = 0.1) -> None:
        self.bus = bus
        self.timeout_s = timeout_s
        self.poll_s = poll_s
        self._last_seen: dict[str, float] = {}  # time.monotonic() seconds
        self._suspected: dict[str, float] = {}  # when a command found nobody serving the worker
        self._since = time.monotonic()
        self._sub = None

    async def start(self) -> None:
        self._since = time.monotonic()
        self._sub = await self.bus.subscribe(self.bus.subjects.heartbeat(), Heartbeat, self._observe)

    async def stop(self) -> None:
        if self._sub is not None:
            await self._sub.unsubscribe()
            self._sub = None

    async def _observe(self, hb: Heartbeat) -> None:
        if hb.worker_id not in self._last_seen and hb.role is not Role.PREFILL:
            metrics.ADMISSION_DEFERRED.labels(worker_id=hb.worker_id)  # the series exists, at 0
        self._last_seen[hb.worker_id] = time.monotonic()

    def silent_s(self, worker_id: str) -> float:
        """Seconds since `worker_id` was last heard from (or since watching began)."""
        return time.monotonic() - self._last_seen.get(worker_id, self._since)

    def suspect(self, worker_id: str) -> None:
        """A command to `worker_id` found no responder (its process is gone): dead until it beats again,
        without waiting out the timeout, so routing does not pick it meanwhile."""
        self._suspected[worker_id] = time.monotonic()

    def is_dead(self, worker_id: str) -> bool:
        suspected = self._suspected.get(worker_id)
        if suspected is not None and self._last_seen.get(worker_id, self._since) <= suspected:
            return True
        return self.silent_s(worker_id) > self.timeout_s

    async def first_lost(self, watched: Callable[[], set[str]]) -> str:
        """Return the first worker of `watched()` (re-evaluated each poll) that is dead; never returns
        while all are alive (cancel it)."""
        while True:
            for worker_id in sorted(watched()):
                if self.is_dead(worker_id):
                    return worker_id
            await asyncio.sleep(self.poll_s)
