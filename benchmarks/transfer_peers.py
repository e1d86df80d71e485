"""The two peer processes of `benchmarks/transfer.py`: a receiver and a sender per transport configuration
(spawned by its `measure_transport`), for the transports and for bare ucxx. Helpers only: run
benchmarks/transfer.py.
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection

import numpy as np

MIB = 1 << 20
ROW_SHAPE = (2, 8, 64)  # K and V × 8 KV heads × head_dim 64, fp32: 4 KiB per token row
ROW_BYTES = 2 * 8 * 64 * 4
MIN_TRANSFER_BYTES = 64 * MIB


@dataclass(frozen=True)
class TransportConfig:
    """`kind`: a `make_transport` kind, or "bare-ucxx" (ucxx tagged messages, no transport). `layers`:
    chunks (bare: messages) per transfer when not `--layers`. `checksum` (bare only): xxh3-64 of every
    message on both sides, as the transport does. `memory` (bare only): "host", or "cuda" for buffers in
    GPU memory on both sides (benchmarks/device_check.py)."""

    name: str
    kind: str
    env: dict[str, str]
    layers: int | None = None
    checksum: bool = False
    memory: str = "host"


def transfers_for(size: int) -> int:
    """Transfers per repetition: at least `MIN_TRANSFER_BYTES` in all, so small sizes are not one sample."""
    return max(1, MIN_TRANSFER_BYTES // size)


def run_receiver(cfg: TransportConfig, sizes: list[int], reps: int, layers: int, parent: Connection,
                 peer: Connection) -> None:
    os.environ.update(cfg.env)
    main = _bare_receive_all if cfg.kind == "bare-ucxx" else _receive_all
    asyncio.run(main(cfg, sizes, reps, layers, parent, peer))


async def _receive_all(cfg: TransportConfig, sizes: list[int], reps: int, layers: int, parent: Connection,
                       peer: Connection) -> None:
    import torch

    from pdserve.transfer import make_transport

    transport = make_transport(cfg.kind)
    await transport.start()
    peer.send(transport.endpoint())
    try:
        for size in sizes:
            bufs = [torch.zeros(size // layers // ROW_BYTES, *ROW_SHAPE) for _ in range(layers)]
            for rep in range(reps + 1):  # rep 0 warms up endpoints and page-faults the buffers
                nbytes, seconds = 0, 0.0
                for k in range(transfers_for(size)):
                    tid = f"bench-{size}-{rep}-{k}"
                    t_expect = time.perf_counter()
                    inbound = transport.expect(tid, bufs)
                    peer.send((tid, size))
                    stats = await inbound.wait(120)
                    t_first_send = await asyncio.to_thread(peer.recv)
                    # CLOCK_MONOTONIC is system-wide: the sender's clock reading is comparable to ours.
                    nbytes += stats.kv_bytes
                    seconds += t_expect + stats.seconds - t_first_send
                if rep:
                    parent.send((size, nbytes / seconds / 1e9))
        peer.send(None)
    finally:
        await transport.stop()


def run_sender(cfg: TransportConfig, peer: Connection, layers: int) -> None:
    os.environ.update(cfg.env)
    asyncio.run((_bare_send_all if cfg.kind == "bare-ucxx" else _send_all)(cfg, peer, layers))


async def _send_all(cfg: TransportConfig, peer: Connection, layers: int) -> None:
    import torch

    from pdserve.transfer import make_transport

    transport = make_transport(cfg.kind)
    await transport.start()
    endpoint = peer.recv()
    sources: dict[int, list[torch.Tensor]] = {}
    try:
        while (job := await asyncio.to_thread(peer.recv)) is not None:
            tid, size = job
            if size not in sources:  # one size at a time in memory
                sources = {size: [torch.rand(size // layers // ROW_BYTES, *ROW_SHAPE) for _ in range(layers)]}
            peer.send(await _send_transfer(transport, endpoint, tid, sources[size]))
    finally:
        await transport.stop()


async def _send_transfer(transport, endpoint, tid: str, layers: list) -> float:
    """Send one transfer as a prefill worker does (`workers/kv_transfer.OutboundKV`, layerwise): one chunk
    per layer, every send fired without waiting for the previous one, the end marker at once, then wait for
    all. Returns the `time.perf_counter()` just before the first send."""
    t0 = time.perf_counter()
    sends = [transport.send_layer(endpoint, tid, layer, 0, 0, data) for layer, data in enumerate(layers)]
    await asyncio.gather(*sends, transport.finish(endpoint, tid, len(layers), 1))
    return t0


def _bare_context():
    """ucxx as the transport configures it (progress thread, Python futures), without the transport."""
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    from ucxx._lib_async import ApplicationContext

    return ApplicationContext({"TLS": os.environ["UCX_TLS"]}, progress_mode="thread",
                              enable_python_future=True)


def _messages(buf: np.ndarray, n: int) -> list[np.ndarray]:
    """`buf` cut into `n` equal consecutive messages (a layer's KV each when `n` is the layer count)."""
    step = buf.nbytes // n
    return [buf[i * step : (i + 1) * step] for i in range(n)]


def _bare_buffer(cfg: TransportConfig, size: int, random: bool):
    """`size` bytes on the configured memory: a numpy array on the host, a torch uint8 tensor on CUDA
    (ucxx takes either: the CUDA array interface for the latter, sent by UCX's CUDA transports)."""
    if cfg.memory == "cuda":
        import torch

        if random:
            return torch.randint(0, 256, (size,), dtype=torch.uint8, device="cuda")
        return torch.zeros(size, dtype=torch.uint8, device="cuda")
    return np.random.default_rng(0).integers(0, 256, size, np.uint8) if random else np.zeros(size, np.uint8)


async def _bare_receive_all(cfg, sizes, reps, layers, parent, peer) -> None:
    """The bare-ucxx ceilings: each transfer is `layers` tagged messages of `size / layers` bytes into
    a preallocated buffer, every receive posted before the sender starts, no header; with `cfg.checksum`
    each message is hashed (xxh3-64) as it lands, in order, while later ones are still copied — the least
    any checksummed layer-wise protocol over ucxx tagged messages does. Timed like the transports
    (sender's first send → last message landed and hashed)."""
    import xxhash
    from ucxx._lib.arr import Array
    from ucxx.types import Tag

    ctx = _bare_context()
    peer.send(ctx.worker_address.tobytes())
    for size in sizes:
        messages = _messages(_bare_buffer(cfg, size, random=False), layers)
        arrays = [Array(m) for m in messages]
        for rep in range(reps + 1):
            nbytes, seconds = 0, 0.0
            for k in range(transfers_for(size)):
                requests = [ctx.worker.tag_recv(a, Tag(k * layers + i)) for i, a in enumerate(arrays)]
                peer.send((k, size))
                for message, request in zip(messages, requests, strict=True):
                    await request.future
                    request.check_error()
                    if cfg.checksum:
                        xxhash.xxh3_64_intdigest(message)
                t_landed = time.perf_counter()
                nbytes, seconds = nbytes + size, seconds + t_landed - await asyncio.to_thread(peer.recv)
            if rep:
                parent.send((size, nbytes / seconds / 1e9))
    peer.send(None)
    ctx.stop_notifier_thread()


async def _bare_send_all(cfg, peer, layers) -> None:
    """Each message hashed first with `cfg.checksum` (the transport's sender does the same), then sent;
    all sends in flight at once."""
    import ucxx._lib.libucxx as ucx_api
    import xxhash
    from ucxx._lib.arr import Array
    from ucxx.types import Tag

    ctx = _bare_context()
    address = ucx_api.UCXAddress.create_from_buffer(peer.recv())
    ep = await ctx.create_endpoint_from_worker_address(address, endpoint_error_handling=False)
    sources: dict[int, list[np.ndarray]] = {}
    while (job := await asyncio.to_thread(peer.recv)) is not None:
        k, size = job
        if size not in sources:
            sources = {size: _messages(_bare_buffer(cfg, size, random=True), layers)}
        t0 = time.perf_counter()
        arrays, requests = [], []  # `arrays` keeps every buffer alive until its send completed
        for i, message in enumerate(sources[size]):
            if cfg.checksum:
                xxhash.xxh3_64_intdigest(message)
            arrays.append(Array(message))
            requests.append(ep._ep.tag_send(arrays[-1], Tag(k * layers + i)))
        await asyncio.gather(*(r.future for r in requests))
        for r in requests:
            r.check_error()
        peer.send(t0)
    ctx.stop_notifier_thread()
