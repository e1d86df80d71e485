"""KV transfer over UCX (`ucxx`, the maintained successor of ucx-py; DESIGN §3, §9).

Receiver: one UCX worker per process, published as the endpoint address (base64 of its UCX worker
address, handed to peers out of band in the Reservation). It receives with worker-level tagged receives,
so it needs no endpoint back to any sender: a receive loop takes every control message on `_CONTROL_TAG`;
a `ChunkHeader` names the tags its payload pieces and checksum travel on, and the loop posts every piece's
receive (straight into the expected transfer's buffer view) before it takes the next control message; a
task per chunk then hashes each piece as it lands, while the next piece is still being copied.

Sender: an endpoint per peer from `create_endpoint_from_worker_address`, cached and reused; each chunk is
the header on `_CONTROL_TAG`, the payload in `_PIECE_BYTES` pieces on consecutive tags unique to this
sender (random 31-bit sender id, 32-bit sequence number), all posted at once, then the xxh3-64 of the
whole chunk (hashed while the pieces are copied) on the next tag. UCX copies each piece with one kernel
`process_vm_readv` by the receiver (CMA rendezvous); benchmarks/transfer.py measures that copy's ceiling.

Configuration: shared memory (`UCX_TLS=sm,self`; DESIGN §9 measured bare ucxx at 5.4 / 7.0 / 7.7 GB/s at
1 / 16 / 256 MiB, against 1.9-2.0 for UCX over TCP), `endpoint_error_handling=False`, and a UCX progress
thread (see `_DEFAULT_PROGRESS_MODE`). With error handling off a dead peer is not reported here: workers
detect it by heartbeats. `UCX_TLS` / `UCXPY_PROGRESS_MODE` in the environment override the defaults (e.g.
`tcp,self` between hosts). UCX is configured once per process, at the first `start()`.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import os
import random

import numpy as np
from ucxx._lib.arr import Array
from ucxx.types import Tag

from pdserve.messages import KVEndpoint
from pdserve.transfer.base import TransferError
from pdserve.transfer.checksum import StreamingXxh3
from pdserve.transfer.chunked import ChunkedTransport, flip_one_byte
from pdserve.transfer.header import (
    MAX_CONTROL_BYTES,
    ChunkHeader,
    FinishMarker,
    decode_control,
    encode_control,
    piece_ranges,
)
from pdserve.transfer.receiver import Landing

log = logging.getLogger(__name__)

# Control messages use a tag with the top bit set; payload tags never have it, so the two cannot collide.
_CONTROL_TAG = 0xF0D5_E27E_0000_0001
_DEFAULT_TLS = "sm,self"
_CHECKSUM_BYTES = 16  # the xxh3-64 hex digest, sent after a chunk's last piece
# A chunk travels in pieces of this many bytes so that hashing (sender and receiver) overlaps the copy.
_PIECE_BYTES = 4 << 20


def _piece_bytes() -> int:
    return int(os.environ.get("PDS_UCXX_PIECE_BYTES", _PIECE_BYTES))
# "thread" (a UCX progress thread) measured 2-4x faster than "blocking" through this transport under the
# shared load of this 2-core machine (issue 4: 0.60 / 1.3-1.6 GB/s at 1 / 16 MiB against 0.09-0.30 /
# 0.46-0.58): blocking progress waits for the event loop to come round to the worker's fd between the
# header and the rendezvous of each payload.
_DEFAULT_PROGRESS_MODE = "thread"

_context = None  # the process's ucxx ApplicationContext: one UCX worker per process
_context_owner: UcxxTransport | None = None


def _ucx_context():
    """The process-wide ucxx context, created on first use on the running event loop."""
    global _context
    if _context is None:
        # ucxx sets UCX_MEMTYPE_CACHE, which this CPU build of UCX does not know and would warn about.
        os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
        from ucxx._lib_async import ApplicationContext

        _context = ApplicationContext(
            {"TLS": os.environ.get("UCX_TLS", _DEFAULT_TLS)},
            progress_mode=os.environ.get("UCXPY_PROGRESS_MODE", _DEFAULT_PROGRESS_MODE),
            # Without it ucxx completes requests by polling them from the event loop, and the control
            # receive is always posted: an idle worker then burns a whole core (measured 1.0 CPU-s per s,
            # issue 4), which on this 2-core machine halved prefill speed. The notifier thread completes
            # Python futures instead: 0.07 CPU-s per s idle.
            enable_python_future=os.environ.get("UCXPY_ENABLE_PYTHON_FUTURE", "1") != "0",
        )
    else:
        # A later start() on another loop (tests run several) must progress the worker there too, and
        # needs a notifier thread bound to that loop (stop() ended the previous one).
        _context.continuous_ucx_progress(asyncio.get_running_loop())
        _context.start_notifier_thread()
    return _context


class UcxxTransport(ChunkedTransport):
    """`KVTransport` over UCX tagged messages. At most one is started per process (it owns the process's
    UCX worker); `start()` raises RuntimeError for a second."""

    kind = "ucxx"

    def __init__(self) -> None:
        super().__init__()
        self._ctx = None
        self._address: str | None = None
        self._sender_id = random.getrandbits(31)
        self._seq = 0
        self._endpoints: dict[str, object] = {}
        self._connecting: dict[str, asyncio.Lock] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        global _context_owner
        if _context_owner is not None and _context_owner is not self:
            raise RuntimeError("a UcxxTransport is already started in this process (one UCX worker each)")
        self._bind()
        self._ctx = _ucx_context()
        _context_owner = self
        self._address = base64.b64encode(self._ctx.worker_address.tobytes()).decode("ascii")
        self._spawn(self._recv_loop())

    def endpoint(self) -> KVEndpoint:
        if self._address is None:
            raise RuntimeError("UcxxTransport is not started")
        return KVEndpoint(transport="ucxx", address=self._address)

    async def stop(self) -> None:
        global _context_owner
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._ctx is not None:
            # The control receive posted by the loop would otherwise stay posted and swallow the first
            # control message meant for a transport started later in this process.
            self._ctx.worker.cancel_inflight_requests()
            # The notifier thread is not a daemon: left running, the process can never exit (Python joins
            # it at shutdown). Joined from a thread because it may need this loop to finish its last round.
            await asyncio.to_thread(self._ctx.stop_notifier_thread)
        for ep in self._endpoints.values():
            ep.abort()
        self._endpoints.clear()
        self._address = None
        if _context_owner is self:
            _context_owner = None

    # -- sending

    async def _send_chunk(self, endpoint: KVEndpoint, header: ChunkHeader, payload: np.ndarray,
                          corrupt: bool) -> None:
        ep = await self._endpoint_to(endpoint.address)
        pieces = piece_ranges(payload.nbytes, _piece_bytes())
        tag = self._take_tags(len(pieces) + 1)
        header = header.model_copy(update={"payload_tag": tag, "piece_bytes": _piece_bytes()})
        # Post the header and every piece at once, then hash the pieces in order while the receiver's
        # progress thread copies them (both only read `payload`), and post the checksum last. Fault
        # injection (`corrupt`) hashes first, then sends one piece as a flipped copy.
        # A UCX request does not keep its buffer alive: `buffers` does, until every send completed.
        digest = StreamingXxh3()
        bad_piece = -1
        if corrupt:
            for a, b in pieces:
                await digest.update(payload[a:b])
            bad_piece = random.randrange(len(pieces))
        buffers = [Array(bytearray(encode_control(header)))]
        requests = [ep._ep.tag_send(buffers[0], Tag(_CONTROL_TAG))]
        for i, (a, b) in enumerate(pieces):
            if b > a:
                buffers.append(Array(flip_one_byte(payload[a:b]) if i == bad_piece else payload[a:b]))
                requests.append(ep._ep.tag_send(buffers[-1], Tag(tag + i)))
        if not corrupt:
            for a, b in pieces:
                await digest.update(payload[a:b])
        buffers.append(Array(bytearray(digest.hexdigest().encode("ascii"))))
        requests.append(ep._ep.tag_send(buffers[-1], Tag(tag + len(pieces))))
        await self._guard(endpoint.address, asyncio.gather(*(r.wait() for r in requests)))
        buffers.clear()  # only now may the pieces' memory go

    def _take_tags(self, n: int) -> int:
        """`n` consecutive payload tags unique to this sender: sender id in the high 31 bits, a running
        sequence in the low 32 (wrapping after 4 G tags, long after any transfer that used them ended)."""
        tag = (self._sender_id << 32) | self._seq
        self._seq = (self._seq + n) & 0xFFFF_FFFF
        if self._seq < n:  # the range would wrap into the sender id: start again at 0
            self._seq = n
            tag = self._sender_id << 32
        return tag

    async def _send_control(self, endpoint: KVEndpoint, msg: FinishMarker) -> None:
        ep = await self._endpoint_to(endpoint.address)
        await self._guard(endpoint.address, ep.send(bytearray(encode_control(msg)), tag=_CONTROL_TAG,
                                                    force_tag=True))

    async def _guard(self, address: str, sending) -> None:
        try:
            await sending
        except Exception as e:  # ucxx raises its own UCXError family
            if (ep := self._endpoints.pop(address, None)) is not None:
                ep.abort()
            raise TransferError(f"UCX send to {address[:16]}… failed: {e}") from e

    async def _endpoint_to(self, address: str):
        if (ep := self._endpoints.get(address)) is not None:
            return ep
        async with self._connecting.setdefault(address, asyncio.Lock()):
            if (ep := self._endpoints.get(address)) is not None:
                return ep
            import ucxx._lib.libucxx as ucx_api

            try:
                worker_address = ucx_api.UCXAddress.create_from_buffer(base64.b64decode(address))
                ep = await self._ctx.create_endpoint_from_worker_address(worker_address,
                                                                          endpoint_error_handling=False)
            except Exception as e:
                raise TransferError(f"cannot reach UCX worker {address[:16]}…: {e}") from e
            self._endpoints[address] = ep
            return ep

    # -- receiving

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _recv_loop(self) -> None:
        """Take every control message addressed to this worker, from any sender."""
        table = self._receiving()
        control = bytearray(MAX_CONTROL_BYTES)
        while True:
            await self._ctx.recv(control, _CONTROL_TAG)
            try:
                msg = decode_control(control)
            except ValueError as e:
                log.warning("dropping a malformed KV control message: %s", e)
                continue
            if isinstance(msg, FinishMarker):
                table.finish(msg)
            else:
                # Post every piece's receive now, before this loop takes the next control message, so
                # the pieces land while the next header is decoded; then hash them as they land.
                landing = table.open_chunk(msg)
                pieces = piece_ranges(msg.nbytes, msg.piece_bytes)
                worker = self._ctx.worker
                trailer = bytearray(_CHECKSUM_BYTES)
                # A UCX request does not keep its buffer alive: `buffers` does, until `_land` returns.
                buffers = [Array(landing.view[a:b]) for a, b in pieces if b > a] + [Array(trailer)]
                tags = [msg.payload_tag + i for i, (a, b) in enumerate(pieces) if b > a]
                tags.append(msg.payload_tag + len(pieces))
                requests = [worker.tag_recv(buf, Tag(t)) for buf, t in zip(buffers, tags, strict=True)]
                self._spawn(self._land(msg, landing, pieces, requests, trailer, buffers))

    async def _land(self, header: ChunkHeader, landing: Landing, pieces: list[tuple[int, int]],
                    requests: list, trailer: bytearray, buffers: list) -> None:
        landed, digest = False, StreamingXxh3()
        try:
            for (a, b), request in zip(pieces, requests, strict=False):
                if b > a:
                    await request.wait()
                if landing.inbound is not None:  # scratch landings are never read, so never hashed
                    await digest.update(landing.view[a:b])
            await requests[-1].wait()
            header = header.model_copy(update={"checksum": trailer.decode("ascii", "replace")})
            landed = True
        finally:
            await self._receiving().close_chunk(header, landing, landed_ok=landed,
                                                actual=digest.hexdigest() if landed else None)
