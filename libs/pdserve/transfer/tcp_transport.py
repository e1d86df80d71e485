"""KV transfer over plain asyncio TCP: the no-RDMA baseline behind the same interface
(docs/architecture.md §6).

One connection per peer, reused; on it each chunk is a length-prefixed `ChunkHeader` then its payload
bytes, a transfer ends with a `FinishMarker`. The receiver reads payloads with `loop.sock_recv_into`
straight into the expected transfer's buffer view (`StreamReader.readexactly` into bytes measured
0.2 GB/s at 256 MiB here, `sock_recv_into` ~3 GB/s — docs/architecture.md §10).
"""

from __future__ import annotations

import asyncio
import logging
import socket

import numpy as np

from pdserve.messages import KVEndpoint, KVTransportKind
from pdserve.transfer.base import TransferError
from pdserve.transfer.chunked import ChunkedTransport
from pdserve.transfer.header import (
    MAX_CONTROL_BYTES,
    PREFIX_BYTES,
    ChunkHeader,
    FinishMarker,
    control_length,
    decode_control,
    encode_control,
)

log = logging.getLogger(__name__)

# Larger kernel socket buffers let a 256 MiB payload stream without the sender stalling on every window.
_SOCKET_BUFFER_BYTES = 4 << 20


class _PeerConnection:
    """A connected socket to one receiver; the lock keeps one chunk's header and payload together."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.lock = asyncio.Lock()


class TcpTransport(ChunkedTransport):
    """`KVTransport` over asyncio TCP sockets. The endpoint address is `host:port` of the listening socket
    (port 0 is bound and the real port published: a port left in TIME_WAIT cannot be rebound)."""

    kind = KVTransportKind.TCP

    def __init__(self, host: str = "127.0.0.1") -> None:
        super().__init__()
        self.host = host
        self._listener: socket.socket | None = None
        self._address: str | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._accepted: set[socket.socket] = set()
        self._peers: dict[str, _PeerConnection] = {}
        self._connecting: dict[str, asyncio.Lock] = {}

    async def start(self) -> None:
        self._bind()
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((self.host, 0))
        listener.listen(64)
        listener.setblocking(False)
        self._listener = listener
        self._address = f"{self.host}:{listener.getsockname()[1]}"
        self._spawn(self._accept_loop(listener))

    def endpoint(self) -> KVEndpoint:
        if self._address is None:
            raise RuntimeError("TcpTransport is not started")
        return KVEndpoint(transport=KVTransportKind.TCP, address=self._address)

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for sock in [*self._accepted, *(p.sock for p in self._peers.values())]:
            sock.close()
        self._accepted.clear()
        self._peers.clear()
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        self._address = None

    # -- sending

    async def _send_chunk(self, endpoint: KVEndpoint, header: ChunkHeader, payload: np.ndarray) -> None:
        await self._send(endpoint, encode_control(header), payload)

    async def _send_control(self, endpoint: KVEndpoint, msg: FinishMarker) -> None:
        await self._send(endpoint, encode_control(msg), None)

    async def _send(self, endpoint: KVEndpoint, frame: bytes, payload: np.ndarray | None) -> None:
        loop = self._owner_loop()
        peer = await self._peer(endpoint.address)
        try:
            async with peer.lock:
                await loop.sock_sendall(peer.sock, frame)
                if payload is not None and payload.nbytes:
                    await loop.sock_sendall(peer.sock, payload)
        except OSError as e:
            # The stream may be cut mid-chunk: drop it so the next send reconnects from a clean frame.
            self._drop_peer(endpoint.address, peer)
            raise TransferError(f"send to {endpoint.address} failed: {e}") from e

    async def _peer(self, address: str) -> _PeerConnection:
        if (peer := self._peers.get(address)) is not None:
            return peer
        async with self._connecting.setdefault(address, asyncio.Lock()):
            if (peer := self._peers.get(address)) is not None:
                return peer
            host, _, port = address.rpartition(":")
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setblocking(False)
            _tune(sock)
            try:
                await self._owner_loop().sock_connect(sock, (host, int(port)))
            except OSError as e:
                sock.close()
                raise TransferError(f"cannot connect to KV endpoint {address}: {e}") from e
            peer = self._peers[address] = _PeerConnection(sock)
            return peer

    def _drop_peer(self, address: str, peer: _PeerConnection) -> None:
        if self._peers.get(address) is peer:
            del self._peers[address]
        peer.sock.close()

    # -- receiving

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _accept_loop(self, listener: socket.socket) -> None:
        loop = self._owner_loop()
        while True:
            sock, _ = await loop.sock_accept(listener)
            sock.setblocking(False)
            _tune(sock)
            self._accepted.add(sock)
            self._spawn(self._read_loop(sock))

    async def _read_loop(self, sock: socket.socket) -> None:
        """Read frames from one sender until it closes the connection."""
        table = self._receiving()
        control = bytearray(MAX_CONTROL_BYTES)
        view = memoryview(control)
        try:
            while True:
                if not await self._recv_exactly(sock, view[:PREFIX_BYTES]):
                    return  # clean close between frames
                n = control_length(view)
                if not await self._recv_exactly(sock, view[PREFIX_BYTES : PREFIX_BYTES + n]):
                    raise ConnectionError("connection closed inside a control message")
                msg = decode_control(view)
                if isinstance(msg, FinishMarker):
                    table.finish(msg)
                    continue
                landing = table.open_chunk(msg)
                landed = False
                try:
                    landed = await self._recv_exactly(sock, memoryview(landing.view))
                finally:
                    await table.close_chunk(msg, landing, landed_ok=landed)
                if not landed:
                    raise ConnectionError("connection closed inside a payload")
        except (OSError, ValueError) as e:
            # A broken or garbled stream cannot be resynchronised: close it; the sender reconnects and the
            # transfer times out or is retried.
            log.warning("KV receive connection closed: %s", e)
        finally:
            self._accepted.discard(sock)
            sock.close()

    async def _recv_exactly(self, sock: socket.socket, buf: memoryview) -> bool:
        """Fill `buf` from `sock`; False when the peer closed before the first byte, ConnectionError when it
        closed part-way."""
        loop = self._owner_loop()
        got, total = 0, buf.nbytes
        while got < total:
            n = await loop.sock_recv_into(sock, buf[got:])
            if n == 0:
                if got == 0:
                    return False
                raise ConnectionError(f"connection closed after {got} of {total} bytes")
            got += n
        return True


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SOCKET_BUFFER_BYTES)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _SOCKET_BUFFER_BYTES)
