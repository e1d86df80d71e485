"""What both transports share on top of `KVTransport`: binding to one event loop, the sending half
(`transfer.send` span, the payload's checksum, control header) and the `ReceiveTable`.

A concrete transport moves bytes: `_send_chunk` (a header that already carries its payload's checksum, and
the payload) and `_send_control` (a header alone), and on its receiving side hashes what lands and feeds
`self._table`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from abc import abstractmethod

import numpy as np
import torch
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace

from pdserve.messages import KVEndpoint
from pdserve.transfer.base import Inbound, KVTransport
from pdserve.transfer.checksum import byte_view, xxh3_hex_async
from pdserve.transfer.header import ChunkHeader, FinishMarker
from pdserve.transfer.receiver import ReceiveTable

tracer = trace.get_tracer("pdserve.transfer")


class ChunkedTransport(KVTransport):
    """A `KVTransport` that sends each chunk as a control header followed by its payload."""

    def __init__(self) -> None:
        super().__init__()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._table: ReceiveTable | None = None

    def _bind(self) -> None:
        """Called first by `start()`: remember the running loop the transport lives on."""
        self._loop = asyncio.get_running_loop()
        self._table = ReceiveTable(self._loop)

    def _owner_loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            raise RuntimeError(f"{type(self).__name__} is not started")
        return self._loop

    def _receiving(self) -> ReceiveTable:
        if self._table is None:
            raise RuntimeError(f"{type(self).__name__} is not started")
        return self._table

    def _elsewhere(self) -> bool:
        """True when called from a loop other than the transport's (the call must hop over)."""
        return asyncio.get_running_loop() is not self._owner_loop()

    def expect(self, transfer_id: str, buffers: list[torch.Tensor]) -> Inbound:
        return self._receiving().expect(transfer_id, buffers)

    async def send_layer(self, endpoint: KVEndpoint, transfer_id: str, layer: int, chunk: int,
                         token_start: int, data: torch.Tensor, traceparent: str | None = None) -> int:
        if self._elsewhere():
            return await asyncio.wrap_future(self.send_layer_threadsafe(
                endpoint, transfer_id, layer, chunk, token_start, data, traceparent))
        self._check_endpoint(endpoint)
        payload = byte_view(data)  # raises ValueError when not contiguous
        parent = (propagate.extract({"traceparent": traceparent}) if traceparent
                  else otel_context.get_current())
        with tracer.start_as_current_span("transfer.send", context=parent) as span:
            span.set_attribute("pdserve.transfer_id", transfer_id)
            span.set_attribute("pdserve.layer", layer)
            span.set_attribute("pdserve.chunk", chunk)
            span.set_attribute("pdserve.bytes", payload.nbytes)
            carrier: dict[str, str] = {}
            propagate.inject(carrier)
            # The checksum travels in the header, so it is computed before the first byte goes out (over
            # UCX hashing first costs ~40 us per MiB, a third message per chunk cost more: issue 4 timeline).
            header = ChunkHeader(transfer_id=transfer_id, layer=layer, chunk=chunk, token_start=token_start,
                                 nbytes=payload.nbytes, dtype=str(data.dtype).removeprefix("torch."),
                                 shape=tuple(data.shape), checksum=await xxh3_hex_async(payload),
                                 traceparent=carrier.get("traceparent"))
            await self._send_chunk(endpoint, header, payload)
        return payload.nbytes

    def send_layer_threadsafe(self, endpoint: KVEndpoint, transfer_id: str, layer: int, chunk: int,
                              token_start: int, data: torch.Tensor,
                              traceparent: str | None = None) -> concurrent.futures.Future[int]:
        """`send_layer` scheduled on the transport's loop from any thread (e.g. a torch forward running in
        `asyncio.to_thread`); the future resolves to the payload bytes sent."""
        coro = self.send_layer(endpoint, transfer_id, layer, chunk, token_start, data, traceparent)
        return asyncio.run_coroutine_threadsafe(coro, self._owner_loop())

    async def finish(self, endpoint: KVEndpoint, transfer_id: str, num_layers: int, num_chunks: int) -> None:
        if self._elsewhere():
            coro = self.finish(endpoint, transfer_id, num_layers, num_chunks)
            return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self._owner_loop()))
        self._check_endpoint(endpoint)
        marker = FinishMarker(transfer_id=transfer_id, num_layers=num_layers, num_chunks=num_chunks)
        await self._send_control(endpoint, marker)

    def _check_endpoint(self, endpoint: KVEndpoint) -> None:
        if endpoint.transport != self.kind:
            raise ValueError(f"{self.kind} transport cannot send to a {endpoint.transport} endpoint")

    @abstractmethod
    async def _send_chunk(self, endpoint: KVEndpoint, header: ChunkHeader, payload: np.ndarray) -> None:
        """Deliver `header` (its `checksum` set) and its `payload` (uint8, `header.nbytes` long). Returns
        once the peer holds the payload. Raises TransferError when the peer cannot be reached."""

    @abstractmethod
    async def _send_control(self, endpoint: KVEndpoint, msg: FinishMarker) -> None:
        """Deliver a control message with no payload. Raises TransferError when the peer cannot be reached."""

