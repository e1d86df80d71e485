"""KV cache transfer between prefill and decode workers (docs/architecture.md §6, data plane).

`make_transport("ucxx")` — UCX shared memory (or TCP via `UCX_TLS`), the production path;
`make_transport("tcp")` — plain asyncio TCP, the no-RDMA baseline. Both implement `KVTransport`.
"""

from __future__ import annotations

from pdserve.messages import KVTransportKind
from pdserve.transfer.base import (
    ChecksumMismatchError,
    Inbound,
    KVTransport,
    TransferCancelled,
    TransferError,
    TransferStats,
    TransferTimeout,
)


def make_transport(kind: KVTransportKind | str, host: str = "127.0.0.1") -> KVTransport:
    """A new, not yet started transport of `kind` ('ucxx' | 'tcp') that binds and publishes `host`, the
    address peers reach it at (`PDS_KV_HOST`: the host's interface address when peers are on other
    hosts). Raises ValueError for another kind."""
    if kind == KVTransportKind.UCXX:
        from pdserve.transfer.ucxx_transport import UcxxTransport

        return UcxxTransport(host)
    if kind == KVTransportKind.TCP:
        from pdserve.transfer.tcp_transport import TcpTransport

        return TcpTransport(host)
    raise ValueError(f"unknown KV transport {kind!r}: expected 'ucxx' or 'tcp'")


__all__ = [
    "ChecksumMismatchError",
    "Inbound",
    "KVTransport",
    "TransferCancelled",
    "TransferError",
    "TransferStats",
    "TransferTimeout",
    "make_transport",
]
