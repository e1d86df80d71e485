"""The prefill side's `OutboundKV` over a real transport (asyncio TCP, both ends in this process): in
layer-wise mode the decode worker holds the whole transfer as soon as the prompt's last rows of the last
layer are handed over — before the prefill worker calls `complete()` (which it does only after sampling
its first token); in naive mode nothing moves before `complete()`."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import pytest
import torch

from pdserve.messages import PrefillRequest, SamplingParams
from pdserve.transfer import Inbound, KVTransport, TransferTimeout, make_transport
from pdserve.workers.kv_transfer import OutboundKV

NUM_LAYERS, HEADS, HEAD_DIM = 3, 2, 8
PROMPT = (11, 12, 13, 14, 15, 16)
DECODE_CACHED = 2  # the decode worker holds rows 0-1: rows 2-5 travel, in two prefill chunks of two
CHUNK_STARTS = (2, 4)


@pytest.fixture
async def transports() -> AsyncIterator[tuple[KVTransport, KVTransport]]:
    sender, receiver = make_transport("tcp"), make_transport("tcp")
    await sender.start()
    await receiver.start()
    yield sender, receiver
    await sender.stop()
    await receiver.stop()


def rows(layer: int, start: int) -> torch.Tensor:
    """Prompt positions start..start+1 of `layer`: [2, 2, HEADS, HEAD_DIM], values that name them."""
    return torch.arange(2 * 2 * HEADS * HEAD_DIM, dtype=torch.float32).reshape(2, 2, HEADS, HEAD_DIM) \
        + 1000 * layer + 100 * start


def prefill_request(receiver: KVTransport) -> PrefillRequest:
    return PrefillRequest(request_id=uuid.uuid4().hex, transfer_id=uuid.uuid4().hex, prompt_token_ids=PROMPT,
                          sampling=SamplingParams(max_tokens=1), decode_worker_id="decode-0",
                          endpoint=receiver.endpoint(), decode_num_cached_tokens=DECODE_CACHED)


async def prefill(transports: tuple[KVTransport, KVTransport], naive: bool
                  ) -> tuple[Inbound, OutboundKV, list[torch.Tensor]]:
    """The decode side expects a transfer into staging rows, then the prefill side computes: every layer
    of each prefill chunk in turn, handed to `OutboundKV` from the engine's own thread as the engine does.
    `complete()` is left to the test."""
    sender, receiver = transports
    req = prefill_request(receiver)
    staging = [torch.zeros(len(PROMPT) - DECODE_CACHED, 2, HEADS, HEAD_DIM) for _ in range(NUM_LAYERS)]
    inbound = receiver.expect(req.transfer_id, staging)
    outbound = OutboundKV(sender, req, NUM_LAYERS, naive=naive)

    def forward() -> None:
        for start in CHUNK_STARTS:
            for layer in range(NUM_LAYERS):
                outbound.on_layer(layer, start, rows(layer, start))

    await asyncio.to_thread(forward)
    return inbound, outbound, staging


async def test_layerwise_transfer_is_whole_before_the_prefill_completes(transports) -> None:
    inbound, outbound, staging = await prefill(transports, naive=False)

    stats = await inbound.wait(10)  # complete() not called yet: the end marker went with the last layer
    assert (stats.num_layers, stats.num_chunks) == (NUM_LAYERS, len(CHUNK_STARTS))
    for layer in range(NUM_LAYERS):
        expected = torch.cat([rows(layer, start) for start in CHUNK_STARTS])
        assert torch.equal(staging[layer], expected)
    assert await outbound.complete(len(CHUNK_STARTS)) == stats.kv_bytes == outbound.kv_bytes


async def test_naive_sends_nothing_before_complete(transports) -> None:
    inbound, outbound, staging = await prefill(transports, naive=True)

    with pytest.raises(TransferTimeout):
        await inbound.wait(0.3)
    assert not torch.any(torch.stack(staging))
    sent = await outbound.complete(len(CHUNK_STARTS))
    stats = await inbound.wait(10)
    assert sent == stats.kv_bytes and (stats.num_layers, stats.num_chunks) == (NUM_LAYERS, len(CHUNK_STARTS))
    assert torch.equal(staging[NUM_LAYERS - 1][2:], rows(NUM_LAYERS - 1, 4))
