"""pdserve's C kernels (kernels/csrc/*.c): compiled for this CPU on first use, cached, loaded with ctypes.

A kernel here is a plain C function over data pointers (no torch headers: a build takes ~1 s, not the ~1 min
of a torch C++ extension), compiled by the machine's C compiler (`CC`, default `cc`) with `-O3 -march=native`
and OpenMP. The object is compiled with `-ffast-math` (so reductions vectorize; e^x is csrc/vec16.h's `exp16`,
as GCC leaves `expf` in an unrolled loop as scalar calls) but linked without it: linked with it, GCC adds
crtfastmath.o, whose constructor would switch the whole process to flush-denormals-to-zero. The shared object
needs `libgomp.so.1`, which the dynamic loader resolves to the copy torch already loaded (same soname): the
kernel's threads are torch's OpenMP team, not a second one.

The cache is `$XDG_CACHE_HOME/pdserve/kernels` (default `~/.cache/pdserve/kernels`), one file per
(source, flags, compiler, CPU) hash, written under a temporary name and renamed: processes starting together
build it twice at worst, never load half a file. `load` returns None (and logs why, once) where there is
no compiler or the build fails, or where `PDS_NATIVE_KERNELS=0`; callers then run their torch path.
ctypes releases the GIL for the call, so a worker's event loop runs while a kernel computes.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch  # loaded before any kernel: the kernel's libgomp.so.1 resolves to torch's copy

log = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).resolve().parent / "csrc"
COMPILE_FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC")
LINK_FLAGS = ("-shared", "-fopenmp", "-lm")


def enabled() -> bool:
    """False when `PDS_NATIVE_KERNELS` is `0` (run every kernel's torch path, e.g. to compare them)."""
    return os.environ.get("PDS_NATIVE_KERNELS", "1") != "0"


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "pdserve" / "kernels"


def _cpu_identity() -> str:
    """The CPU's model and feature flags (what `-march=native` compiles for), from /proc/cpuinfo."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    keep = [line for line in lines if line.startswith(("model name", "flags"))]
    return "\n".join(dict.fromkeys(keep)) or platform.machine()


@functools.cache
def wide_vectors() -> bool:
    """Whether this CPU has AVX-512 (`avx512f` among /proc/cpuinfo's flags), the registers the kernels'
    16-float vectors (csrc/vec16.h) are written for: one zmm each. Without it GCC splits each into two
    ymm, and a kernel that keeps many vectors live (the prefill attention's 16 score accumulators) spills
    them to the stack: on an AVX2-only AMD EPYC (Zen 1, one thread, SmolLM2's heads) it ran causal
    attention over 512 / 2048 tokens at 2.2 GFLOP/s, torch's `scaled_dot_product_attention` at 12 / 21."""
    return "avx512f" in _cpu_identity().split()


# Libraries linked from several sources: the decode-step driver calls the kernels beside it.
LINKED = {"llama_decode": ("llama_decode", "rms_norm", "rope", "store_kv", "paged_decode_attention",
                           "skinny_linear")}


def _build(name: str, compiler: str) -> Path:
    """Compile kernels/csrc/<name>.c (with the other sources `LINKED` names for it) into the cache (if not
    already there); returns the shared object. Raises subprocess.CalledProcessError (with the compiler's
    output) when the build fails."""
    sources = [SOURCE_DIR / f"{source}.c" for source in LINKED.get(name, (name,))]
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    texts = [*(s.read_text() for s in sources), *(h.read_text() for h in sorted(SOURCE_DIR.glob("*.h")))]
    key = hashlib.sha256(
        "\0".join((*texts, *COMPILE_FLAGS, *LINK_FLAGS, version, _cpu_identity())).encode()
    ).hexdigest()[:16]
    target = cache_dir() / f"{name}-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        objs, lib = [Path(tmp) / f"{s.stem}.o" for s in sources], Path(tmp) / f"{name}.so"
        for source, obj in zip(sources, objs, strict=True):
            subprocess.run([compiler, *COMPILE_FLAGS, "-c", str(source), "-o", str(obj)],
                           capture_output=True, text=True, check=True)
        subprocess.run([compiler, *map(str, objs), "-o", str(lib), *LINK_FLAGS],
                       capture_output=True, text=True, check=True)
        os.replace(lib, target)
    log.info("built the %s kernel: %s", name, target)
    return target


@functools.cache
def load(name: str) -> ctypes.CDLL | None:
    """The compiled kernel library kernels/csrc/<name>.c for this CPU (built on first use), or None where
    native kernels are off, there is no C compiler, or the build fails (logged once per name)."""
    if not enabled():
        return None
    requested = os.environ.get("CC", "cc")
    compiler = shutil.which(requested)
    if compiler is None:
        log.warning("no C compiler (CC=%s): the %s kernel runs its torch path", requested, name)
        return None
    try:
        return ctypes.CDLL(str(_build(name, compiler)))
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        log.warning("the %s kernel did not build (%s): its torch path runs", name, detail)
        return None


# ctypes argument types of the kernels' C signatures: a data pointer, an int64_t, a float, an int
PTR, I64, F32, INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int


def cpu_fp32(*tensors: torch.Tensor) -> bool:
    """Whether every tensor is fp32 on the CPU (what the C kernels take)."""
    return all(t.dtype == torch.float32 and t.device.type == "cpu" for t in tensors)


def bind(name: str, argtypes: list, symbol: str | None = None) -> Callable[..., int] | None:
    """csrc/<name>.c's function `symbol` (default `name`), returning int, with `argtypes` as its C
    parameters, from `load` (built on the first call); None where it cannot be built."""
    lib = load(name)
    if lib is None:
        return None
    kernel = getattr(lib, symbol or name)
    kernel.argtypes, kernel.restype = argtypes, ctypes.c_int
    return kernel
