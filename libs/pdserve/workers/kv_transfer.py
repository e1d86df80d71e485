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
scatter still writes into blocks about to be freed. For a model with recurrent state, the transfer is
ready only once the whole state (`state_transfer.StateInbound`) is verified too; `state` is then the
state to install, and a failure of either half cancels both.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import Future

import torch
from opentelemetry import propagate

from pdserve.engine.sequence import Sequence
from pdserve.engine.state_pool import SequenceState
from pdserve.kernels.kv_pack import token_slots, unpack_kv
from pdserve.messages import PrefillRequest
from pdserve.transfer.base import KVTransport, TransferStats
from pdserve.workers.state_transfer import StateInbound

# (layer, chunk, first staging row, rows [n, *paged_row_shape]) held by a naive sender
HeldChunk = tuple[int, int, int, torch.Tensor]


class OutboundKV:
    """The prefill side of one transfer of `num_layers` paged layers (the model's
    `cache_spec().num_paged_layers`). Row p of the prompt lands at row p - decode_num_cached_tokens of the
    decode worker's staging. Created on the worker's event loop."""

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
        """The engine's KV sink (called in the engine's thread): `rows` [n, *paged_row_shape] (Llama
        [n, 2, kv_heads, head_dim], MLA [n, kv_lora_rank + rope_dim]) are positions start..start+n of paged
        layer `layer`, a copy the engine no longer touches."""
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

    `staging[l]`: [len(seq) - seq.num_cached_tokens, *row_shape] in the pool's dtype, host memory, where
    paged layer l's rows land; `kv_cache[l]`: the engine's [num_blocks, block_size, *row_shape] pool, one per
    paged layer (`row_shape` = `cache_spec().paged_row_shape`: Llama (2, kv_heads, head_dim)). Scatters run
    one at a time on `scatter_pool` (never on the event loop). Raises ValueError when the transport
    refuses the transfer id. `on_ready(stats, state_stats)` is awaited once the KV is verified and in the
    blocks (`ready_ts`, UNIX seconds, is then set). With a `state` handoff expected beside the KV,
    `ready()` waits for both, `state_stats` is set (None otherwise) and `state` is the verified state.
    """

    def __init__(self, transport: KVTransport, transfer_id: str, seq: Sequence, kv_cache: list[torch.Tensor],
                 block_size: int, row_shape: tuple[int, ...], timeout_s: float,
                 scatter_pool: concurrent.futures.Executor,
                 on_ready: Callable[[TransferStats, TransferStats | None], Awaitable[None]],
                 state: StateInbound | None = None) -> None:
        rows = len(seq) - seq.num_cached_tokens
        # host memory (what the transports move), in the pool's dtype; scattered into a device pool from here
        self.staging = [torch.empty(rows, *row_shape, dtype=pool.dtype) for pool in kv_cache]
        self.inbound = transport.expect(transfer_id, self.staging)
        self.inbound.on_chunk_verified = self._scatter_chunk
        self._state = state
        self.state_stats: TransferStats | None = None
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
        """Stop expecting the transfer (and the state); idempotent. Await `drained()` before freeing the
        blocks."""
        self.inbound.cancel()
        if self._state is not None:
            self._state.cancel()

    @property
    def state(self) -> SequenceState | None:
        """The verified state to install (name -> [layers, *shape]) once `ready()` returned; None for a
        model without state."""
        return self._state.verified() if self._state is not None else None

    async def drained(self) -> None:
        """Return once no chunk is landing in the staging rows and no scatter writes into the blocks."""
        await self.inbound.drained()
        if self._state is not None:
            await self._state.drained()
        await asyncio.gather(*self._scatters, return_exceptions=True)

    def _scatter_chunk(self, layer: int, token_start: int, n_tokens: int) -> None:
        end = token_start + n_tokens
        self._scatters.append(self._loop.run_in_executor(
            self._pool, unpack_kv, self._kv_cache[layer], self._slots[token_start:end],
            self.staging[layer][token_start:end]))

    async def _receive(self, timeout_s: float) -> TransferStats:
        async def stamped(wait: Awaitable[TransferStats]) -> TransferStats:
            stats = await wait  # when each half was verified: the KV's exposed tail and the state's apart
            return dataclasses.replace(stats, verified_ts=time.time())

        try:
            if self._state is None:
                stats = await stamped(self.inbound.wait(timeout_s))
            else:  # the first failure of either half fails the transfer
                stats, self.state_stats = await asyncio.gather(stamped(self.inbound.wait(timeout_s)),
                                                               stamped(self._state.wait(timeout_s)))
        except BaseException:
            self.cancel()  # nothing of a failed transfer lands later
            raise
        await asyncio.gather(*self._scatters)
        self.staging = []
        self.ready_ts = time.time()
        await self._on_ready(stats, self.state_stats)
        return stats
