"""kill -9 of a decode worker or a prefill worker under concurrent load: every request ends, equal to an
uninterrupted greedy run token for token, with a complete lifecycle recorded."""

from __future__ import annotations

import asyncio

import pytest

from tests.faults.conftest import restart
from tests.faults.load import PROMPTS, check_results, expected_outputs, recorded_lifecycles, run_load

pytestmark = pytest.mark.faults
MAX_TOKENS = 160


async def test_decode_worker_killed_mid_generation_migrates_without_missing_or_repeated_tokens(
    fault_stack, reference, store
):
    results = await asyncio.to_thread(
        run_load, fault_stack.url, PROMPTS, MAX_TOKENS, lambda: fault_stack.kill("decode-0"), 12
    )
    restart(fault_stack, "decode-0")
    lifecycles = await recorded_lifecycles(store, [r.request_id for r in results])
    check_results(results, expected_outputs(reference, PROMPTS, MAX_TOKENS), reference[1], lifecycles)
    migrated = [
        rid
        for rid, evs in lifecycles.items()
        if any(e.type == "RequestMigrated" and e.payload["from_worker_id"] == "decode-0" for e in evs)
    ]
    assert migrated, "no request was decoding on decode-0 when it was killed"


async def test_prefill_worker_killed_under_load_every_request_completes_on_the_other(
    fault_stack, reference, store
):
    prompts = PROMPTS * 2
    results = await asyncio.to_thread(
        run_load,
        fault_stack.url,
        prompts,
        48,
        lambda: fault_stack.kill("prefill-0"),
        stagger_s=0.05,
        during_at=len(prompts) // 2,
    )
    restart(fault_stack, "prefill-0")
    lifecycles = await recorded_lifecycles(store, [r.request_id for r in results])
    check_results(results, expected_outputs(reference, prompts, 48), reference[1], lifecycles)
