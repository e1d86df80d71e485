"""Which workers are alive, from their heartbeats."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from pdserve.messages import CompatibilityDescriptor, Heartbeat, Role, WorkerIncompatible

_OTHER_POOL = {Role.PREFILL: Role.DECODE, Role.DECODE: Role.PREFILL}


@dataclass
class WorkerState:
    heartbeat: Heartbeat
    last_seen: float  # the registry's clock (time.monotonic() by default), seconds

    @property
    def active_requests(self) -> int:
        return self.heartbeat.num_running + self.heartbeat.num_waiting

    @property
    def kv_usage(self) -> float:
        hb = self.heartbeat
        return 1.0 - hb.kv_free_tokens / hb.kv_capacity_tokens if hb.kv_capacity_tokens else 1.0


class WorkerRegistry:
    """Live workers by id. A worker silent for `timeout_s` seconds is no longer listed."""

    def __init__(self, timeout_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.timeout_s = timeout_s
        self.clock = clock
        self._workers: dict[str, WorkerState] = {}

    def observe(self, hb: Heartbeat) -> None:
        self._workers[hb.worker_id] = WorkerState(hb, self.clock())

    def get(self, worker_id: str) -> WorkerState | None:
        """The worker's last heartbeat, live or not (None if never heard)."""
        return self._workers.get(worker_id)

    def live(self, *roles: Role) -> list[WorkerState]:
        """Workers heard from within the timeout whose role is one of `roles`, sorted by id."""
        now = self.clock()
        for wid in [w for w, s in self._workers.items() if now - s.last_seen > self.timeout_s]:
            del self._workers[wid]
        return sorted(
            (s for s in self._workers.values() if s.heartbeat.role in roles),
            key=lambda s: s.heartbeat.worker_id,
        )

    def unmatched(self, hb: Heartbeat) -> WorkerIncompatible | None:
        """The report on `hb`'s worker when the other pool has live workers and none is compatible with
        it; None when one is, when the other pool is empty (nothing to pair with yet), or for a unified
        worker (it never transfers KV)."""
        other = _OTHER_POOL.get(hb.role)
        peers = self.live(other) if other is not None else []
        if not peers or any(self.compatible(hb.descriptor, p.heartbeat.descriptor) for p in peers):
            return None
        first = peers[0].heartbeat.descriptor
        return WorkerIncompatible(
            worker_id=hb.worker_id,
            role=hb.role,
            descriptor=hb.descriptor,
            peers=tuple(p.heartbeat.worker_id for p in peers),
            differences={
                k: (str(v), str(getattr(first, k))) for k, v in hb.descriptor if getattr(first, k) != v
            },
        )

    @staticmethod
    def compatible(a: CompatibilityDescriptor, b: CompatibilityDescriptor) -> bool:
        """KV from one can be used by the other: every field of the descriptor matches."""
        return a == b
