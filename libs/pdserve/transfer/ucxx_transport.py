"""KV transfer over UCX (`ucxx`, the maintained successor of ucx-py; docs/architecture.md §6, §10).

Receiver: one UCX worker per process, published as the endpoint address (base64 of its UCX worker
address, handed to peers out of band in the Reservation). It receives with worker-level tagged receives,
so it needs no endpoint back to any sender: `_CONTROL_RING` receives stay posted on `_CONTROL_TAG` and
take every control message; a `ChunkHeader` (with the chunk's xxh3-64) names the tags its payload pieces
travel on, and the loop posts every piece's receive (straight into the expected transfer's buffer view)
before it takes the next control message; a task per chunk then hashes each piece as it lands, while the
next piece is still being copied, and verifies the chunk against the header's checksum.

Sender: an endpoint per peer from `create_endpoint_from_worker_address`, cached and reused; each chunk is
hashed (xxh3-64, in `ChunkedTransport.send_layer`), then sent as the header on `_CONTROL_TAG` and the
payload in `_PIECE_BYTES` pieces on consecutive tags unique to this sender (random 31-bit sender id,
32-bit sequence number), all posted at once. UCX copies each piece with one kernel `process_vm_readv` by
the receiver (CMA rendezvous); benchmarks/transfer.py measures that copy's ceiling and bare ucxx beside
this transport.

Configuration: shared memory (`UCX_TLS=sm,self`; docs/architecture.md §10 measured bare ucxx at 5.4 / 7.0 /
7.7 GB/s at
1 / 16 / 256 MiB, against 1.9-2.0 for UCX over TCP), `endpoint_error_handling=False`, and a UCX progress
thread (see `_DEFAULT_PROGRESS_MODE`). With error handling off a dead peer is not reported here: workers
detect it by heartbeats. `UCX_TLS` / `UCXPY_PROGRESS_MODE` in the environment override the defaults.
UCX is configured once per process, at the first `start()`.

Between hosts (`host`, from `PDS_KV_HOST`, is not a loopback address): UCX runs over TCP on the one
interface that holds `host` (`UCX_NET_DEVICES`), so the worker address published to peers carries that
interface's address and no other (no loopback a peer on another host could not reach), with the 512 KiB
segments §10 measured (~2 GB/s against 0.5 at UCX's default). Shared memory is left out on purpose: two
network namespaces on one machine could still use it, and the transfer would no longer be the one two
hosts make. Where an RDMA device exists, `UCX_TLS=rc,tcp,self` adds it.
"""

from __future__ import annotations

import asyncio
import base64
import ipaddress
import logging
import os
import random
from collections import deque

import numpy as np
import psutil
from ucxx._lib.arr import Array
from ucxx.types import Tag

from pdserve.messages import KVEndpoint, KVTransportKind
from pdserve.transfer.base import TransferError
from pdserve.transfer.checksum import StreamingXxh3
from pdserve.transfer.chunked import ChunkedTransport
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
# Control receives kept posted at once (see `_recv_loop`); more headers than this in flight just wait
# in UCX's unexpected queue.
_CONTROL_RING = 64
# A chunk travels in pieces of this many bytes so that the receiver's hashing overlaps the copy.
_PIECE_BYTES = 4 << 20
# "thread": a UCX progress thread copies while the event loop hashes, and idles in epoll. "blocking"
# measured up to 2x faster on many-chunk transfers (issue 4: 2.8 against 1.3-1.5 GB/s at 16 MiB in 32
# chunks) but cannot serve: ucxx then completes requests by `wait_yield` (asyncio.sleep(0) polling), so an
# idle worker with its control receives posted burns a core, and all posted copies run inside one
# `worker.progress()` on the event loop, so no piece is hashed until every copy is done.
_DEFAULT_PROGRESS_MODE = "thread"

_context = None  # the process's ucxx ApplicationContext: one UCX worker per process
_context_owner: UcxxTransport | None = None


def interface_of(address: str) -> str:
    """The name of the network interface that holds the IPv4 `address` (e.g. 'eth0'). Raises
    ValueError when no interface of this host has it."""
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address == address for a in addrs):
            return name
    raise ValueError(f"no network interface of this host has the address {address}")


def ucx_options(host: str) -> dict[str, str]:
    """UCX configuration (names without the `UCX_` prefix) for a transport that publishes `host`:
    shared memory on loopback; TCP on `host`'s interface otherwise (see the module docstring). A `UCX_*`
    variable in the environment wins over these."""
    if ipaddress.ip_address(host).is_loopback:
        options = {"TLS": _DEFAULT_TLS}
    else:
        options = {"TLS": "tcp,self", "NET_DEVICES": interface_of(host), "TCP_RX_SEG_SIZE": "512k",
                   "TCP_TX_SEG_SIZE": "512k"}
    return {k: os.environ.get(f"UCX_{k}", v) for k, v in options.items()}


def _ucx_context(host: str = "127.0.0.1"):
    """The process-wide ucxx context, created on first use on the running event loop."""
    global _context
    if _context is None:
        # ucxx sets UCX_MEMTYPE_CACHE at import, a setting for CUDA memory; pdserve's KV is host memory,
        # and this CPU build of UCX does not know the variable and warned about it at every start.
        os.environ.pop("UCX_MEMTYPE_CACHE", None)
        from ucxx._lib_async import ApplicationContext

        _context = ApplicationContext(
            ucx_options(host),
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
    UCX worker); `start()` raises RuntimeError for a second. `host`: the address peers reach this worker
    at (loopback: shared memory; another: TCP on its interface, see the module docstring)."""

    kind = KVTransportKind.UCXX

    def __init__(self, host: str = "127.0.0.1") -> None:
        super().__init__()
        self.host = host
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
        self._ctx = _ucx_context(self.host)
        _context_owner = self
        self._address = base64.b64encode(self._ctx.worker_address.tobytes()).decode("ascii")
        self._spawn(self._recv_loop())

    def endpoint(self) -> KVEndpoint:
        if self._address is None:
            raise RuntimeError("UcxxTransport is not started")
        return KVEndpoint(transport=KVTransportKind.UCXX, address=self._address)

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

    async def _send_chunk(self, endpoint: KVEndpoint, header: ChunkHeader, payload: np.ndarray) -> None:
        ep = await self._endpoint_to(endpoint.address)
        pieces = piece_ranges(payload.nbytes, _PIECE_BYTES)
        # The checksum is in the header already, so a chunk is one control message and its pieces.
        tag = self._take_tags(len(pieces))
        header = header.model_copy(update={"payload_tag": tag, "piece_bytes": _PIECE_BYTES})
        # A UCX request does not keep its buffer alive: `buffers` does, until every send completed.
        buffers = [Array(bytearray(encode_control(header)))]
        requests = [ep._ep.tag_send(buffers[0], Tag(_CONTROL_TAG))]
        for i, (a, b) in enumerate(pieces):
            if b > a:
                buffers.append(Array(payload[a:b]))
                requests.append(ep._ep.tag_send(buffers[-1], Tag(tag + i)))
        await self._guard(endpoint.address, _settled(requests))
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
        buf = Array(bytearray(encode_control(msg)))
        await self._guard(endpoint.address, _settled([ep._ep.tag_send(buf, Tag(_CONTROL_TAG))]))

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
        """Take every control message addressed to this worker, from any sender.

        `_CONTROL_RING` receives stay posted on the control tag: UCX matches messages to them in post order,
        so awaiting the oldest keeps the order, and a burst of headers (a prefill worker fires every layer
        without waiting) lands without a completion → event loop → re-post round trip per header."""
        table = self._receiving()
        worker = self._ctx.worker
        ring: deque[tuple[object, bytearray]] = deque()

        def post(buf: bytearray) -> None:
            ring.append((worker.tag_recv(Array(buf), Tag(_CONTROL_TAG)), buf))

        for _ in range(_CONTROL_RING):
            post(bytearray(MAX_CONTROL_BYTES))
        while True:
            request, control = ring[0]
            await request.wait()
            ring.popleft()
            try:
                msg = decode_control(control)
            except ValueError as e:
                log.warning("dropping a malformed KV control message: %s", e)
                msg = None
            post(control)  # safe: decode_control copied what it needed
            if msg is None:
                continue
            if isinstance(msg, FinishMarker):
                table.finish(msg)
            else:
                # Post every piece's receive now, before this loop takes the next control message, so
                # the pieces land while the next header is decoded; then hash them as they land.
                landing = table.open_chunk(msg)
                pieces = [(a, b) for a, b in piece_ranges(msg.nbytes, msg.piece_bytes) if b > a]
                # A UCX request does not keep its buffer alive: `buffers` does, until `_land` returns.
                buffers = [Array(landing.view[a:b]) for a, b in pieces]
                requests = [worker.tag_recv(buf, Tag(msg.payload_tag + i)) for i, buf in enumerate(buffers)]
                self._spawn(self._land(msg, landing, pieces, requests, buffers))

    async def _land(self, header: ChunkHeader, landing: Landing, pieces: list[tuple[int, int]],
                    requests: list, buffers: list) -> None:
        """Hash each piece as soon as it lands (while later pieces are still copied), then verify."""
        landed, digest = False, StreamingXxh3()
        try:
            for (a, b), request in zip(pieces, requests, strict=True):
                await _settled([request])
                if landing.inbound is not None:  # scratch landings are never read, so never hashed
                    await digest.update(landing.view[a:b])
            landed = True
        finally:
            await self._receiving().close_chunk(header, landing, landed_ok=landed,
                                                actual=digest.hexdigest() if landed else None)


async def _settled(requests: list) -> None:
    """Wait for UCX requests, then raise the first one's error (UCXError family). With ucxx's notifier
    thread (progress mode "thread") through their Python futures directly: 22 us per send+receive pair
    here, against 118 us through `request.wait()` coroutines gathered as tasks (issue 4). Awaited one
    by one, not gathered: a gather adds a future and a callback round through the loop per request."""
    if not requests:
        return
    if _context is not None and _context.worker.enable_python_future:
        for r in requests:
            await r.future
        for r in requests:
            r.check_error()
    else:
        for r in requests:
            await r.wait()
