"""What a decode or unified worker holds per request between `reserve` and `release`: the KV blocks it
reserved and the transfer it expects into them (vLLM's disaggregated connectors call these the requests
waiting for remote KV). Not vLLM's `slot_mapping` slots: those are token positions in the KV cache."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.sequence import Sequence
from pdserve.workers.kv_transfer import InboundKV


@dataclass
class ReservedKV:
    """One request's reserved KV: the engine sequence holding its blocks, and the transfer expected into
    them (`kv`, None for a local prefill). `lease_deadline`: `time.monotonic()` seconds after which an
    unstarted reservation is freed.
    """

    request_id: str
    transfer_id: str
    seq: Sequence
    lease_deadline: float
    kv: InboundKV | None = None
    started: bool = False


class ReservedKVTable:
    """Reserved KV by request id; `add` / `pop` pair up with the engine's reserve / free."""

    def __init__(self) -> None:
        self._held: dict[str, ReservedKV] = {}

    def add(self, held: ReservedKV) -> None:
        """Raises ValueError if the request already holds a reservation."""
        if held.request_id in self._held:
            raise ValueError(f"request {held.request_id} already holds reserved KV")
        self._held[held.request_id] = held

    def get(self, request_id: str) -> ReservedKV | None:
        return self._held.get(request_id)

    def pop(self, request_id: str) -> ReservedKV | None:
        """Forget the request's reservation, cancelling its inbound transfer; idempotent. The caller awaits
        `held.kv.drained()`, then frees the sequence's blocks."""
        held = self._held.pop(request_id, None)
        if held is not None and held.kv is not None:
            held.kv.cancel()
        return held

    def expired(self, now: float) -> list[str]:
        return [rid for rid, h in self._held.items() if not h.started and now > h.lease_deadline]

    def __len__(self) -> int:
        return len(self._held)

    def num_waiting(self) -> int:
        return sum(not h.started for h in self._held.values())
