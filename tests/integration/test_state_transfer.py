"""A hybrid's state handoff over a real transport (asyncio TCP, both ends in this process), through the
worker's own plumbing: `OutboundKV` + `send_state` on the prefill side, `InboundKV` with a `StateInbound`
on the decode side, landing MLA-shaped KV rows in paged blocks and the KDA state in host buffers.

- A clean handoff lands every state tensor bit-exactly and the KV in its blocks; ready() reports both.
- One byte flipped in flight in one chunk of one state tensor (a random tensor, layer and byte, after its
  checksum) is detected in every one of 60 trials: `ready()` fails with ChecksumMismatchError naming that
  tensor's transfer and layer, and the state cannot be read (so it can never be installed); a retransfer
  under a fresh id then lands the very state that was sent.
"""

from __future__ import annotations

import asyncio
import random
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from pdserve.engine.sequence import Sequence
from pdserve.engine.state_pool import StateLayout, StateTensor
from pdserve.messages import PrefillRequest, SamplingParams
from pdserve.transfer import ChecksumMismatchError, KVTransport, make_transport
from pdserve.workers.kv_transfer import InboundKV, OutboundKV
from pdserve.workers.state_transfer import StateInbound, send_state, state_transfer_id
from tests.faults.corrupting import CorruptingTransport

TRIALS = 60
BLOCK_SIZE = 4
PROMPT = tuple(range(100, 110))  # 10 tokens over 3 blocks
LATENT = 24  # an MLA layer's row: kv_lora_rank + rope_dim
NUM_PAGED = 2
LAYOUT = StateLayout(3, (StateTensor("recurrent", (2, 8, 8), torch.float32), StateTensor("conv", (3, 48))))


@pytest.fixture
async def transports() -> AsyncIterator[tuple[CorruptingTransport, KVTransport]]:
    sender, receiver = CorruptingTransport(make_transport("tcp")), make_transport("tcp")
    await sender.start()
    await receiver.start()
    yield sender, receiver
    await sender.stop()
    await receiver.stop()


@pytest.fixture(scope="module")
def scatter_pool():
    with ThreadPoolExecutor(1) as pool:
        yield pool


def random_state(g: torch.Generator) -> dict[str, torch.Tensor]:
    return {t.name: torch.randn(LAYOUT.num_layers, *t.shape, generator=g, dtype=t.dtype)
            for t in LAYOUT.tensors}


async def handoff(transports, scatter_pool, state: dict[str, torch.Tensor], kv: list[torch.Tensor],
                  corrupt: tuple[str, int] | None = None):
    """One transfer of `kv` (per paged layer [len(PROMPT), LATENT]) and `state`, as a prefill and a decode
    worker make it; `corrupt` = (tensor name, layer) flips one byte of that state chunk in flight.
    Returns (the decode side's InboundKV, its kv_cache, its ready() outcome: stats or the exception)."""
    sender, receiver = transports
    transfer_id = uuid.uuid4().hex
    seq = Sequence(transfer_id, list(PROMPT))
    seq.block_table = [2, 0, 1]
    kv_cache = [torch.zeros(3, BLOCK_SIZE, LATENT) for _ in range(NUM_PAGED)]
    inbound = InboundKV(receiver, transfer_id, seq, kv_cache, BLOCK_SIZE, (LATENT,), 10.0, scatter_pool,
                        lambda stats, state_stats: asyncio.sleep(0),
                        StateInbound(receiver, transfer_id, LAYOUT, torch.float32))
    req = PrefillRequest(request_id=transfer_id, transfer_id=transfer_id, prompt_token_ids=PROMPT,
                         sampling=SamplingParams(max_tokens=1), decode_worker_id="decode-0",
                         endpoint=receiver.endpoint())
    if corrupt is not None:
        sender.pick(state_transfer_id(transfer_id, corrupt[0]), 0, corrupt[1])
    outbound = OutboundKV(sender, req, NUM_PAGED, naive=False)
    await asyncio.to_thread(lambda: [outbound.on_layer(layer, 0, kv[layer]) for layer in range(NUM_PAGED)])
    await asyncio.gather(outbound.complete(1), send_state(sender, receiver.endpoint(), transfer_id, state))
    try:
        outcome = await inbound.ready()
    except ChecksumMismatchError as e:
        outcome = e
    await inbound.drained()
    return inbound, kv_cache, outcome


def landed_kv(kv_cache: list[torch.Tensor], layer: int) -> torch.Tensor:
    """The rows of PROMPT's positions in `layer`'s blocks [2, 0, 1], in order."""
    return torch.cat([kv_cache[layer][b] for b in (2, 0, 1)])[: len(PROMPT)]


async def test_a_clean_handoff_lands_the_state_bit_exactly_beside_the_kv(transports, scatter_pool) -> None:
    g = torch.Generator().manual_seed(1)
    state, kv = random_state(g), [torch.randn(len(PROMPT), LATENT, generator=g) for _ in range(NUM_PAGED)]
    inbound, kv_cache, stats = await handoff(transports, scatter_pool, state, kv)
    assert not isinstance(stats, Exception)
    assert stats.kv_bytes == sum(t.numel() * 4 for t in kv)
    assert inbound.state_stats is not None
    assert inbound.state_stats.kv_bytes == sum(t.numel() * 4 for t in state.values())
    assert inbound.state_stats.num_layers == len(LAYOUT.tensors)
    got = inbound.state
    assert got is not None and set(got) == set(state)
    for name in state:
        assert torch.equal(got[name], state[name]), name
    for layer in range(NUM_PAGED):
        assert torch.equal(landed_kv(kv_cache, layer), kv[layer])


async def test_one_flipped_byte_in_a_state_chunk_is_detected_in_every_trial(transports, scatter_pool) -> None:
    sender, _ = transports
    rng = random.Random(15)
    g = torch.Generator().manual_seed(15)
    detected = 0
    for trial in range(TRIALS):
        state = random_state(g)
        kv = [torch.randn(len(PROMPT), LATENT, generator=g) for _ in range(NUM_PAGED)]
        name, layer = rng.choice([t.name for t in LAYOUT.tensors]), rng.randrange(LAYOUT.num_layers)
        before = sender.corrupted
        inbound, _, outcome = await handoff(transports, scatter_pool, state, kv, corrupt=(name, layer))
        assert sender.corrupted == before + 1, trial  # the byte really was flipped in flight
        assert isinstance(outcome, ChecksumMismatchError), (trial, outcome)
        assert outcome.transfer_id.endswith(f".state.{name}") and outcome.chunk == layer, (trial, outcome)
        with pytest.raises(RuntimeError):
            inbound.state  # noqa: B018 - an unverified state cannot be read, so never installed
        detected += 1
        # the coordinator's retry: a fresh transfer of the same state lands it exactly
        retry, _, stats = await handoff(transports, scatter_pool, state, kv)
        assert not isinstance(stats, Exception), (trial, stats)
        assert all(torch.equal(retry.state[n], state[n]) for n in state), trial
    assert detected == TRIALS
