"""kill -9 of the decode worker or of the prefill worker while a long prompt's KV streams between them
(SmolLM2, layer-wise transfer): the request ends completed on another pair, equal to an uninterrupted greedy
run token for token, with a complete lifecycle recorded; every surviving worker's free KV returns to its
start value.

"Mid-transfer" is observed, not slept into: the prompt (~1400 tokens) is prefilled in chunks of
`max_num_batched_tokens` (512), several seconds on 2 cores. Layer-wise, the prefill worker's KV sink hands
each layer's rows of a chunk to the transport as that layer is computed; when the step ends, the chunk's
full blocks enter its prefix cache and the worker publishes them (`BlockStored` on `pds.kv.<worker>`, one
batch per engine step). The kill comes at the first such batch for the request that holds fewer blocks
than the prompt: the first chunk's KV is on its way to the decode worker, the rest is not computed yet.
The recorded lifecycle then shows the first placement never completed its transfer.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator

import pytest

from pdserve.bus import Bus
from pdserve.events import Event, RequestRouted
from pdserve.messages import BlockStored, KVEvents
from tests.faults.conftest import EnvStack, open_store, restart
from tests.faults.load import Result, check_results, expected_outputs, recorded_lifecycles, stream_one
from tests.faults.test_transfer_faults import FreeKV

pytestmark = [pytest.mark.faults, pytest.mark.stack, pytest.mark.smollm2]

MAX_TOKENS = 16
BLOCK_SIZE = 16  # the workers' default block size (tokens per KV block)
STACK_ENV = {
    # Two 1400-token prompts fit one worker (a migrated request may land where the first one's blocks
    # are still being released); SmolLM2 fp32 is 45 KiB per token, so this keeps each worker at 180 MiB.
    "PDS_KV_CAPACITY_TOKENS": "4096",
    "PDS_COMMIT_EVERY_TOKENS": "4",
}


def counting_prompt(start: int, n: int = 300) -> str:
    """'Count: start, start+1, ..., start+n-1,' — ~1400 SmolLM2 tokens for n=300 (digits are single
    tokens); its greedy continuation counts on, so the output depends on every position's KV."""
    return "Count: " + ", ".join(str(i) for i in range(start, start + n)) + ","


@pytest.fixture(scope="module")
def smollm2_stack(isolated_settings, tmp_path_factory) -> Iterator[EnvStack]:
    stack = EnvStack(isolated_settings("midxfer"), tmp_path_factory.mktemp("midxfer-stack"), STACK_ENV,
                     model="smollm2", n_prefill=2, n_decode=2)
    try:
        yield stack.start()
    finally:
        stack.stop()


@pytest.fixture
async def smollm2_store(smollm2_stack) -> AsyncIterator:
    async with open_store(smollm2_stack.settings) as s:
        yield s


@pytest.fixture
def free_kv(smollm2_stack) -> Iterator[FreeKV]:
    """Every worker's free KV tokens from its heartbeats, once all four have beaten."""
    workers = {"prefill-0", "prefill-1", "decode-0", "decode-1"}
    watcher = FreeKV(smollm2_stack.settings).start()
    assert set(watcher.wait_back_to(dict.fromkeys(workers, 0))) == workers
    yield watcher
    watcher.stop()


class MidTransfer:
    """Watches a stack's subjects for the next request routed: its placement, then the first batch of
    blocks its prefill worker stores (its first prefill chunk computed, each layer's KV handed to the
    transport as it was computed)."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self.routed: asyncio.Future[Event] = asyncio.get_running_loop().create_future()
        self.kv: asyncio.Queue[KVEvents] = asyncio.Queue()
        self.subs: list = []

    async def __aenter__(self) -> MidTransfer:
        async def on_routed(ev: Event) -> None:
            if not self.routed.done():
                self.routed.set_result(ev)

        async def on_kv(batch: KVEvents) -> None:
            self.kv.put_nowait(batch)

        s = self.bus.subjects
        self.subs = [await self.bus.subscribe(s.event("*", RequestRouted.type), Event, on_routed),
                     await self.bus.subscribe(s.kv_events("*"), KVEvents, on_kv)]
        return self

    async def __aexit__(self, *exc) -> None:
        for sub in self.subs:
            await sub.unsubscribe()

    async def reached(self, num_prompt_tokens: int, timeout_s: float = 60.0) -> tuple[str, RequestRouted]:
        """(request id, placement) once the prefill worker has stored the first chunk's blocks; asserts
        that they are fewer than the prompt's, i.e. the prefill (and so the transfer) is not done."""
        async with asyncio.timeout(timeout_s):
            ev = await self.routed
            routed = ev.typed_payload()
            assert isinstance(routed, RequestRouted)
            while True:
                batch = await self.kv.get()
                stored = sum(len(e.block_hashes) for e in batch.events if isinstance(e, BlockStored))
                if batch.worker_id == routed.prefill_worker_id and stored:
                    break
        assert stored < num_prompt_tokens // BLOCK_SIZE, (stored, num_prompt_tokens)
        return ev.request_id, routed


async def _kill_mid_transfer(stack: EnvStack, store, reference, free_kv: FreeKV, prompt: str,
                             victim_role: str) -> tuple[Result, list[Event]]:
    """Stream `prompt`; kill -9 the `victim_role` ('prefill' or 'decode') worker of its first placement
    mid-transfer; restart it once the request ended. Checks the request completed equal to the oracle
    with a complete lifecycle, and every worker's free KV back at its start; returns (result, events)."""
    tokenizer = reference[1]
    expected = expected_outputs(reference, [prompt], MAX_TOKENS)
    start = free_kv.wait_back_to(dict(free_kv.free))
    _, bus = store
    async with MidTransfer(bus) as watch:
        streaming = asyncio.ensure_future(asyncio.to_thread(stream_one, stack.url, prompt, MAX_TOKENS,
                                                            lambda _: None))
        request_id, routed = await watch.reached(len(tokenizer.encode(prompt)))
        victim = routed.prefill_worker_id if victim_role == "prefill" else routed.decode_worker_id
        stack.kill(victim)
    result = await streaming
    restart(stack, victim)
    assert result.request_id == request_id
    events = (await recorded_lifecycles(store, [request_id]))[request_id]
    check_results([result], expected, tokenizer, {request_id: events})
    types = [e.type for e in events]
    migrated = [e for e in events if e.type == "RequestMigrated"]
    assert [e.payload["from_worker_id"] for e in migrated] == [victim], types
    # The kill interrupted the transfer: the first placement never completed it, the second did.
    assert types.index("RequestMigrated") < types.index("TransferCompleted"), types
    assert types.count("TransferCompleted") == 1, types
    rerouted = [e.typed_payload() for e in events if e.type == RequestRouted.type][1]
    assert victim not in (rerouted.prefill_worker_id, rerouted.decode_worker_id), types
    # The restarted worker comes back empty; the others return everything the request held.
    assert free_kv.wait_back_to(start, timeout_s=15) == start
    return result, events


async def test_decode_worker_killed_mid_transfer_request_completes_on_the_other_pair(
    smollm2_stack, smollm2_store, smollm2_reference, free_kv
):
    _, events = await _kill_mid_transfer(smollm2_stack, smollm2_store, smollm2_reference, free_kv,
                                         counting_prompt(0), "decode")
    assert next(e for e in events if e.type == "RequestMigrated").payload["phase"] == "prefill"


async def test_prefill_worker_killed_mid_transfer_request_completes_on_the_other_pair(
    smollm2_stack, smollm2_store, smollm2_reference, free_kv
):
    _, events = await _kill_mid_transfer(smollm2_stack, smollm2_store, smollm2_reference, free_kv,
                                         counting_prompt(500, 250), "prefill")
    assert next(e for e in events if e.type == "RequestMigrated").payload["phase"] == "prefill"
