"""A decode step's decoder layers of a Llama in one C call (csrc/llama_decode.c): the same kernels, in the
same order, as the model's forward calls them one by one from Python, without the ~300 calls' Python cost
per step. engine/model.py takes it for a step whose every sequence has one new token, where its GEMMs take
the C kernel's path (engine/linear.py) and the C decode attention takes its heads."""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from pdserve.kernels import native
from pdserve.kernels.paged_attention import NATIVE_MAX_HEAD_DIM, NATIVE_MAX_HEADS, PagedAttentionMetadata


class _Layer(ctypes.Structure):  # csrc/llama_decode.c's llama_layer
    _fields_ = [(name, native.PTR)
                for name in ("input_norm", "post_norm", "qkv", "o", "gate_up", "down", "kv")]


class _Dims(ctypes.Structure):  # csrc/llama_decode.c's llama_dims
    _fields_ = [*((name, native.I64) for name in ("hidden", "intermediate", "num_heads", "num_kv_heads",
                                                   "head_dim", "block_size", "num_slots")),
                ("eps", native.F32), ("scale", native.F32)]


@functools.cache
def _kernels() -> tuple[Callable[..., int], Callable[..., int]] | None:
    """(llama_decode_layers, llama_decode_scratch_floats), built on the first call; None where the library
    cannot be built (kernels/native.py)."""
    i64, ptr = native.I64, native.PTR
    # layers, num_layers, dims, hidden, rows, cos, sin, slots, block_tables, table_stride, context_lens,
    # scratch, num_threads
    run = native.bind("llama_decode",
                      [ptr, i64, ptr, ptr, i64, ptr, ptr, ptr, ptr, i64, ptr, ptr, native.INT],
                      symbol="llama_decode_layers")
    scratch = native.bind("llama_decode", [ptr, i64], symbol="llama_decode_scratch_floats")
    if run is None or scratch is None:
        return None
    scratch.restype = ctypes.c_int64
    return run, scratch


@dataclass(frozen=True)
class LayerWeights:
    """One decoder layer's weights as the C kernels read them: the two RMSNorm weights [hidden] and the four
    projections' packed panels (`skinny_linear.pack` of the [out, in] weights: Q, K, V fused; O; gate and up
    as `skinny_linear.pack_gated`'s, SwiGLU in the GEMM's epilogue; down), all fp32 on the CPU."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: torch.Tensor
    o: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor


class DecodeLayers:
    """The decoder layers of one model, run for a pure decode step by one C call (`run`).

    `layers` keeps its tensors alive (the C side holds their addresses); the KV pools are bound on the first
    `run` of each pool list. Build with `for_model` (None where the library is missing or the model's heads
    are past the C attention's limits).
    """

    def __init__(self, layers: Sequence[LayerWeights], hidden_size: int, intermediate_size: int,
                 num_heads: int, num_kv_heads: int, head_dim: int, eps: float) -> None:
        self.layers = list(layers)
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.num_heads, self.num_kv_heads, self.head_dim, self.eps = num_heads, num_kv_heads, head_dim, eps
        self._bound: tuple[list[int], ctypes.Array[_Layer], _Dims] | None = None

    @classmethod
    def for_model(cls, layers: Sequence[LayerWeights], hidden_size: int, intermediate_size: int,
                  num_heads: int, num_kv_heads: int, head_dim: int, eps: float) -> DecodeLayers | None:
        """`DecodeLayers` where the C library builds and takes these heads (head_dim a multiple of 16 up to
        256, at most 128 query heads, as csrc/paged_decode_attention.c) and every tensor is fp32 on the
        CPU; else None."""
        heads_taken = head_dim % 16 == 0 and head_dim <= NATIVE_MAX_HEAD_DIM and num_heads <= NATIVE_MAX_HEADS
        if (_kernels() is None or not heads_taken
                or not all(native.cpu_fp32(*vars(w).values()) for w in layers)):
            return None
        return cls(layers, hidden_size, intermediate_size, num_heads, num_kv_heads, head_dim, eps)

    def _bind(self, kv_cache: Sequence[torch.Tensor]) -> tuple[ctypes.Array[_Layer], _Dims]:
        pointers = [pool.data_ptr() for pool in kv_cache]
        if self._bound is None or self._bound[0] != pointers:
            pools = kv_cache[0].shape
            table = (_Layer * len(self.layers))(*(
                _Layer(*(t.data_ptr() for t in vars(w).values()), kv)
                for w, kv in zip(self.layers, pointers, strict=True)))
            dims = _Dims(self.hidden_size, self.intermediate_size, self.num_heads, self.num_kv_heads,
                         self.head_dim, pools[1], pools[0] * pools[1], self.eps, self.head_dim**-0.5)
            self._bound = (pointers, table, dims)
        return self._bound[1], self._bound[2]

    def run(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor,
            meta: PagedAttentionMetadata, kv_cache: Sequence[torch.Tensor]) -> None:
        """Every layer over `hidden` ([rows, hidden_size] fp32, contiguous; updated in place), one new
        token per row: `cos`, `sin` [rows, head_dim] at the tokens' positions (contiguous), `slots`
        [rows] int64 where each token's K and V go, `meta` a pure decode step's attention metadata
        (`attention_metadata` with every query length 1), `kv_cache` one contiguous pool per layer
        [num_blocks, block_size, 2, num_kv_heads, head_dim] fp32. On `torch.get_num_threads()` threads.
        Raises IndexError (nothing written) for a slot outside the pools, MemoryError or ValueError as
        the C decode attention does (-1, -2)."""
        run, scratch_floats = _kernels()  # type: ignore[misc]
        table, dims = self._bind(kv_cache)
        rows = hidden.shape[0]
        scratch = torch.empty(scratch_floats(ctypes.byref(dims), rows), dtype=torch.float32)
        status = run(table, len(self.layers), ctypes.byref(dims), hidden.data_ptr(), rows, cos.data_ptr(),
                     sin.data_ptr(), slots.data_ptr(), meta.decode_blocks.data_ptr(),
                     meta.decode_blocks.numel() // rows, meta.decode_lens.data_ptr(), scratch.data_ptr(),
                     torch.get_num_threads())
        if status == -3:
            raise IndexError(f"a slot of {slots.tolist()} is outside the pool's {dims.num_slots}")
        if status == -2:
            raise ValueError(f"llama_decode: {self.num_heads} heads of {self.head_dim} past the C "
                             "attention's limits")
        if status:
            raise MemoryError("llama_decode: the attention's scratch could not be allocated")
