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
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path

import numpy as np
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.transfer_peers import (  # noqa: E402
    MIB,
    MIN_TRANSFER_BYTES,
    ROW_BYTES,
    TransportConfig,
    run_receiver,
    run_sender,
    transfers_for,
)
from benchmarks.transfer_report import (  # noqa: E402
    BARE_LAYERED,
    BARE_UCXX,
    CMA_METHOD,
    LAYERED_UCXX,
    Row,
    combine_rounds,
    write_reports,
)

# Layers per transfer (--layers): a transfer is one chunk per layer, all in flight at once, as a prefill
# worker sends it. 32 divides every size into whole 4 KiB rows (SmolLM2-135M has 30 layers, Llama-3-8B 32).
LAYERS = 32

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


# ------------------------------------------------------------------ orchestration


def measure_transport(cfg: TransportConfig, sizes: list[int], reps: int, layers: int,
                      bar: tqdm) -> list[Row]:
    ctx = mp.get_context("spawn")
    parent_end, receiver_parent = ctx.Pipe()
    receiver_peer, sender_peer = ctx.Pipe()
    layers = cfg.layers or layers
    procs = [ctx.Process(target=run_receiver,
                         args=(cfg, sizes, reps, layers, receiver_parent, receiver_peer)),
             ctx.Process(target=run_sender, args=(cfg, sender_peer, layers))]
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
