"""What the workers can hold, as the gateway learns it from their heartbeats (`pds.heartbeat.*`).

A request whose prompt + max_tokens exceeds every decode worker's KV cache (`Heartbeat.kv_capacity_tokens`
of decode and unified workers) can never be admitted: the gateway answers it 400
`context_length_exceeded` before submitting it, and `/v1/models`' `max_model_len` is the smaller of the
configured `max_model_len` and that capacity. Workers heard within `FRESH_S` count; when none is fresh (a
pool restarting), the last capacity heard still holds; before any heartbeat the configured
`max_model_len` alone applies.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from pdserve.bus import Bus
from pdserve.messages import Heartbeat, Role

log = logging.getLogger(__name__)

FRESH_S = 10.0  # a worker heard this recently (seconds) counts towards the capacity


@dataclass
class _Heard:
    role: Role
    kv_capacity_tokens: int
    at: float  # time.monotonic() of its last heartbeat


class WorkerCapacity:
    """Call `await ensure_listening()` before reading (idempotent; subscribes once, on this bus)."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self._workers: dict[str, _Heard] = {}
        self._sub = None

    async def ensure_listening(self) -> None:
        if self._sub is None:
            self._sub = await self.bus.subscribe(self.bus.subjects.heartbeat("*"), Heartbeat, self._heard)

    async def _heard(self, hb: Heartbeat) -> None:
        self._workers[hb.worker_id] = _Heard(hb.role, hb.kv_capacity_tokens, time.monotonic())

    def _max_capacity(self, roles: tuple[Role, ...]) -> int | None:
        heard = [w for w in self._workers.values() if w.role in roles]
        fresh = [w for w in heard if time.monotonic() - w.at <= FRESH_S]
        pool = fresh or heard
        return max((w.kv_capacity_tokens for w in pool), default=None)

    @property
    def decode_tokens(self) -> int | None:
        """Prompt + output tokens the largest decode (or unified) worker can hold; None = none heard."""
        return self._max_capacity((Role.DECODE, Role.UNIFIED))

    def max_model_len(self, configured: int) -> int:
        """`configured`, capped by what the decode workers can hold."""
        cap = self.decode_tokens
        return configured if cap is None else min(configured, cap)

    async def close(self) -> None:
        if self._sub is not None:
            sub, self._sub = self._sub, None
            try:
                await sub.unsubscribe()
            except Exception as e:  # connection already closed
                log.debug("heartbeat unsubscribe failed: %s", e)
