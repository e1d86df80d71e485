"""KV a worker holds per request, and the capacity they draw from (in tokens)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from pdserve.engine.kv_cache import SequenceKVCache
from pdserve.transfer.base import Inbound


@dataclass
class Slot:
    """KV cache reserved for one request on this worker.

    `inbound` is the expected transfer (None when the KV is computed here); `lease_deadline` is
    `time.monotonic()` seconds after which an unstarted slot is freed.
    """

    request_id: str
    transfer_id: str
    cache: SequenceKVCache
    num_tokens: int
    lease_deadline: float
    inbound: Inbound | None = None
    started: bool = False
    reserved_ts: float = field(default_factory=time.time)


class SlotTable:
    """Slots by request id with a capacity in tokens: `reserve`/`release` are the paired verbs."""

    def __init__(self, capacity_tokens: int) -> None:
        self.capacity_tokens = capacity_tokens
        self._slots: dict[str, Slot] = {}

    @property
    def used_tokens(self) -> int:
        return sum(s.num_tokens for s in self._slots.values())

    @property
    def free_tokens(self) -> int:
        return self.capacity_tokens - self.used_tokens

    def can_reserve(self, num_tokens: int) -> bool:
        return num_tokens <= self.free_tokens

    def reserve(self, slot: Slot) -> None:
        """Raises ValueError if the request already holds a slot or capacity is short."""
        if slot.request_id in self._slots:
            raise ValueError(f"request {slot.request_id} already holds a slot")
        if not self.can_reserve(slot.num_tokens):
            raise ValueError(f"{slot.num_tokens} tokens requested, {self.free_tokens} free")
        self._slots[slot.request_id] = slot

    def get(self, request_id: str) -> Slot | None:
        return self._slots.get(request_id)

    def release(self, request_id: str) -> Slot | None:
        """Free the request's slot (cancelling its inbound transfer); idempotent."""
        slot = self._slots.pop(request_id, None)
        if slot is not None and slot.inbound is not None:
            slot.inbound.cancel()
        return slot

    def expired(self, now: float) -> list[str]:
        return [rid for rid, s in self._slots.items() if not s.started and now > s.lease_deadline]

    def __len__(self) -> int:
        return len(self._slots)

    def num_waiting(self) -> int:
        return sum(not s.started for s in self._slots.values())
