"""KV transfer throughput between two OS processes, per transport, beside memcpy measured in the same run.

    python benchmarks/transfer.py [--sizes-mib 1 16 256] [--reps 3] [--rounds 3] [--layers 32]
                                  [--out docs/benchmarks]

For each transport a receiver process and a sender process are spawned (UCX is configured once per
process, so each UCX configuration gets its own pair). A transfer of `size` bytes goes through the public
`KVTransport` API the way a prefill worker sends KV (`workers/kv_transfer.OutboundKV`, layer-wise): the
receiver `expect()`s `--layers` fp32 layer buffers `[rows, 2, 8, 64]` (4 KiB per token row, `size /
layers` bytes each), the sender fires one `send_layer()` per layer without waiting for the previous one
and the end marker at once, then awaits them all. Time = the sender's clock just before its first send →
the receiver's last chunk verified (`expect()` time + `TransferStats.seconds`; both processes read the
same system-wide monotonic clock), so it includes the xxh3-64 checksum on both sides but not the pipe hop
that starts the sender. Each repetition is `transfers_for(size)` transfers (at least 64 MiB in all).

Rows beside the transports, in the same run: numpy memcpy (`np.copyto`) and xxh3-64 of a buffer of the
same size, in this process; `process_vm_readv` (the copy UCX shared memory does) between two processes;
bare ucxx (one tagged message of `size` bytes, same progress mode, no header, no checksum); and ucxx with
the whole transfer as one chunk. Writes transfer.json, transfer.md and transfer.png under `--out`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from pathlib import Path

import numpy as np
from tqdm import tqdm

MIB = 1 << 20
ROW_SHAPE = (2, 8, 64)  # K and V × 8 KV heads × head_dim 64, fp32: 4 KiB per token row
ROW_BYTES = 2 * 8 * 64 * 4
MIN_TRANSFER_BYTES = 64 * MIB
# Layers per transfer (--layers): a transfer is one chunk per layer, all in flight at once, as a prefill
# worker sends it. 32 divides every size into whole 4 KiB rows (SmolLM2-135M has 30 layers, Llama-3-8B 32).
LAYERS = 32
CMA_METHOD = "kernel cross-process copy (process_vm_readv)"


@dataclass(frozen=True)
class TransportConfig:
    """`kind`: a `make_transport` kind, or "bare-ucxx" (ucxx tagged messages, no transport). `layers`:
    chunks (bare: messages) per transfer when not `--layers`. `checksum` (bare only): xxh3-64 of every
    message on both sides, as the transport does."""

    name: str
    kind: str
    env: dict[str, str]
    layers: int | None = None
    checksum: bool = False


BARE_UCXX = "bare ucxx shared memory (one message, no checksum)"
BARE_LAYERED = "bare ucxx shared memory, a message per layer, xxh3 both sides"
LAYERED_UCXX = "ucxx shared memory"
CONFIGS = [
    TransportConfig(BARE_UCXX, "bare-ucxx", {"UCX_TLS": "sm,self"}, layers=1),
    TransportConfig(BARE_LAYERED, "bare-ucxx", {"UCX_TLS": "sm,self"}, checksum=True),
    TransportConfig(LAYERED_UCXX, "ucxx", {"UCX_TLS": "sm,self"}),
    TransportConfig("ucxx shared memory, one chunk", "ucxx", {"UCX_TLS": "sm,self"}, layers=1),
    # docs/architecture.md §10: 512 KiB TCP segments and blocking progress are what make UCX-over-TCP reach
    # ~2 GB/s here.
    TransportConfig("ucxx TCP", "ucxx", {"UCX_TLS": "tcp,self", "UCX_TCP_RX_SEG_SIZE": "512k",
                                         "UCX_TCP_TX_SEG_SIZE": "512k"}),
    TransportConfig("asyncio TCP", "tcp", {}),
]


@dataclass(frozen=True)
class Row:
    """One (method, size) result: throughput in GB/s (10^9 bytes/s) over `reps` repetitions."""

    method: str
    size_mib: int
    transfers_per_rep: int
    gbps_median: float
    gbps_best: float
    reps: int
    x_memcpy: float | None = None  # median over rounds of the within-round ratios (see `combine_rounds`)
    x_cma: float | None = None
    x_bare: float | None = None
    x_ceiling: float | None = None  # the transport's layer-wise row against `BARE_LAYERED`


# ------------------------------------------------------------------ the two peer processes


def transfers_for(size: int) -> int:
    """Transfers per repetition: at least `MIN_TRANSFER_BYTES` in all, so small sizes are not one sample."""
    return max(1, MIN_TRANSFER_BYTES // size)


def _receiver(cfg: TransportConfig, sizes: list[int], reps: int, layers: int, parent: Connection,
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


def _sender(cfg: TransportConfig, peer: Connection, layers: int) -> None:
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
        messages = _messages(np.zeros(size, np.uint8), layers)
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
            sources = {size: _messages(np.random.default_rng(0).integers(0, 256, size, np.uint8), layers)}
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


# ------------------------------------------------------------------ orchestration


def measure_transport(cfg: TransportConfig, sizes: list[int], reps: int, layers: int,
                      bar: tqdm) -> list[Row]:
    ctx = mp.get_context("spawn")
    parent_end, receiver_parent = ctx.Pipe()
    receiver_peer, sender_peer = ctx.Pipe()
    layers = cfg.layers or layers
    procs = [ctx.Process(target=_receiver, args=(cfg, sizes, reps, layers, receiver_parent, receiver_peer)),
             ctx.Process(target=_sender, args=(cfg, sender_peer, layers))]
    for p in procs:
        p.start()
    results: dict[int, list[float]] = {s: [] for s in sizes}
    try:
        for _ in range(len(sizes) * reps):
            if not parent_end.poll(300):
                raise TimeoutError(f"{cfg.name}: no result in 300 s")
            size, gbps = parent_end.recv()
            results[size].append(gbps)
            bar.set_postfix_str(f"{cfg.name} {size // MIB} MiB {gbps:.2f} GB/s")
            bar.update()
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    return [Row(cfg.name, s // MIB, transfers_for(s), statistics.median(v), max(v), len(v))
            for s, v in results.items()]


def measure_local(name: str, op, sizes: list[int], reps: int, bar: tqdm) -> list[Row]:
    import xxhash  # noqa: F401  (imported here so the baseline shares the transports' dependency)

    rows = []
    for size in sizes:
        n = transfers_for(size)
        src, dst = np.random.default_rng(0).integers(0, 256, size, np.uint8), np.empty(size, np.uint8)
        op(src, dst)  # warm up: page-fault dst
        speeds = []
        for _ in range(reps):
            t0 = time.perf_counter()
            for _ in range(n):
                op(src, dst)
            speeds.append(n * size / (time.perf_counter() - t0) / 1e9)
            bar.update()
        rows.append(Row(name, size // MIB, n, statistics.median(speeds), max(speeds), reps))
    return rows


def _cma_source(size: int, conn: Connection) -> None:
    """Child process: hold a source buffer of `size` bytes and tell the parent where it is."""
    src = np.random.default_rng(0).integers(0, 256, size, np.uint8)
    conn.send((os.getpid(), src.ctypes.data))
    conn.recv()  # until the parent is done reading


def measure_cma(sizes: list[int], reps: int, bar: tqdm) -> list[Row]:
    """The kernel's cross-process copy, `process_vm_readv` (Linux CMA), from another process's memory
    into this one's: the copy UCX shared memory does for every rendezvous message here (UCX_PROTO_INFO
    shows "rendezvous zero-copy read from remote, cma/memory" from 8 KiB up) — its ceiling, with no
    checksum and no protocol."""
    import ctypes

    libc = ctypes.CDLL("libc.so.6", use_errno=True)

    class IoVec(ctypes.Structure):
        _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]

    ctx = mp.get_context("spawn")
    rows = []
    for size in sizes:
        here, there = ctx.Pipe()
        proc = ctx.Process(target=_cma_source, args=(size, there))
        proc.start()
        pid, addr = here.recv()
        dst = np.zeros(size, np.uint8)
        local, remote = IoVec(dst.ctypes.data, size), IoVec(addr, size)
        n = transfers_for(size)
        speeds = []
        for rep in range(reps + 1):  # rep 0 warms up
            t0 = time.perf_counter()
            for _ in range(n):
                if libc.process_vm_readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0) != size:
                    raise OSError(ctypes.get_errno(), "process_vm_readv failed")
            if rep:
                speeds.append(n * size / (time.perf_counter() - t0) / 1e9)
                bar.update()
        here.send(None)
        proc.join(10)
        rows.append(Row(CMA_METHOD, size // MIB, n, statistics.median(speeds), max(speeds), reps))
    return rows


def _memcpy(src: np.ndarray, dst: np.ndarray) -> None:
    np.copyto(dst, src)


def _xxh3(src: np.ndarray, dst: np.ndarray) -> None:
    import xxhash

    xxhash.xxh3_64_hexdigest(src)


def combine_rounds(rounds: list[list[Row]]) -> list[Row]:
    """One Row per (method, size): median of the rounds' medians, best of all, and the median over rounds
    of each within-round ratio to memcpy (every row), to CMA (ucxx rows), to bare ucxx (transport ucxx
    rows) and to the checksummed bare ceiling (the transport's layer-wise shared-memory row)."""
    med = statistics.median
    out = []
    for first in rounds[0]:
        key = (first.method, first.size_mib)
        same = [next(r for r in rnd if (r.method, r.size_mib) == key) for rnd in rounds]
        base = [{r.method: r.gbps_median for r in rnd if r.size_mib == first.size_mib} for rnd in rounds]

        def ratio(to: str, rows=same, base=base) -> float | None:  # None when `to` was not measured
            if any(to not in b for b in base):
                return None
            return med(r.gbps_median / b[to] for r, b in zip(rows, base, strict=True))

        ucxx = first.method.startswith(("ucxx", "bare ucxx"))
        out.append(Row(first.method, first.size_mib, first.transfers_per_rep,
                       med(r.gbps_median for r in same), max(r.gbps_best for r in same),
                       sum(r.reps for r in same), ratio("numpy memcpy"),
                       ratio(CMA_METHOD) if ucxx else None,
                       ratio(BARE_UCXX) if first.method.startswith("ucxx shared") else None,
                       ratio(BARE_LAYERED) if first.method == LAYERED_UCXX else None))
    return out


# ------------------------------------------------------------------ reports


def write_reports(rows: list[Row], rounds: list[list[Row]], out: Path, meta: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    report = {"meta": meta, "rows": [asdict(r) for r in rows],
              "rounds": [[asdict(r) for r in rnd] for rnd in rounds]}
    (out / "transfer.json").write_text(json.dumps(report, indent=2))
    sizes = sorted({r.size_mib for r in rows})
    methods = list(dict.fromkeys(r.method for r in rows))
    by = {(r.method, r.size_mib): r for r in rows}
    lines = [
        "# KV transfer throughput between two processes",
        "",
        f"Generated by `{meta['command']}` on {meta['when']} ({meta['machine']}); load average (1 min)",
        f"{meta['load_before']:.2f} before, {meta['load_after']:.2f} after (this machine is shared: every",
        "figure is read against baselines measured in the same run).",
        "",
        f"GB/s = 10^9 bytes/s: median over {meta['rounds']} rounds (each round measures every row in",
        f"turn) of each round's median of {meta['reps']} repetitions; best single repetition in",
        "parentheses. × memcpy (and × CMA, × bare) = median over rounds of the ratio within the round,",
        "so load drift between rounds cancels. A transport transfer of N MiB is sent as a prefill worker",
        f"sends KV: {meta['layers']} layers, one chunk each, every `send_layer` fired without waiting for",
        "the previous one, the end marker at once (`workers/kv_transfer.OutboundKV`); the receiver lands",
        "each chunk in its preallocated fp32 KV buffer and verifies its xxh3-64 (one digest per (layer,",
        "chunk), hashed by the sender before sending, by the receiver as each ≤4 MiB piece lands).",
        "Time = sender's first send → receiver's last chunk verified. `ucxx shared memory, one chunk`",
        "sends the same bytes as a single chunk (one header, 4 MiB pieces). Earlier versions of this",
        "report timed one chunk at a time, each awaited before the next, which no serving path does.",
        "",
        f"`{CMA_METHOD}` is the copy UCX shared memory itself does for every message of 8 KiB or",
        "more on this machine (`UCX_PROTO_INFO=y`: \"rendezvous zero-copy read from remote, cma/memory\";",
        "no xpmem or knem here), measured bare in the same run; `bare ucxx` is one ucxx tagged message of",
        "the whole size (progress thread, no header, no checksum), timed like the transports. Both bound",
        "what the transport can reach; the ucxx rows give their ratio to each (× CMA, × bare).",
        f"`{BARE_LAYERED}` is the least any checksummed layer-wise",
        f"protocol over ucxx tagged messages does: {meta['layers']} messages, every receive posted before",
        "the sender starts (no header to wait for), the sender hashing each message just before sending",
        "it and the receiver hashing each as it lands, in order, while later ones are still copied; `×",
        "ceiling` is the transport's ratio to it: what its headers, Python and bookkeeping cost.",
        "",
        "| method | " + " | ".join(f"{s} MiB" for s in sizes) + " |",
        "|---|" + "---|" * len(sizes),
    ]
    for m in methods:
        cells = []
        for s in sizes:
            r = by[(m, s)]
            cell = f"{r.gbps_median:.2f} ({r.gbps_best:.2f}), ×{r.x_memcpy:.2f}"
            cell += f", ×{r.x_cma:.2f} CMA" if r.x_cma is not None else ""
            cell += f", ×{r.x_bare:.2f} bare" if r.x_bare is not None else ""
            cell += f", ×{r.x_ceiling:.2f} ceiling" if r.x_ceiling is not None else ""
            cells.append(cell)
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    (out / "transfer.md").write_text("\n".join(lines) + "\n")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    width = 0.8 / len(methods)
    for i, m in enumerate(methods):
        heights = [by[(m, s)].gbps_median for s in sizes]
        ax.bar([j + i * width for j in range(len(sizes))], heights, width, label=m)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(sizes))], [f"{s} MiB" for s in sizes])
    ax.set_ylabel("GB/s (median)")
    ax.set_title("KV transfer between two processes (checksummed) vs local baselines")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "transfer.png", dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-mib", type=int, nargs="+", default=[1, 16, 256])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3, help="every row measured in turn, this many times")
    ap.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    ap.add_argument("--layers", type=int, default=LAYERS)
    ap.add_argument("--transports", nargs="+", default=[c.name for c in CONFIGS],
                    help="which transport configurations to run (default: all)")
    args = ap.parse_args()
    sizes = [s * MIB for s in args.sizes_mib]
    configs = [c for c in CONFIGS if c.name in args.transports]
    total = (len(configs) + 3) * len(sizes) * args.reps
    rounds: list[list[Row]] = []
    load_before = os.getloadavg()[0]
    with tqdm(total=total * args.rounds, desc="transfer bench", unit="run") as bar:
        for _ in range(args.rounds):
            rows = measure_local("numpy memcpy", _memcpy, sizes, args.reps, bar)
            rows += measure_local("xxh3-64 hash (one side)", _xxh3, sizes, args.reps, bar)
            rows += measure_cma(sizes, args.reps, bar)
            for cfg in configs:
                rows += measure_transport(cfg, sizes, args.reps, args.layers, bar)
            rounds.append(rows)
    rows = combine_rounds(rounds)
    machine = f"{platform.machine()}, {mp.cpu_count()} cores"
    meta = {"when": time.strftime("%Y-%m-%d %H:%M"), "machine": machine,
            "load_before": load_before, "load_after": os.getloadavg()[0],
            "reps": args.reps, "row_bytes": ROW_BYTES, "min_transfer_bytes": MIN_TRANSFER_BYTES,
            "layers": args.layers, "rounds": args.rounds,
            "command": "python benchmarks/transfer.py " + " ".join(sys.argv[1:])}
    write_reports(rows, rounds, args.out, meta)
    print((args.out / "transfer.md").read_text())


if __name__ == "__main__":
    main()
