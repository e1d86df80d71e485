"""A request's first event, `RequestReceived`, stored from the gateway's `Submit.receipt`: by the coordinator
before it accepts the Submit (lifecycle/coordinator.py), or by the gateway when no coordinator accepted it
(gateway/generation.py). Stored under the receipt's event id, so however many of them store it, JetStream
keeps one (docs/architecture.md §3 step 1)."""

from __future__ import annotations

from pdserve.bus import Bus
from pdserve.events import RequestReceived
from pdserve.messages import Submit


async def store_received(bus: Bus, submit: Submit) -> None:
    """Store `submit`'s `RequestReceived` and wait for JetStream's ack (`Bus.emit_stored`); nothing when
    it has no receipt (recovery's Submits, rebuilt from that event)."""
    if submit.receipt is not None:
        await bus.emit_stored(submit.request_id, RequestReceived.of(submit), event_id=submit.receipt.event_id)
