"""What a decode or unified worker holds per request between `reserve` and `release`."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from pdserve.engine.sequence import Sequence
from pdserve.workers.kv_transfer import InboundKV


@dataclass
class Slot:
    """One reservation: the engine sequence holding its blocks, and the transfer expected into them
    (`kv`, None for a local prefill). `lease_deadline`: `time.monotonic()` seconds after which an unstarted
    slot is freed.
    """

    request_id: str
    transfer_id: str
    seq: Sequence
    lease_deadline: float
    kv: InboundKV | None = None
    started: bool = False
    reserved_ts: float = field(default_factory=time.time)


class SlotTable:
    """Slots by request id; `add` / `pop` pair up with the engine's reserve / free."""

    def __init__(self) -> None:
        self._slots: dict[str, Slot] = {}

    def add(self, slot: Slot) -> None:
        """Raises ValueError if the request already holds a slot."""
        if slot.request_id in self._slots:
            raise ValueError(f"request {slot.request_id} already holds a slot")
        self._slots[slot.request_id] = slot

    def get(self, request_id: str) -> Slot | None:
        return self._slots.get(request_id)

    def pop(self, request_id: str) -> Slot | None:
        """Forget the request's slot, cancelling its inbound transfer; idempotent. The caller awaits
        `slot.kv.drained()`, then frees the sequence's blocks."""
        slot = self._slots.pop(request_id, None)
        if slot is not None and slot.kv is not None:
            slot.kv.cancel()
        return slot

    def expired(self, now: float) -> list[str]:
        return [rid for rid, s in self._slots.items() if not s.started and now > s.lease_deadline]

    def __len__(self) -> int:
        return len(self._slots)

    def num_waiting(self) -> int:
        return sum(not s.started for s in self._slots.values())
