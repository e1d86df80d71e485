"""A worker's KV transfer plumbing, apart from its role handlers (docs/architecture.md §6, data plane).

Prefill side, `OutboundKV`: the engine's KV sink. In `layerwise` mode each layer's new rows are sent the
moment that layer is computed (while the next layer computes), and the end marker right behind the last
layer of the prompt's last rows, so the decode worker can hold the whole KV before the prefill worker has
even sampled its first token; in `naive` mode (the baseline) they are held and all sent after the prefill.
`complete()` sends what is still to send and waits until everything is delivered.

Decode side, `InboundKV`: expects the transfer into staging rows, and scatters each chunk into the
reserved blocks as soon as its checksum is verified — while the prefill worker is still computing later
layers — so that after the last layer only that layer's landing, hash and scatter remain. The blocks
count as computed only once every chunk is verified and scattered (`ready()`, then the caller's
`mark_computed`); a failed or cancelled transfer leaves nothing marked, and `drained()` guarantees no
scatter still writes into blocks about to be freed.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import Future

import torch
from opentelemetry import propagate

from pdserve.engine.sequence import Sequence
from pdserve.kernels.kv_pack import token_slots, unpack_kv
from pdserve.messages import PrefillRequest
from pdserve.transfer.base import KVTransport, TransferStats

# (layer, chunk, first staging row, rows [n, 2, num_kv_heads, head_dim]) held by a naive sender
HeldChunk = tuple[int, int, int, torch.Tensor]


class OutboundKV:
    """The prefill side of one transfer. Row p of the prompt lands at row p - decode_num_cached_tokens
    of the decode worker's staging. Created on the worker's event loop."""

    def __init__(self, transport: KVTransport, req: PrefillRequest, num_layers: int, naive: bool) -> None:
        self.transport = transport
        self.req = req
        self.num_layers = num_layers
        self.kv_bytes = 0  # payload bytes the prefill produced for the decode worker so far
        self._loop = asyncio.get_running_loop()
        carrier: dict[str, str] = {}
        propagate.inject(carrier)
        self._traceparent = carrier.get("traceparent")
        self._sends: list[Future[int]] = []
        self._held: list[HeldChunk] | None = [] if naive else None
        self._chunk_of: dict[int, int] = {}  # first position of a step's rows → chunk number
        self._finish: Future[None] | None = None  # the end marker, once sent

    def on_layer(self, layer: int, start: int, rows: torch.Tensor) -> None:
        """The engine's KV sink (called in the engine's thread): `rows` [n, 2, num_kv_heads, head_dim] are
        positions start..start+n of layer `layer`, a copy the engine no longer touches."""
        if rows.device.type != "cpu":  # the transports move host memory: a device pool's rows are staged
            rows = rows.cpu()
        chunk = self._chunk_of.setdefault(start, len(self._chunk_of))
        row = start - self.req.decode_num_cached_tokens
        self.kv_bytes += rows.numel() * rows.element_size()
        if self._held is not None:
            self._held.append((layer, chunk, row, rows))
            return
        coro = self.transport.send_layer(self.req.endpoint, self.req.transfer_id, layer, chunk, row, rows,
                                         self._traceparent)
        self._sends.append(asyncio.run_coroutine_threadsafe(coro, self._loop))
        if layer == self.num_layers - 1 and start + rows.shape[0] == len(self.req.prompt_token_ids):
            # The prompt's last rows of the last layer: the transfer is whole. Announced now rather than
            # once the prefill returns, it no longer waits for that layer's attention and MLP, the LM head,
            # the sampling and a thread hop (15 ms for SmolLM2 at 128 tokens, 180 ms at 2048; before, the
            # marker's own trip was the whole 1.6-3.3 ms tail: docs/benchmarks/exposed_transfer.md).
            coro = self.transport.finish(self.req.endpoint, self.req.transfer_id, self.num_layers,
                                         len(self._chunk_of))
            self._finish = asyncio.run_coroutine_threadsafe(coro, self._loop)

    async def complete(self, num_chunks: int) -> int:
        """Send what is held (naive) and, unless `on_layer` already did, the end marker announcing
        `num_layers * num_chunks` chunks, then wait until every send is delivered. Returns the payload bytes
        sent. Raises TransferError.

        The marker does not wait for the chunks: the receiver completes a transfer once the marker and
        every chunk it announces are in, in any order, so sending it at once saves the decode worker a
        round trip (sender learns the last chunk is delivered → marker) after the last layer."""
        held, self._held = self._held or [], None
        sends = [asyncio.wrap_future(f) for f in self._sends]
        sends += [self.transport.send_layer(self.req.endpoint, self.req.transfer_id, layer, chunk, row, rows,
                                            self._traceparent)
                  for layer, chunk, row, rows in held]
        if self._finish is not None:
            finish = asyncio.wrap_future(self._finish)
        else:  # naive, or nothing to send (the decode worker had the whole prompt cached)
            finish = self.transport.finish(self.req.endpoint, self.req.transfer_id, self.num_layers,
                                           num_chunks)
        *sent, _ = await asyncio.gather(*sends, finish)
        return sum(sent)


class InboundKV:
    """The decode side of one transfer into `seq`'s reserved blocks (rows from `seq.num_cached_tokens` on).

    `staging[l]`: [len(seq) - seq.num_cached_tokens, 2, num_kv_heads, head_dim] fp32 where layer l's rows
    land; `kv_cache[l]`: the engine's [num_blocks, block_size, 2, num_kv_heads, head_dim] pool. Scatters run
    one at a time on `scatter_pool` (never on the event loop). Raises ValueError when the transport
    refuses the transfer id. `on_ready(stats)` is awaited once the KV is verified and in the blocks
(`ready_ts`, UNIX seconds, is then set).
    """

    def __init__(self, transport: KVTransport, transfer_id: str, seq: Sequence, kv_cache: list[torch.Tensor],
                 block_size: int, num_kv_heads: int, head_dim: int, timeout_s: float,
                 scatter_pool: concurrent.futures.Executor,
                 on_ready: Callable[[TransferStats], Awaitable[None]]) -> None:
        rows = len(seq) - seq.num_cached_tokens
        # host memory (what the transports move), in the pool's dtype; scattered into a device pool from here
        self.staging = [torch.empty(rows, 2, num_kv_heads, head_dim, dtype=pool.dtype) for pool in kv_cache]
        self.inbound = transport.expect(transfer_id, self.staging)
        self.inbound.on_chunk_verified = self._scatter_chunk
        self._kv_cache = kv_cache
        self._slots = token_slots(seq.block_table, seq.num_cached_tokens, len(seq), block_size,
                                  kv_cache[0].device)
        self._pool = scatter_pool
        self._loop = asyncio.get_running_loop()
        self._scatters: list[asyncio.Future[None]] = []
        self._on_ready = on_ready
        self._task = self._loop.create_task(self._receive(timeout_s))
        # A transfer that fails or is cancelled with nobody in `ready()` is not an unretrieved exception.
        self._task.add_done_callback(lambda t: t.cancelled() or t.exception())
        self.ready_ts = 0.0

    async def ready(self) -> TransferStats:
        """The transfer's stats once every chunk is verified and scattered into the blocks. Raises what
        `Inbound.wait` raises (ChecksumMismatchError, TransferTimeout, TransferCancelled, TransferError)."""
        return await asyncio.shield(self._task)

    def cancel(self) -> None:
        """Stop expecting the transfer; idempotent. Await `drained()` before freeing the blocks."""
        self.inbound.cancel()

    async def drained(self) -> None:
        """Return once no chunk is landing in the staging rows and no scatter writes into the blocks."""
        await self.inbound.drained()
        await asyncio.gather(*self._scatters, return_exceptions=True)

    def _scatter_chunk(self, layer: int, token_start: int, n_tokens: int) -> None:
        end = token_start + n_tokens
        self._scatters.append(self._loop.run_in_executor(
            self._pool, unpack_kv, self._kv_cache[layer], self._slots[token_start:end],
            self.staging[layer][token_start:end]))

    async def _receive(self, timeout_s: float) -> TransferStats:
        stats = await self.inbound.wait(timeout_s)
        await asyncio.gather(*self._scatters)
        self.staging = []
        self.ready_ts = time.time()
        await self._on_ready(stats)
        return stats
