"""A local placement reserves in its prefill command (tiny model, one unified worker with a small KV cache):
the coordinator sends the worker no reserve command, the worker emits `DecodeReserved` itself before its
`PrefillStarted`, and while the worker is full a request waits (`AdmissionDeferred`) and then completes
once the request filling it ends — both with the greedy output of one process.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import httpx
import pytest

from pdserve.bus import Bus
from pdserve.messages import ReserveRequest
from tests import oracle
from tests.faults.conftest import EnvStack

pytestmark = pytest.mark.stack

CAPACITY_TOKENS = 512  # 32 blocks of 16
# A reservation holds the prompt's blocks and one more; a sequence grows into more as it decodes. The
# filler's ~420-token prompt holds 27-28 blocks (31 at its end); the waiter's ~120 tokens need 9 blocks,
# which do not fit beside it and fit once it ends.
FILLER = "filler:" + " hello" * 420
FILLER_MAX_TOKENS = 60
WAITER = "waiter:" + " world" * 120
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def unified_stack(isolated_settings, tmp_path_factory) -> Iterator[EnvStack]:
    stack = EnvStack(isolated_settings("localreserve"), tmp_path_factory.mktemp("local-reserve"), {},
                     {"unified-0": {"PDS_KV_CAPACITY_TOKENS": str(CAPACITY_TOKENS)}},
                     model="tiny", mode="colocated", n_prefill=0, n_decode=1)
    try:
        yield stack.start()
    finally:
        stack.stop()


async def events_of(client: httpx.AsyncClient, rid: str) -> list[dict]:
    """The request's recorded events once its lifecycle ended (the log is written asynchronously)."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        events = (await client.get(f"/v1/requests/{rid}")).json().get("events", [])
        if any(e["type"] == "RequestCompleted" for e in events):
            return events
        await asyncio.sleep(0.2)
    raise AssertionError(f"lifecycle of {rid} not recorded in 20 s")


async def complete(client: httpx.AsyncClient, model: str, prompt: str, max_tokens: int) -> tuple[str, str]:
    r = await client.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": max_tokens,
                                                   "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"], r.headers["x-request-id"]


async def test_a_local_placement_reserves_in_its_prefill_command(unified_stack, reference):
    model, tokenizer = reference
    seen: list[ReserveRequest] = []
    bus = await Bus.connect(unified_stack.settings, "local-reserve-test")

    async def on_reserve(req: ReserveRequest) -> None:
        seen.append(req)

    sub = await bus.subscribe(bus.subjects.worker("unified-0", "reserve"), ReserveRequest, on_reserve)
    try:
        async with httpx.AsyncClient(base_url=unified_stack.url, timeout=60) as client:
            text, rid = await complete(client, unified_stack.served_model, WAITER, MAX_TOKENS)
            events = await events_of(client, rid)
    finally:
        await sub.unsubscribe()
        await bus.close()
    assert text == tokenizer.decode(oracle.greedy(model, tokenizer.encode(WAITER), MAX_TOKENS))
    assert seen == []  # no reserve command crossed the bus
    types = [e["type"] for e in events]
    reserved = events[types.index("DecodeReserved")]
    assert reserved["worker_id"] == "unified-0"
    assert reserved["payload"]["decode_worker_id"] == "unified-0"
    assert types.index("RequestRouted") < types.index("DecodeReserved") < types.index("PrefillStarted")
    assert "AdmissionDeferred" not in types


async def test_a_full_worker_defers_the_local_placement_until_room_frees(unified_stack, reference):
    model, tokenizer = reference
    served = unified_stack.served_model
    async with httpx.AsyncClient(base_url=unified_stack.url, timeout=120) as client:
        body = {"model": served, "prompt": FILLER, "max_tokens": FILLER_MAX_TOKENS, "temperature": 0,
                "ignore_eos": True, "stream": True}
        async with client.stream("POST", "/v1/completions", json=body) as filler:
            assert filler.status_code == 200
            lines = filler.aiter_lines()
            async for line in lines:  # the filler holds its blocks from here to its end
                if line.startswith("data: "):
                    break
            waiter = asyncio.ensure_future(complete(client, served, WAITER, MAX_TOKENS))
            async for _ in lines:
                pass
        text, rid = await waiter
        events = await events_of(client, rid)
    assert text == tokenizer.decode(oracle.greedy(model, tokenizer.encode(WAITER), MAX_TOKENS))
    types = [e["type"] for e in events]
    assert types.count("AdmissionDeferred") == 1
    assert types.index("AdmissionDeferred") < types.index("DecodeReserved") < types.index("PrefillStarted")
    assert events[types.index("AdmissionDeferred")]["payload"]["decode_worker_id"] == "unified-0"
