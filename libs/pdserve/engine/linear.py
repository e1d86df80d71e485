"""Dense layers `y = x @ weight.T` in fp32: each row count on the GEMM this machine runs fastest.

torch's default CPU GEMM is MKL's, and MKL runs a generic code path on AMD EPYC: measured there (torch 2.13,
one thread, SmolLM2's layer shapes; `benchmarks/engine.py` prints both GEMM rates each run), `F.linear`
reaches ~90-100 GFLOP/s at 32 or more rows, while oneDNN with the weight reordered into its own blocked
layout (`mkldnn._reorder_linear_weight`, what Inductor's CPU freezing pass does) reaches 170-240 GFLOP/s
on the same shapes and results equal to fp32 rounding (max |difference| ~1e-6 relative). One prepacked
weight serves every row count: the batch-size hint (32) only picks oneDNN's blocking.

A decode step's GEMMs have as many rows as sequences and are bound by reading the weights, and there the
best path depends on the CPU: on an Intel Xeon host (two threads, SmolLM2's 30 layers, weights read from
memory) MKL's `F.linear` streams them at 25 GB/s for one row (oneDNN 19) but 11 GB/s for eight (oneDNN 16).
The C kernel kernels/csrc/skinny_linear.c reads a packed copy of each weight as one stream, keeps whole
outputs in its accumulators and prefetches the next panel of the weight while it computes on one: on an
AMD EPYC host (AVX-512, two threads, SmolLM2's weights) 28-32 GB/s for 1-8 rows where oneDNN read 22-25;
on an Intel Xeon host (AVX-512) a pass over SmolLM2's 30 layers' GEMMs, weights from memory, took 25 /
27 / 89 ms for 8 / 16 / 128 rows on two threads where oneDNN took 30 / 35 / 105 (the kernel's header has
the figures). So `calibrate_paths` times the three over the model's own first layers' GEMMs for each row
count of `CALIBRATED_ROWS` when the model is built and keeps the fastest; a call takes the path of the
largest calibrated count at or under its rows, and oneDNN from twice the last on. The plain weight is
kept for MKL and the kernel's copy beside oneDNN's (the layer's weights three times in memory: +1.08 GB
for SmolLM2 fp32).
Where oneDNN is absent (or for a CUDA tensor) the layer is plain `F.linear`.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from pdserve.kernels import skinny_linear as skinny
from pdserve.kernels.activation import silu_and_mul

log = logging.getLogger(__name__)

_BATCH_HINT = 32  # rows oneDNN blocks for; measured equal or better than 1 and 512 at every row count here
# F.linear on the plain weight; the C kernel on its packed copy; oneDNN on its prepacked copy
MKL, SKINNY, ONEDNN = "mkl", "skinny", "onednn"
# The row counts `calibrate_paths` times: every decode batch up to 8, then powers of 2 to a short prefill's.
CALIBRATED_ROWS = (1, 2, 3, 4, 5, 6, 7, 8, 16, 32, 64, 128, 256)
# The path of each calibrated row count (a call takes its bucket's, `path_of`); `calibrate_paths` sets it.
_PATHS: dict[int, str] = {1: MKL, 2: MKL}


def path_of(rows: int) -> str:
    """The path `_PATHS` gives a call of `rows` rows: its bucket's, the largest calibrated count at or
    under `rows`; oneDNN for rows not under any, or from twice the last calibrated count on (the kernel
    re-reads x for every panel, from L3 once x outgrows L2: 1.2 MB at 512 of SmolLM2's rows, where oneDNN
    measured faster in the engine's prefill)."""
    keys = sorted(_PATHS)
    i = bisect.bisect_right(keys, rows) - 1
    return ONEDNN if i < 0 or rows >= 2 * keys[-1] else _PATHS[keys[i]]


def _onednn_usable(weight: torch.Tensor) -> bool:
    cpu_fp32 = weight.device.type == "cpu" and weight.dtype == torch.float32
    return cpu_fp32 and torch.backends.mkldnn.is_available()


class Linear:
    """`weight`: [out_features, in_features] fp32 (HF layout, no bias). Calls take `x`: [rows, in_features]
    and return [rows, out_features] in x's dtype; `x` may be a strided view. Each row count takes the path
    `path_of` gives; the C kernel, where a row of x is not contiguous, falls back to oneDNN.
    """

    def __init__(self, weight: torch.Tensor) -> None:
        self.out_features, self.in_features = weight.shape
        self.weight = weight.contiguous()
        self._packed = (torch.ops.mkldnn._reorder_linear_weight(self.weight, _BATCH_HINT)
                        if _onednn_usable(weight) else None)
        # the C kernel's copy, only beside oneDNN's (without oneDNN every call is F.linear's)
        packable = self._packed is not None and skinny.takes_weight(self.weight)
        self._panels = self._pack() if packable else None

    def _pack(self) -> torch.Tensor:
        return skinny.pack(self.weight)

    @property
    def panels(self) -> torch.Tensor | None:
        """The C kernel's packed copy of the weight (`skinny_linear.pack`; a `GatedLinear`'s `pack_gated`),
        None where it has none."""
        return self._panels

    def _path(self, x: torch.Tensor) -> str:
        if self._packed is None:
            return MKL
        path = path_of(x.shape[0])
        return ONEDNN if path == SKINNY and not (self._panels is not None and skinny.takes_rows(x)) else path

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.run(self._path(x), x)

    def run(self, path: str, x: torch.Tensor) -> torch.Tensor:
        """`x @ weight.T` on `path` (one this layer has: `calibrate_paths` times them)."""
        if path == ONEDNN:
            return torch.ops.mkldnn._linear_pointwise(x, self._packed, None, "none", [], "")
        if path == SKINNY:
            return skinny.skinny_linear(x, self._panels, self.out_features)
        return F.linear(x, self.weight)

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """`residual + x @ weight.T` (a new tensor), the sum fused into the GEMM's output on oneDNN and in
        the C kernel."""
        path = self._path(x)
        if path == ONEDNN:
            return torch.ops.mkldnn._linear_pointwise.binary(x, residual, self._packed, None, "add")
        if path == SKINNY:
            return skinny.skinny_linear(x, self._panels, self.out_features, residual)
        return torch.add(residual, F.linear(x, self.weight))


class GatedLinear(Linear):
    """SwiGLU's gate and up projections (Shazeer 2020, https://arxiv.org/abs/2002.05202) as one layer:
    `weight` [2 d, in_features] fp32, gate's d rows then up's; a call takes `x` [rows, in_features] and
    returns `silu(x @ gate.T) * (x @ up.T)`, [rows, d] (`out_features` = d). On the C kernel the
    activation is the GEMM's epilogue (`skinny_linear.skinny_gated_linear`, its packed copy
    `pack_gated`'s), on the other paths the GEMM's [rows, 2 d] output goes through `silu_and_mul`: `run`
    gives the same on every path, so `calibrate_paths` times each with its activation."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__(weight)
        self.out_features = weight.shape[0] // 2

    def _pack(self) -> torch.Tensor:
        return skinny.pack_gated(self.weight)

    def run(self, path: str, x: torch.Tensor) -> torch.Tensor:
        if path == SKINNY:
            return skinny.skinny_gated_linear(x, self._panels, self.out_features)
        return silu_and_mul(super().run(path, x))

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        raise TypeError("a gated layer's output is an activation: nothing is added to it")


def fused(*weights: torch.Tensor) -> Linear:
    """One Linear whose output is the given layers' outputs side by side (their weights stacked on dim 0),
    e.g. q, k and v projections as one GEMM: `out[:, :q_out]` is q's, and so on."""
    return Linear(torch.cat(weights, dim=0))


def gated(gate: torch.Tensor, up: torch.Tensor) -> GatedLinear:
    """SwiGLU's gate [d, in] and up [d, in] projections as one `GatedLinear`: silu(x gate^T) * (x up^T)."""
    return GatedLinear(torch.cat((gate, up), dim=0))


def best_time_s(fn: Callable[[], object], reps: int) -> float:
    """The fastest of `reps` timed calls of `fn` after one untimed (warm-up) call, seconds."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def fastest(candidates: dict[str, Callable[[], object]], reps: int) -> str:
    """The name of the candidate whose best of `reps` timed calls is the least, after one untimed call of
    each; the calls taken in turn (each candidate once, then again), so a slow spell of a shared machine
    slows them all rather than one."""
    for fn in candidates.values():
        fn()
    best = dict.fromkeys(candidates, float("inf"))
    for _ in range(reps):
        for name, fn in candidates.items():
            t0 = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t0)
    return min(best, key=best.__getitem__)


def linears_of(obj: object) -> list[Linear]:
    """Every `Linear` reachable from `obj` (a model's layers) through attributes, tuples, lists and dicts,
    depth first in definition order, each once: a step's GEMMs in the order it runs them."""
    found: list[Linear] = []
    seen: set[int] = set()

    def walk(o: object) -> None:
        if id(o) in seen or isinstance(o, (torch.Tensor, str, bytes, int, float)):
            return
        seen.add(id(o))
        if isinstance(o, Linear):
            found.append(o)
        elif isinstance(o, (list, tuple)):
            for item in o:
                walk(item)
        elif isinstance(o, dict):
            for item in o.values():
                walk(item)
        elif hasattr(o, "__dict__"):
            for item in vars(o).values():
                walk(item)

    walk(obj)
    return found


def weights_from_memory(linears: Sequence[Linear], min_bytes: int = 64 << 20) -> list[Linear]:
    """The first of `linears` whose weights add up to `min_bytes` or more (all of them if they add up to
    less): more than a cache holds, so a pass over them reads the weights from memory, as a step does."""
    chosen, total = [], 0
    for layer in linears:
        if total >= min_bytes:
            break
        chosen.append(layer)
        total += layer.weight.numel() * layer.weight.element_size()
    return chosen


def calibrate_paths(linears: Sequence[Linear], reps: int = 5) -> dict[int, str]:
    """Set, for this process, the path (MKL, SKINNY or ONEDNN) of every Linear's calls of each row count
    of CALIBRATED_ROWS: each path timed over `linears` in turn, each on rows of its own in_features
    (`fastest`: best of `reps`, 3 past 8 rows, the paths in turn), the fastest kept. Give it the model's
    own GEMMs in a step's order, enough to be read from memory (`weights_from_memory`: SmolLM2's first 5
    layers, ~2 s in all on two threads); a lone big weight misleads (on an Intel Xeon host oneDNN led on
    the 113 MB LM head at 4-8 rows, the C kernel on the layers' GEMMs). Returns the table; without oneDNN
    (or without Linears), leaves it as it is."""
    global _PATHS
    if not linears or any(layer._packed is None for layer in linears):
        return dict(_PATHS)
    rivals = (MKL, ONEDNN, SKINNY) if all(layer._panels is not None for layer in linears) else (MKL, ONEDNN)
    paths: dict[int, str] = {}
    for m in CALIBRATED_ROWS:
        # a generator of its own: the process's torch RNG (sampling seeds) is left as it was
        g = torch.Generator().manual_seed(m)
        xs = {k: torch.randn(m, k, generator=g) for k in sorted({layer.in_features for layer in linears})}
        candidates: dict[str, Callable[[], object]] = {
            path: lambda path=path, xs=xs: [layer.run(path, xs[layer.in_features]) for layer in linears]
            for path in rivals
        }
        paths[m] = fastest(candidates, reps if m <= 8 else min(reps, 3))
    _PATHS = paths
    log.info("GEMM path by rows: %s; from %d rows: %s", paths, 2 * CALIBRATED_ROWS[-1], ONEDNN)
    return dict(paths)
