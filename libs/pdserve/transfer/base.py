"""The KV transfer interface: a decode worker expects a transfer into its preallocated KV, a prefill
worker sends each layer of each prefill chunk to the decode worker's endpoint as it is computed.

A layer's KV on both sides is a torch CPU tensor `[max_tokens, 2, num_kv_heads, head_dim]` (token-major,
K then V); a chunk is the contiguous row range `layer[token_start:token_end]`. Each chunk carries an
xxh3-64 checksum; the receiver lands the payload straight into its buffer and counts the chunk only once
the checksum of the landed bytes matches. Unverified KV never counts as received.
"""

from __future__ import annotations

import asyncio
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

import torch

from pdserve.messages import KVEndpoint, KVTransportKind


class TransferError(Exception):
    """A transfer that cannot complete: base of every error this package raises."""


class ChecksumMismatchError(TransferError):
    """The landed bytes of chunk (`layer`, `chunk`) hash to `actual`, the sender hashed `expected`
    (both xxh3-64 hex). Raised for the first bad chunk of a transfer."""

    def __init__(self, transfer_id: str, layer: int, chunk: int, expected: str, actual: str) -> None:
        super().__init__(f"transfer {transfer_id} layer {layer} chunk {chunk}: "
                         f"checksum {actual} != {expected}")
        self.transfer_id = transfer_id
        self.layer = layer
        self.chunk = chunk
        self.expected = expected
        self.actual = actual


class TransferTimeout(TransferError):
    """`Inbound.wait` ran out of time before every chunk and the end marker were verified."""


class TransferCancelled(TransferError):
    """`Inbound.wait` on a transfer that was cancelled."""


@dataclass(frozen=True)
class TransferStats:
    """A verified transfer: `kv_bytes` payload bytes over `num_layers * num_chunks` chunks; `seconds` runs
    from `expect()` to the last chunk verified; `verified_ts`: UNIX seconds then, when the receiver stamped
    it (0.0 otherwise)."""

    transfer_id: str
    kv_bytes: int
    num_layers: int
    num_chunks: int
    seconds: float
    verified_ts: float = 0.0


class InboundState(StrEnum):
    RECEIVING = "receiving"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"


class Inbound:
    """One expected transfer on the receiver: where its chunks land and what has been verified.

    Created by `KVTransport.expect`; lives on the transport's event loop. Once it leaves RECEIVING
    (verified, failed, cancelled) any further data for its transfer id is received into scratch memory,
    never into `buffers`.
    """

    def __init__(self, transfer_id: str, buffers: list[torch.Tensor], loop: asyncio.AbstractEventLoop,
                 on_retire: Callable[[Inbound], None]) -> None:
        self.transfer_id = transfer_id
        self.buffers = buffers
        # Called on the transport's loop, once per chunk, as soon as its rows [token_start, token_start +
        # n_tokens) of layer `layer` are verified: (layer, token_start, n_tokens). Lets a receiver use a
        # layer's KV (e.g. scatter it into blocks) while later layers are still on their way.
        self.on_chunk_verified: Callable[[int, int, int], None] | None = None
        self.state = InboundState.RECEIVING
        self.chunks_done: set[tuple[int, int]] = set()
        self.kv_bytes = 0
        self.expected_chunks: tuple[int, int] | None = None  # (num_layers, num_chunks) from the end marker
        self.in_flight = 0
        self._t0 = time.perf_counter()
        self._result: asyncio.Future[TransferStats] = loop.create_future()
        self._idle = asyncio.Event()
        self._idle.set()
        self._on_retire = on_retire

    @property
    def layers_done(self) -> set[int]:
        """Layers with at least one verified chunk (for tracing and progress, not for admission)."""
        return {layer for layer, _ in self.chunks_done}

    async def wait(self, timeout_s: float) -> TransferStats:
        """Wait until the end marker arrived and every chunk it announces verified.

        Raises ChecksumMismatchError (the first bad chunk, as soon as it is seen), TransferError (a chunk
        that does not fit the buffers), TransferCancelled, or TransferTimeout after `timeout_s` seconds (the
        transfer keeps being expected; call `cancel()` to give up on it).
        """
        try:
            return await asyncio.wait_for(asyncio.shield(self._result), timeout_s)
        except TimeoutError:
            have = len(self.chunks_done)
            raise TransferTimeout(f"transfer {self.transfer_id}: {have} chunks verified after {timeout_s} s, "
                                  f"end marker {'seen' if self.expected_chunks else 'not seen'}") from None

    def cancel(self) -> None:
        """Stop expecting this transfer; idempotent. Chunks that arrive later go to scratch memory. A payload
        whose landing already began is finished into the buffers then discarded: await `drained()` before
        handing the buffers to another transfer."""
        if self.state is InboundState.RECEIVING:
            self._retire(InboundState.CANCELLED, TransferCancelled(f"transfer {self.transfer_id} cancelled"))

    async def drained(self) -> None:
        """Return once no payload is landing in this transfer's buffers."""
        await self._idle.wait()

    # -- receiver side (called by the transport on its event loop)

    def begin_landing(self) -> None:
        self.in_flight += 1
        self._idle.clear()

    def end_landing(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self._idle.set()

    def record_verified(self, layer: int, chunk: int, nbytes: int, token_start: int = 0,
                        n_tokens: int = 0) -> None:
        if self.state is not InboundState.RECEIVING:
            return
        if (layer, chunk) not in self.chunks_done:
            self.chunks_done.add((layer, chunk))
            self.kv_bytes += nbytes
            if self.on_chunk_verified is not None:
                self.on_chunk_verified(layer, token_start, n_tokens)
        self._maybe_complete()

    def record_finish(self, num_layers: int, num_chunks: int) -> None:
        if self.state is InboundState.RECEIVING:
            self.expected_chunks = (num_layers, num_chunks)
            self._maybe_complete()

    def fail(self, error: TransferError) -> None:
        if self.state is InboundState.RECEIVING:
            self._retire(InboundState.FAILED, error)

    def _maybe_complete(self) -> None:
        if self.expected_chunks is None:
            return
        num_layers, num_chunks = self.expected_chunks
        # Counting first: checked at every verified chunk, building the wanted set each time was quadratic.
        if len(self.chunks_done) < num_layers * num_chunks:
            return
        done = self.chunks_done
        if all((layer, chunk) in done for layer in range(num_layers) for chunk in range(num_chunks)):
            stats = TransferStats(self.transfer_id, self.kv_bytes, num_layers, num_chunks,
                                  time.perf_counter() - self._t0)
            self._retire(InboundState.DONE, stats)

    def _retire(self, state: InboundState, outcome: TransferStats | TransferError) -> None:
        self.state = state
        if isinstance(outcome, TransferStats):
            self._result.set_result(outcome)
        else:
            self._result.set_exception(outcome)
            self._result.exception()  # a failure nobody waits for is not an "exception never retrieved"
        self._on_retire(self)


class KVTransport(ABC):
    """Moves KV chunks from prefill to decode workers.

    Lifecycle: `start()` (binds to the running event loop) → `endpoint()` published in the Reservation →
    on the receiver `expect()` then `Inbound.wait()`; on the sender `send_layer()` per (layer, chunk) then
    `finish()` → `stop()`. Every coroutine may be awaited from another thread's event loop; it then runs
    on the transport's own loop.
    """

    kind: KVTransportKind

    @abstractmethod
    async def start(self) -> None:
        """Open the receiving side and bind to the running event loop."""

    @abstractmethod
    def endpoint(self) -> KVEndpoint:
        """Where peers send KV for this worker. Raises RuntimeError before `start()`."""

    @abstractmethod
    def expect(self, transfer_id: str, buffers: list[torch.Tensor]) -> Inbound:
        """Expect `transfer_id` into `buffers` (one contiguous CPU tensor per layer,
        `[max_tokens, 2, num_kv_heads, head_dim]`). Raises ValueError for a transfer id this transport has
        already seen, or for buffers that are not contiguous CPU tensors of one dtype."""

    @abstractmethod
    async def send_layer(self, endpoint: KVEndpoint, transfer_id: str, layer: int, chunk: int,
                         token_start: int, data: torch.Tensor, traceparent: str | None = None) -> int:
        """Send `data` (contiguous rows `[n_tokens, 2, num_kv_heads, head_dim]` of layer `layer`) to land at
        rows `token_start:token_start+n_tokens` of the receiver's buffer for that layer. Returns the payload
        bytes sent. Raises ValueError for non-contiguous data, TransferError when the peer cannot be
        reached."""

    @abstractmethod
    async def finish(self, endpoint: KVEndpoint, transfer_id: str, num_layers: int, num_chunks: int) -> None:
        """Send the end-of-transfer marker announcing `num_layers * num_chunks` chunks."""

    @abstractmethod
    async def stop(self) -> None:
        """Close connections and stop receiving; pending `Inbound.wait()` calls then time out."""
