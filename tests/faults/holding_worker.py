"""A prefill worker that holds a hybrid's state handoff on demand (`python -m tests.faults.holding_worker`):
the production worker (`run_worker`) with its transport wrapped in a `StateHoldingTransport`, so a fault
test can act in the window between the KV pages and the state — the window the state handoff adds.

With `$PDS_TEST_STATE_HOLD_DIR` set, a file `arm` there arms the next handoff: its state sends wait until
the same transfer's KV end marker is delivered (every page is at the decode worker, verified or on its
way), then `held` is written (holding the transfer id) and they wait until `release` exists (at most
`HOLD_MAX_S`), then go on as usual. `arm` is consumed, so only one handoff is held per arming."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
from pathlib import Path

import torch

from pdserve.messages import KVEndpoint, KVTransportKind, Role
from pdserve.transfer import make_transport
from pdserve.transfer.base import Inbound, KVTransport
from pdserve.workers.runtime import run_worker
from pdserve.workers.state_transfer import STATE_MARK, is_state_transfer

HOLD_DIR_ENV = "PDS_TEST_STATE_HOLD_DIR"
HOLD_MAX_S = 60.0


class StateHoldingTransport(KVTransport):
    def __init__(self, inner: KVTransport, hold_dir: Path | None) -> None:
        self.inner = inner
        self.kind = inner.kind
        self.hold_dir = hold_dir
        self._held: set[str] = set()  # base transfer ids whose state is held
        self._kv_done: dict[str, asyncio.Event] = {}  # the KV end marker delivered
        self._kv_sends: dict[str, list[concurrent.futures.Future[int]]] = {}  # the KV chunks' sends

    def _kv_done_event(self, transfer_id: str) -> asyncio.Event:
        return self._kv_done.setdefault(transfer_id, asyncio.Event())

    async def _maybe_hold(self, transfer_id: str) -> None:
        if self.hold_dir is None or not is_state_transfer(transfer_id):
            return
        base = transfer_id.split(STATE_MARK)[0]
        arm = self.hold_dir / "arm"
        if base not in self._held:
            if not arm.exists():
                return
            arm.unlink()
            self._held.add(base)
            await asyncio.wait_for(self._kv_done_event(base).wait(), HOLD_MAX_S)
            for sent in self._kv_sends.pop(base, []):  # every page delivered, not only the marker
                await asyncio.wrap_future(sent)
            (self.hold_dir / "held").write_text(base)
        release = self.hold_dir / "release"
        loop = asyncio.get_running_loop()
        deadline = loop.time() + HOLD_MAX_S
        while not release.exists() and loop.time() < deadline:
            await asyncio.sleep(0.05)

    # -- KVTransport, delegated (state sends held first)

    async def start(self) -> None:
        await self.inner.start()

    def endpoint(self) -> KVEndpoint:
        return self.inner.endpoint()

    def expect(self, transfer_id: str, buffers: list[torch.Tensor]) -> Inbound:
        return self.inner.expect(transfer_id, buffers)

    async def send_layer(
        self,
        endpoint: KVEndpoint,
        transfer_id: str,
        layer: int,
        chunk: int,
        token_start: int,
        data: torch.Tensor,
        traceparent: str | None = None,
    ) -> int:
        await self._maybe_hold(transfer_id)
        return await self.inner.send_layer(
            endpoint, transfer_id, layer, chunk, token_start, data, traceparent
        )

    def send_layer_threadsafe(
        self,
        endpoint: KVEndpoint,
        transfer_id: str,
        layer: int,
        chunk: int,
        token_start: int,
        data: torch.Tensor,
        traceparent: str | None = None,
    ) -> concurrent.futures.Future[int]:
        sent = self.inner.send_layer_threadsafe(
            endpoint, transfer_id, layer, chunk, token_start, data, traceparent
        )
        if self.hold_dir is not None:
            self._kv_sends.setdefault(transfer_id, []).append(sent)
        return sent

    async def finish(self, endpoint: KVEndpoint, transfer_id: str, num_layers: int, num_chunks: int) -> None:
        await self._maybe_hold(transfer_id)
        await self.inner.finish(endpoint, transfer_id, num_layers, num_chunks)
        if not is_state_transfer(transfer_id):
            self._kv_done_event(transfer_id).set()

    async def stop(self) -> None:
        await self.inner.stop()


def holding_transport(kind: KVTransportKind, host: str = "127.0.0.1") -> StateHoldingTransport:
    hold_dir = os.environ.get(HOLD_DIR_ENV)
    return StateHoldingTransport(make_transport(kind, host), Path(hold_dir) if hold_dir else None)


if __name__ == "__main__":
    run_worker(Role.PREFILL, holding_transport)
