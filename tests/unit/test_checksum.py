"""xxh3-64 over zero-copy KV byte views, and the control messages that carry the checksums."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
import xxhash

from pdserve.transfer.checksum import StreamingXxh3, byte_view, xxh3_hex, xxh3_hex_async
from pdserve.transfer.header import (
    MAX_CONTROL_BYTES,
    ChunkHeader,
    FinishMarker,
    decode_control,
    encode_control,
    piece_ranges,
)


def test_byte_view_shares_the_tensors_memory() -> None:
    t = torch.zeros(4, 2, 3, 8)
    view = byte_view(t)
    assert view.dtype == np.uint8 and view.nbytes == t.numel() * 4
    view[:4] = np.frombuffer(np.float32(1.5).tobytes(), np.uint8)
    assert t[0, 0, 0, 0].item() == 1.5


def test_byte_view_covers_bf16_which_numpy_cannot_represent() -> None:
    t = torch.ones(5, 2, 1, 4, dtype=torch.bfloat16)
    assert byte_view(t).nbytes == t.numel() * 2


def test_byte_view_of_a_row_slice_is_that_slices_bytes() -> None:
    t = torch.arange(64, dtype=torch.float32).reshape(8, 2, 1, 4)
    assert byte_view(t[3:5]).tobytes() == t[3:5].numpy().tobytes()


def test_byte_view_refuses_non_contiguous_tensors() -> None:
    with pytest.raises(ValueError, match="contiguous"):
        byte_view(torch.zeros(4, 2, 3, 8).transpose(0, 1))


def test_checksum_is_xxh3_64_of_the_raw_bytes() -> None:
    t = torch.randn(16, 2, 3, 8)
    assert xxh3_hex(byte_view(t)) == xxhash.xxh3_64_hexdigest(t.numpy().tobytes())
    assert len(xxh3_hex(byte_view(t))) == 16


def test_any_single_flipped_byte_changes_the_checksum() -> None:
    data = byte_view(torch.randn(32, 2, 2, 8))
    good = xxh3_hex(data)
    for i in range(0, data.nbytes, 97):
        bad = data.copy()
        bad[i] ^= 0x01
        assert xxh3_hex(bad) != good


def test_large_payloads_hash_the_same_off_the_event_loop() -> None:
    data = np.random.default_rng(0).integers(0, 256, 5 << 20, dtype=np.uint8)  # above the thread threshold
    assert asyncio.run(xxh3_hex_async(data)) == xxh3_hex(data)


def test_control_messages_round_trip_through_their_frame() -> None:
    header = ChunkHeader(transfer_id="t1", layer=3, chunk=1, token_start=64, nbytes=1536, dtype="float32",
                         shape=(8, 2, 3, 8), checksum="00ff00ff00ff00ff",
                         traceparent="00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
    marker = FinishMarker(transfer_id="t1", num_layers=30, num_chunks=2)
    for msg in (header, marker):
        frame = bytearray(encode_control(msg)) + b"\x00" * 100  # receivers parse a larger fixed buffer
        assert decode_control(frame) == msg


def test_oversized_control_message_is_refused_before_sending() -> None:
    with pytest.raises(ValueError, match="exceeds"):
        encode_control(FinishMarker(transfer_id="x" * MAX_CONTROL_BYTES, num_layers=1, num_chunks=1))


def test_garbled_length_prefix_is_rejected() -> None:
    with pytest.raises(ValueError):
        decode_control(b"\xff\xff\xff\xff{}")


def test_pieces_cover_the_payload_exactly_once_in_order() -> None:
    assert piece_ranges(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert piece_ranges(8, 4) == [(0, 4), (4, 8)]
    assert piece_ranges(3, 4) == [(0, 3)]
    assert piece_ranges(0, 4) == [(0, 0)]
    assert piece_ranges(10, 0) == [(0, 10)]


def test_a_chunk_hashed_piece_by_piece_has_the_one_shot_checksum() -> None:
    # The per-(layer, chunk) checksum must not depend on how ucxx cut the chunk into pieces.
    data = np.random.default_rng(1).integers(0, 256, (9 << 20) + 123, dtype=np.uint8)

    async def streamed(piece_bytes: int) -> str:
        digest = StreamingXxh3()
        for a, b in piece_ranges(data.nbytes, piece_bytes):
            await digest.update(data[a:b])
        return digest.hexdigest()

    for piece_bytes in (0, 1 << 20, 4 << 20, 5 << 20):
        assert asyncio.run(streamed(piece_bytes)) == xxh3_hex(data)
