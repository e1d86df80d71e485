"""The receiving half shared by every transport: which memory a chunk lands in, checksum verification,
the `transfer.verify_checksum` span, and the transfers this worker expects.

A transport reads a `ChunkHeader`, asks `open_chunk` where its `nbytes` go (a view of the expected
transfer's buffer, or scratch memory for data nobody may keep), lands the payload there, then calls
`close_chunk`, which hashes the landed bytes and counts the chunk only if they match.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from typing import NamedTuple

import numpy as np
import torch
from opentelemetry import propagate, trace

from pdserve.transfer.base import ChecksumMismatchError, Inbound, InboundState, TransferError
from pdserve.transfer.checksum import byte_view, xxh3_hex_async
from pdserve.transfer.header import ChunkHeader, FinishMarker

log = logging.getLogger(__name__)
tracer = trace.get_tracer("pdserve.transfer")

# Transfer ids are single-use: a late chunk of a retired transfer must never land in a later transfer
# that reused its id. 65,536 ids ≈ hours of traffic at tens of requests per second, a few MiB of memory.
_RETIRED_IDS_KEPT = 65536


class Landing(NamedTuple):
    """Where one payload lands: `view` is exactly `nbytes` long; `inbound` is None for scratch memory."""

    view: np.ndarray
    inbound: Inbound | None


class _LayerBuffer(NamedTuple):
    """One expected layer buffer `[rows, *row_shape]` as a chunk header describes it, worked out once at
    `expect()` (torch attribute reads cost microseconds each, and a chunk header arrives per layer per
    chunk): `view` is its flat uint8 view, `row_bytes` the bytes of one token row."""

    view: np.ndarray
    dtype: str
    row_shape: tuple[int, ...]
    rows: int
    row_bytes: int

    @classmethod
    def of(cls, buf: torch.Tensor) -> _LayerBuffer:
        view = byte_view(buf)  # raises ValueError for non-contiguous / non-CPU buffers
        rows = buf.shape[0]
        return cls(view, str(buf.dtype).removeprefix("torch."), tuple(buf.shape[1:]), rows,
                   view.nbytes // rows if rows else 0)


class ReceiveTable:
    """The transfers a receiver expects, by transfer id. Lives on one event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._active: dict[str, Inbound] = {}
        self._retired: OrderedDict[str, None] = OrderedDict()
        self._layers: dict[str, list[_LayerBuffer]] = {}
        self._scratch = np.empty(0, np.uint8)

    def expect(self, transfer_id: str, buffers: list[torch.Tensor]) -> Inbound:
        """See `KVTransport.expect`."""
        if transfer_id in self._active or transfer_id in self._retired:
            raise ValueError(f"transfer {transfer_id} was already expected on this worker")
        if not buffers:
            raise ValueError("expect() needs at least one layer buffer")
        if len({b.dtype for b in buffers}) != 1:
            raise ValueError(f"layer buffers mix dtypes {sorted({str(b.dtype) for b in buffers})}")
        layers = [_LayerBuffer.of(b) for b in buffers]
        inbound = Inbound(transfer_id, buffers, self._loop, self._retire)
        self._active[transfer_id] = inbound
        self._layers[transfer_id] = layers
        return inbound

    def open_chunk(self, header: ChunkHeader) -> Landing:
        """Where `header`'s payload lands. A chunk that does not fit its transfer's buffers fails that
        transfer (TransferError on `wait()`) and lands in scratch, as do chunks of unknown or retired ids."""
        inbound = self._active.get(header.transfer_id)
        if inbound is None:
            return Landing(self._scratch_view(header.nbytes), None)
        try:
            view = self._buffer_view(inbound, header)
        except TransferError as e:
            inbound.fail(e)
            return Landing(self._scratch_view(header.nbytes), None)
        inbound.begin_landing()
        return Landing(view, inbound)

    async def close_chunk(self, header: ChunkHeader, landing: Landing, landed_ok: bool = True,
                          actual: str | None = None) -> None:
        """Verify a landed payload against `header.checksum` and count it. `actual`: the xxh3-64 hex of
        the landed bytes when the transport already hashed them as they landed (else hashed here).
        `landed_ok=False` (the payload or its checksum never fully arrived) only releases the landing."""
        inbound = landing.inbound
        if inbound is None:
            return
        try:
            if not landed_ok or header.checksum is None:
                return
            if actual is None:
                actual = await xxh3_hex_async(landing.view)
            ok = actual == header.checksum
            parent = propagate.extract({"traceparent": header.traceparent} if header.traceparent else {})
            with tracer.start_as_current_span("transfer.verify_checksum", context=parent) as span:
                span.set_attribute("pdserve.transfer_id", header.transfer_id)
                span.set_attribute("pdserve.layer", header.layer)
                span.set_attribute("pdserve.chunk", header.chunk)
                span.set_attribute("pdserve.bytes", header.nbytes)
                span.set_attribute("pdserve.checksum_ok", ok)
                if not ok:
                    span.set_status(trace.StatusCode.ERROR, "checksum mismatch")
            if ok:
                inbound.record_verified(header.layer, header.chunk, header.nbytes, header.token_start,
                                        header.shape[0])
            else:
                inbound.fail(ChecksumMismatchError(header.transfer_id, header.layer, header.chunk,
                                                   header.checksum, actual))
        finally:
            inbound.end_landing()

    def finish(self, marker: FinishMarker) -> None:
        """Record the end marker of `marker.transfer_id` (ignored for ids not expected)."""
        inbound = self._active.get(marker.transfer_id)
        if inbound is not None:
            inbound.record_finish(marker.num_layers, marker.num_chunks)

    def _buffer_view(self, inbound: Inbound, header: ChunkHeader) -> np.ndarray:
        layers = self._layers[inbound.transfer_id]
        if header.layer >= len(layers):
            raise TransferError(f"transfer {header.transfer_id}: layer {header.layer} of {len(layers)}")
        buf = layers[header.layer]
        n_tokens = header.shape[0]
        fits = (buf.dtype == header.dtype and buf.row_shape == header.shape[1:]
                and header.nbytes == n_tokens * buf.row_bytes and header.token_start + n_tokens <= buf.rows)
        if not fits:
            raise TransferError(f"transfer {header.transfer_id} layer {header.layer}: chunk {header.dtype} "
                                f"{list(header.shape)} at row {header.token_start} does not fit buffer "
                                f"{buf.dtype} {[buf.rows, *buf.row_shape]}")
        start = header.token_start * buf.row_bytes
        return buf.view[start : start + header.nbytes]

    def _scratch_view(self, nbytes: int) -> np.ndarray:
        # One shared scratch region: concurrent discards may overwrite each other, which is fine — nobody
        # reads it.
        if self._scratch.nbytes < nbytes:
            self._scratch = np.empty(nbytes, np.uint8)
        return self._scratch[:nbytes]

    def _retire(self, inbound: Inbound) -> None:
        self._active.pop(inbound.transfer_id, None)
        self._layers.pop(inbound.transfer_id, None)
        self._retired[inbound.transfer_id] = None
        while len(self._retired) > _RETIRED_IDS_KEPT:
            self._retired.popitem(last=False)
        if inbound.state is InboundState.FAILED:
            log.warning("transfer %s failed; its later chunks are discarded", inbound.transfer_id)
