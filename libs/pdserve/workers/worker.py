"""One engine worker in a role: prefill, decode, or unified (both, colocated).

Commands it serves (see `pdserve.messages`), each in the module of its side:
- reserve (decode/unified, `decode.py`): hold KV blocks for the prompt, sharing what this worker's prefix
  cache already has, and expect the transfer of the rest.
- prefill (prefill, or decode/unified for a local prefill; `prefill.py`): run the prompt and, from a
  prefill worker, stream each layer's KV rows the decode worker lacks; the first token returned once every
  send is delivered. A local prefill reserves its KV in the same command (`PrefillRequest.reserve`).
- start (decode/unified, `decode.py`): wait until the transfer is verified and in the reserved blocks,
  admit the sequence into the engine's continuous batch, stream tokens.
- release (all, here): free everything the request holds here; idempotent.

What the commands share (the engine and its lock, the engine loop, the reserved KV) is `core.py`'s
`WorkerCore`; the heartbeats and the compatibility descriptor are `heartbeat.py`'s. `Worker` builds them
and registers the handlers.
"""

from __future__ import annotations

from pdserve.bus import Bus
from pdserve.config import WorkerSettings
from pdserve.engine.loader import LoadedModel
from pdserve.messages import Ack, PrefillRequest, Release, ReserveRequest, Role, StartDecode
from pdserve.transfer.base import KVTransport
from pdserve.workers.core import WorkerCore
from pdserve.workers.decode import DecodeCommands
from pdserve.workers.heartbeat import Heartbeats
from pdserve.workers.prefill import PrefillCommands


class Worker:
    def __init__(
        self, bus: Bus, settings: WorkerSettings, loaded: LoadedModel, transport: KVTransport | None
    ) -> None:
        self.core = WorkerCore(bus, settings, loaded, transport)
        self.decode_commands = DecodeCommands(self.core)
        self.prefill_commands = PrefillCommands(
            self.core, self.decode_commands.hold if self.core.role is not Role.PREFILL else None)
        self.heartbeats = Heartbeats(self.core)  # the runtime runs `heartbeats.run()` and `core.loop.run()`
        self.worker_id = self.core.worker_id

    async def release(self, req: Release) -> Ack:
        if req.finish_reason is not None:
            await self.core.loop.finish_now(req.request_id, req.finish_reason)
        await self.core.release(req.request_id, req.reason)
        return Ack()

    async def serve(self) -> None:
        """Announce an empty prefix cache (AllBlocksCleared), then register the command handlers."""
        core, bus, me = self.core, self.core.bus, self.worker_id
        await core.kv_events.cleared()
        s = bus.subjects
        await bus.serve(s.worker(me, "release"), Release, self.release)
        await bus.serve(s.worker(me, "prefill"), PrefillRequest, self.prefill_commands.prefill)
        if core.role is not Role.PREFILL:
            await bus.serve(s.worker(me, "reserve"), ReserveRequest, self.decode_commands.reserve)
            await bus.serve(s.worker(me, "start"), StartDecode, self.decode_commands.start)
