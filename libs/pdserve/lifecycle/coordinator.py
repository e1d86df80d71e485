"""The coordinator's state: the lifecycles in flight, and the three commands that touch them."""

from __future__ import annotations

import asyncio
import logging

from pdserve.bus import Bus, RejectedError
from pdserve.config import CoordinatorSettings
from pdserve.lifecycle.request import RequestLifecycle
from pdserve.messages import Abort, Accepted, Ack, DecodeFinished, RejectCode, Submit

log = logging.getLogger(__name__)


class Coordinator:
    def __init__(self, bus: Bus, settings: CoordinatorSettings) -> None:
        self.bus = bus
        self.settings = settings
        self.active: dict[str, tuple[RequestLifecycle, asyncio.Task]] = {}

    async def submit(self, req: Submit) -> Accepted:
        if req.request_id in self.active:
            raise RejectedError(RejectCode.DUPLICATE, f"request {req.request_id} already in flight")
        lifecycle = RequestLifecycle(self.bus, self.settings, req)
        task = self.bus.spawn(lifecycle.run())
        self.active[req.request_id] = (lifecycle, task)
        task.add_done_callback(lambda _: self.active.pop(req.request_id, None))
        return Accepted(request_id=req.request_id)

    async def abort(self, req: Abort) -> Ack:
        """Cancel a request in any phase; its lifecycle emits RequestAborted and releases its KV."""
        entry = self.active.get(req.request_id)
        if entry is None:
            return Ack()
        lifecycle, task = entry
        if req.finish_reason is not None and await lifecycle.finish_early(req.finish_reason, req.reason):
            return Ack()
        log.info("aborting %s: %s", req.request_id, req.reason)
        task.cancel()
        return Ack()

    async def finished(self, msg: DecodeFinished) -> Ack:
        entry = self.active.get(msg.request_id)
        if entry is not None and not entry[0].finished.done():
            entry[0].finished.set_result(msg)
        return Ack()

    async def serve(self) -> None:
        s = self.bus.subjects
        await self.bus.serve(s.submit, Submit, self.submit, queue="coordinator")
        await self.bus.serve(s.abort, Abort, self.abort)
        await self.bus.serve(s.finished, DecodeFinished, self.finished)

    async def stop(self) -> None:
        for _, task in list(self.active.values()):
            task.cancel()
        await asyncio.gather(*(t for _, t in self.active.values()), return_exceptions=True)
