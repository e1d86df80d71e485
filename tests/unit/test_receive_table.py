"""The receiver's bookkeeping without a network: where each chunk lands, what counts as received."""

from __future__ import annotations

import asyncio

import pytest
import torch

from pdserve.transfer.base import ChecksumMismatchError, InboundState, TransferError
from pdserve.transfer.checksum import byte_view, xxh3_hex
from pdserve.transfer.header import ChunkHeader, FinishMarker
from pdserve.transfer.receiver import ReceiveTable


def header_for(tid: str, layer: int, chunk: int, token_start: int, data: torch.Tensor,
               checksum: str | None = None) -> ChunkHeader:
    return ChunkHeader(transfer_id=tid, layer=layer, chunk=chunk, token_start=token_start,
                       nbytes=data.numel() * data.element_size(),
                       dtype=str(data.dtype).removeprefix("torch."),
                       shape=tuple(data.shape), checksum=checksum or xxh3_hex(byte_view(data)))


async def land(table: ReceiveTable, header: ChunkHeader, data: torch.Tensor) -> bool:
    """Do what a transport does: copy the payload into the landing view, then close the chunk. Returns
    whether it landed in the transfer's buffers (not scratch)."""
    landing = table.open_chunk(header)
    landing.view[:] = byte_view(data)
    await table.close_chunk(header, landing)
    return landing.inbound is not None


async def test_chunk_lands_at_its_token_rows_and_completes_with_the_end_marker() -> None:
    table = ReceiveTable(asyncio.get_running_loop())
    dst = [torch.zeros(10, 2, 3, 4) for _ in range(2)]
    inbound = table.expect("t", dst)
    src = torch.randn(10, 2, 3, 4)
    for layer in range(2):
        for chunk, (a, b) in enumerate([(0, 6), (6, 10)]):
            assert await land(table, header_for("t", layer, chunk, a, src[a:b]), src[a:b])
    assert inbound.state is InboundState.RECEIVING  # everything verified, but no end marker yet
    table.finish(FinishMarker(transfer_id="t", num_layers=2, num_chunks=2))
    stats = await inbound.wait(1)
    assert stats.kv_bytes == 2 * src.numel() * 4
    assert all(torch.equal(d, src) for d in dst)


async def test_bad_checksum_fails_the_transfer_and_later_chunks_go_to_scratch() -> None:
    table = ReceiveTable(asyncio.get_running_loop())
    dst = [torch.zeros(4, 2, 1, 4) for _ in range(2)]
    inbound = table.expect("t", dst)
    src = torch.randn(4, 2, 1, 4)
    assert await land(table, header_for("t", 0, 0, 0, src, checksum="0" * 16), src)
    with pytest.raises(ChecksumMismatchError) as err:
        await inbound.wait(1)
    assert (err.value.layer, err.value.expected) == (0, "0" * 16)
    assert not inbound.chunks_done
    assert not await land(table, header_for("t", 1, 0, 0, src), src)
    assert not dst[1].any()


async def test_chunks_for_unknown_transfers_are_discarded() -> None:
    table = ReceiveTable(asyncio.get_running_loop())
    src = torch.randn(4, 2, 1, 4)
    assert not await land(table, header_for("nobody", 0, 0, 0, src), src)


async def test_chunk_of_another_dtype_or_shape_fails_the_transfer() -> None:
    table = ReceiveTable(asyncio.get_running_loop())
    inbound = table.expect("t", [torch.zeros(8, 2, 2, 4)])
    src = torch.randn(4, 2, 4, 2)  # same bytes per row, other head layout
    assert not await land(table, header_for("t", 0, 0, 0, src), src)
    with pytest.raises(TransferError, match="does not fit"):
        await inbound.wait(1)


async def test_buffers_must_be_contiguous_and_of_one_dtype() -> None:
    table = ReceiveTable(asyncio.get_running_loop())
    with pytest.raises(ValueError):
        table.expect("a", [torch.zeros(4, 2, 1, 4), torch.zeros(4, 2, 1, 4, dtype=torch.float16)])
    with pytest.raises(ValueError):
        table.expect("b", [torch.zeros(2, 4, 1, 4).transpose(0, 1)])


async def test_each_verified_chunk_is_announced_once_with_its_rows_and_a_bad_one_never() -> None:
    table = ReceiveTable(asyncio.get_running_loop())
    inbound = table.expect("t", [torch.zeros(10, 2, 1, 4) for _ in range(2)])
    seen: list[tuple[int, int, int]] = []
    inbound.on_chunk_verified = lambda layer, start, n: seen.append((layer, start, n))
    src = torch.randn(10, 2, 1, 4)
    assert await land(table, header_for("t", 0, 0, 0, src[:6]), src[:6])
    assert await land(table, header_for("t", 0, 0, 0, src[:6]), src[:6])  # a duplicate is not re-announced
    assert await land(table, header_for("t", 1, 1, 6, src[6:]), src[6:])
    assert seen == [(0, 0, 6), (1, 6, 4)]
    assert await land(table, header_for("t", 0, 1, 6, src[6:], checksum="0" * 16), src[6:])
    assert seen == [(0, 0, 6), (1, 6, 4)]


async def test_a_digest_computed_while_landing_is_trusted_as_given() -> None:
    # ucxx hashes pieces as they land and hands close_chunk the digest: a wrong one must fail the chunk.
    table = ReceiveTable(asyncio.get_running_loop())
    inbound = table.expect("t", [torch.zeros(4, 2, 1, 4)])
    src = torch.randn(4, 2, 1, 4)
    header = header_for("t", 0, 0, 0, src)
    landing = table.open_chunk(header)
    landing.view[:] = byte_view(src)
    await table.close_chunk(header, landing, actual="f" * 16)
    with pytest.raises(ChecksumMismatchError):
        await inbound.wait(1)
