"""Reading a GGUF file's metadata and tensor table, and one tensor's raw bytes.

Format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md (v2/v3, little-endian). The `gguf`
package's `GGUFReader` parses the same thing but builds a numpy view per array element; on SmolLM2's
98k-entry vocabulary and merges that costs ~5 s here, which the gateway would pay at every start just to
get a tokenizer. This reader keeps scalars and string arrays as Python values (~0.1 s) and leaves tensor
bytes in a read-only memory map; dequantization stays with `gguf.quants.dequantize`.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from math import prod
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

_MAGIC = b"GGUF"
_SUPPORTED_VERSIONS = (2, 3)
_DEFAULT_ALIGNMENT = 32  # `general.alignment` when absent (gguf.md)

# Metadata value types (gguf.md, `gguf_metadata_value_type`): fixed-size ones as struct formats.
_STRING, _ARRAY = 8, 9
_SCALAR_FORMAT = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One tensor's entry in the table.

    `shape` is in torch order (ggml lists the fastest-moving dimension first, we reverse it);
    `offset` is in bytes from the start of the data section.
    """

    name: str
    shape: tuple[int, ...]
    qtype: GGMLQuantizationType
    offset: int

    @property
    def nbytes(self) -> int:
        block_size, type_size = GGML_QUANT_SIZES[self.qtype]
        return prod(self.shape) // block_size * type_size


@dataclass(frozen=True)
class GGUFFile:
    """A parsed GGUF: `metadata` (key -> int/float/bool/str/list), `tensors` by name, data section start."""

    path: Path
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensorInfo]
    data_start: int

    def raw(self, name: str) -> np.ndarray:
        """Tensor `name` as stored: uint8 `[*shape[:-1], row_bytes]` (what `gguf.quants.dequantize` takes).

        A read-only view of a fresh memory map; copy what must outlive the call's result.
        """
        info = self.tensors[name]
        with open(self.path, "rb") as f:
            blob = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        start = self.data_start + info.offset
        flat = np.frombuffer(blob, dtype=np.uint8, count=info.nbytes, offset=start)
        return flat.reshape(*info.shape[:-1], -1)


def read_gguf(path: Path, *, with_tensors: bool = True) -> GGUFFile:
    """Parse the header, metadata and (unless `with_tensors` is False) the tensor table of `path`.

    Raises ValueError for a file that is not GGUF v2/v3.
    """
    with open(path, "rb") as f:
        blob = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        if blob[:4] != _MAGIC:
            raise ValueError(f"{path} is not a GGUF file (magic {bytes(blob[:4])!r})")
        version, tensor_count, kv_count = struct.unpack_from("<IQQ", blob, 4)
        if version not in _SUPPORTED_VERSIONS:
            raise ValueError(f"{path}: GGUF version {version} is not supported ({_SUPPORTED_VERSIONS})")
        pos = 24
        metadata: dict[str, Any] = {}
        for _ in range(kv_count):
            key, pos = _read_string(blob, pos)
            (value_type,) = struct.unpack_from("<I", blob, pos)
            metadata[key], pos = _read_value(blob, pos + 4, value_type)
        tensors: dict[str, GGUFTensorInfo] = {}
        if with_tensors:
            for _ in range(tensor_count):
                name, pos = _read_string(blob, pos)
                (n_dims,) = struct.unpack_from("<I", blob, pos)
                dims = struct.unpack_from(f"<{n_dims}Q", blob, pos + 4)
                pos += 4 + 8 * n_dims
                qtype, offset = struct.unpack_from("<IQ", blob, pos)
                pos += 12
                shape = tuple(reversed(dims))
                tensors[name] = GGUFTensorInfo(name, shape, GGMLQuantizationType(qtype), offset)
        alignment = int(metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
        data_start = (pos + alignment - 1) // alignment * alignment
        return GGUFFile(Path(path), metadata, tensors, data_start)
    finally:
        blob.close()


def _read_string(blob: mmap.mmap, pos: int) -> tuple[str, int]:
    (length,) = struct.unpack_from("<Q", blob, pos)
    end = pos + 8 + length
    # Vocabularies hold byte fragments that are not valid UTF-8 on their own; keep them lossless.
    return blob[pos + 8 : end].decode("utf-8", errors="surrogateescape"), end


def _read_value(blob: mmap.mmap, pos: int, value_type: int) -> tuple[Any, int]:
    if value_type == _STRING:
        return _read_string(blob, pos)
    if value_type == _ARRAY:
        item_type, count = struct.unpack_from("<IQ", blob, pos)
        pos += 12
        if item_type in _SCALAR_FORMAT:
            fmt = _SCALAR_FORMAT[item_type]
            width = struct.calcsize(fmt)
            values = list(struct.unpack_from(f"<{count}{fmt[1]}", blob, pos))
            return values, pos + width * count
        items = []
        for _ in range(count):
            item, pos = _read_value(blob, pos, item_type)
            items.append(item)
        return items, pos
    fmt = _SCALAR_FORMAT[value_type]
    (value,) = struct.unpack_from(fmt, blob, pos)
    return value, pos + struct.calcsize(fmt)
