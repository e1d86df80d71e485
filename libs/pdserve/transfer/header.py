"""The control messages of the KV data plane: one `ChunkHeader` before each payload, one `FinishMarker`
after a transfer's last chunk (docs/architecture.md §6, data plane).

On the wire a control message is a 4-byte little-endian length and the message's JSON (pydantic v2),
at most `MAX_CONTROL_BYTES` in all, so a receiver can post one fixed buffer for it.
"""

from __future__ import annotations

import struct
from typing import Annotated, Literal

from pydantic import Field, TypeAdapter

from pdserve.messages import Message

MAX_CONTROL_BYTES = 4096
_LEN = struct.Struct("<I")


class ChunkHeader(Message):
    """Describes the payload that follows: `nbytes` bytes of rows `token_start:token_start+shape[0]` of
    layer `layer`'s KV `[max_tokens, 2, num_kv_heads, head_dim]`, hashed by the sender to `checksum`
    (xxh3-64 hex of the whole chunk).

    Over UCX the payload travels as pieces of `piece_bytes` (the last one shorter) on tags `payload_tag`,
    `payload_tag + 1`, ..., each hashed by the receiver as soon as it lands (see `ucxx_transport`)."""

    kind: Literal["chunk"] = "chunk"
    transfer_id: str
    layer: int = Field(ge=0)
    chunk: int = Field(ge=0)
    token_start: int = Field(ge=0)
    nbytes: int = Field(ge=0)
    dtype: str
    shape: tuple[int, ...] = Field(min_length=1)
    checksum: str | None = None
    traceparent: str | None = None
    payload_tag: int = 0
    piece_bytes: int = Field(default=0, ge=0)


class FinishMarker(Message):
    """End of a transfer: the receiver completes it once all `num_layers * num_chunks` chunks verified."""

    kind: Literal["finish"] = "finish"
    transfer_id: str
    num_layers: int = Field(ge=1)
    num_chunks: int = Field(ge=1)


Control = Annotated[ChunkHeader | FinishMarker, Field(discriminator="kind")]
_control = TypeAdapter(Control)


def encode_control(msg: ChunkHeader | FinishMarker) -> bytes:
    """Length-prefixed JSON of `msg`. Raises ValueError if it exceeds `MAX_CONTROL_BYTES`."""
    body = msg.model_dump_json().encode()
    if _LEN.size + len(body) > MAX_CONTROL_BYTES:
        raise ValueError(f"control message of {len(body)} bytes exceeds {MAX_CONTROL_BYTES}")
    return _LEN.pack(len(body)) + body


def control_length(prefix: bytes | bytearray | memoryview) -> int:
    """The body length announced by a 4-byte prefix. Raises ValueError when it cannot be a control message."""
    (n,) = _LEN.unpack(prefix[: _LEN.size])
    if _LEN.size + n > MAX_CONTROL_BYTES:
        raise ValueError(f"control message announces {n} bytes, more than {MAX_CONTROL_BYTES}")
    return n


def decode_control(frame: bytes | bytearray | memoryview) -> ChunkHeader | FinishMarker:
    """Parse a whole length-prefixed frame (trailing bytes beyond the announced length are ignored).
    Raises ValueError (pydantic ValidationError) on a malformed message."""
    n = control_length(frame)
    return _control.validate_json(bytes(frame[_LEN.size : _LEN.size + n]))


PREFIX_BYTES = _LEN.size


def piece_ranges(nbytes: int, piece_bytes: int) -> list[tuple[int, int]]:
    """Byte ranges `[start, end)` cutting `nbytes` into pieces of `piece_bytes` (the last one shorter);
    one range (possibly empty) when `piece_bytes` is 0 or covers everything."""
    if piece_bytes <= 0 or nbytes <= piece_bytes:
        return [(0, nbytes)]
    return [(a, min(a + piece_bytes, nbytes)) for a in range(0, nbytes, piece_bytes)]
