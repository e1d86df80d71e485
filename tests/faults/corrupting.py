"""Fault injection for tests: a KV transport that flips one byte of chunks in flight, after their checksum.

`CorruptingTransport(inner)` wraps a real transport (`make_transport(kind)`) and behaves as it does, except
that a chunk picked for corruption travels as a copy of its payload with one random byte flipped, under the
header the inner transport made for the original payload (so its checksum no longer matches). The inner
transport computes the checksum in `ChunkedTransport.send_layer` and hands the header to `_send_chunk`: the
wrapper takes that one step of the inner transport, the only place where header and payload can part.

Chunks are picked two ways, both at the moment `send_layer` is called (so a burst of sends started
together corrupts the chunk it was meant for, whichever hashes first):
- `corrupt_next`: the next N chunks sent (with a payload) are corrupted (`tests/integration/transfer_peer.py`
  names the (layer, chunk) pairs it wants bad this way);
- `every_n`: the 1st, (n+1)-th, ... transfer this transport sends has its first chunk corrupted, so with
  n >= 2 the retry of a corrupted transfer (the next one) goes through clean (`corrupting_worker`);
- `pick(transfer_id, layer, chunk)`: that one chunk, when it is sent.
`only(transfer_id)`, when given, restricts all of it to the transfers it accepts (e.g. a hybrid's state
handoff, `state_transfer.is_state_transfer`): other transfers are neither counted nor corrupted.
"""

from __future__ import annotations

import concurrent.futures
import random
from collections.abc import Callable

import numpy as np
import torch

from pdserve.messages import KVEndpoint
from pdserve.transfer.base import Inbound, KVTransport
from pdserve.transfer.chunked import ChunkedTransport
from pdserve.transfer.header import ChunkHeader


def flip_one_byte(payload: np.ndarray) -> np.ndarray:
    """A private copy of `payload` with one random byte flipped (the caller's KV stays intact)."""
    bad = payload.copy()
    bad[random.randrange(bad.nbytes)] ^= 0xFF
    return bad


class CorruptingTransport(KVTransport):
    def __init__(self, inner: KVTransport, every_n: int = 0,
                 only: Callable[[str], bool] | None = None) -> None:
        if not isinstance(inner, ChunkedTransport):
            raise TypeError(f"cannot corrupt the chunks of a {type(inner).__name__}")
        self.inner: ChunkedTransport = inner
        self.kind = inner.kind
        self.every_n = every_n
        self.only = only
        self.corrupt_next = 0
        self.corrupted = 0  # chunks sent corrupted so far
        self._transfers: set[str] = set()  # transfer ids seen (a test transport's life is short)
        self._picked: set[tuple[str, int, int]] = set()  # (transfer_id, layer, chunk) to corrupt
        send_chunk = inner._send_chunk

        async def corrupting_send_chunk(endpoint: KVEndpoint, header: ChunkHeader,
                                        payload: np.ndarray) -> None:
            key = (header.transfer_id, header.layer, header.chunk)
            if key in self._picked:
                self._picked.discard(key)
                self.corrupted += 1
                payload = flip_one_byte(payload)
            await send_chunk(endpoint, header, payload)

        inner._send_chunk = corrupting_send_chunk  # type: ignore[method-assign]

    def pick(self, transfer_id: str, layer: int, chunk: int) -> None:
        """Corrupt chunk (`layer`, `chunk`) of `transfer_id` when it is sent."""
        self._picked.add((transfer_id, layer, chunk))

    def _seen(self, transfer_id: str) -> None:
        if self.only is not None and not self.only(transfer_id):
            return
        if transfer_id not in self._transfers:
            self._transfers.add(transfer_id)
            if self.every_n > 0 and (len(self._transfers) - 1) % self.every_n == 0:
                self.corrupt_next += 1

    def _pick(self, transfer_id: str, layer: int, chunk: int, data: torch.Tensor) -> None:
        self._seen(transfer_id)
        if self.only is not None and not self.only(transfer_id):
            return
        if self.corrupt_next > 0 and data.numel() > 0:
            self.corrupt_next -= 1
            self._picked.add((transfer_id, layer, chunk))

    # -- KVTransport, delegated

    async def start(self) -> None:
        await self.inner.start()

    def endpoint(self) -> KVEndpoint:
        return self.inner.endpoint()

    def expect(self, transfer_id: str, buffers: list[torch.Tensor]) -> Inbound:
        return self.inner.expect(transfer_id, buffers)

    async def send_layer(self, endpoint: KVEndpoint, transfer_id: str, layer: int, chunk: int,
                         token_start: int, data: torch.Tensor, traceparent: str | None = None) -> int:
        self._pick(transfer_id, layer, chunk, data)
        return await self.inner.send_layer(endpoint, transfer_id, layer, chunk, token_start, data,
                                           traceparent)

    def send_layer_threadsafe(self, endpoint: KVEndpoint, transfer_id: str, layer: int, chunk: int,
                              token_start: int, data: torch.Tensor,
                              traceparent: str | None = None) -> concurrent.futures.Future[int]:
        self._pick(transfer_id, layer, chunk, data)
        return self.inner.send_layer_threadsafe(endpoint, transfer_id, layer, chunk, token_start, data,
                                                traceparent)

    async def finish(self, endpoint: KVEndpoint, transfer_id: str, num_layers: int, num_chunks: int) -> None:
        self._seen(transfer_id)  # a transfer with nothing to send counts too
        await self.inner.finish(endpoint, transfer_id, num_layers, num_chunks)

    async def stop(self) -> None:
        await self.inner.stop()
