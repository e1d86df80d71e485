"""Which workers are alive, from their heartbeats."""

from __future__ import annotations

import time
from dataclasses import dataclass

from pdserve.messages import CompatibilityDescriptor, Heartbeat, Role


@dataclass
class WorkerState:
    heartbeat: Heartbeat
    last_seen: float  # time.monotonic() seconds

    @property
    def active_requests(self) -> int:
        return self.heartbeat.num_running + self.heartbeat.num_waiting

    @property
    def kv_usage(self) -> float:
        hb = self.heartbeat
        return 1.0 - hb.kv_free_tokens / hb.kv_capacity_tokens if hb.kv_capacity_tokens else 1.0


class WorkerRegistry:
    """Live workers by id. A worker silent for `timeout_s` seconds is no longer listed."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._workers: dict[str, WorkerState] = {}

    def observe(self, hb: Heartbeat) -> None:
        self._workers[hb.worker_id] = WorkerState(hb, time.monotonic())

    def live(self, *roles: Role) -> list[WorkerState]:
        """Workers heard from within the timeout whose role is one of `roles`, sorted by id."""
        now = time.monotonic()
        for wid in [w for w, s in self._workers.items() if now - s.last_seen > self.timeout_s]:
            del self._workers[wid]
        return sorted(
            (s for s in self._workers.values() if s.heartbeat.role in roles),
            key=lambda s: s.heartbeat.worker_id,
        )

    @staticmethod
    def compatible(a: CompatibilityDescriptor, b: CompatibilityDescriptor) -> bool:
        """KV from one can be used by the other: every field of the descriptor matches."""
        return a == b
