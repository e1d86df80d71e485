"""kill -9 of the coordinator (which places its requests in-process, so a restarted one places from an empty
index), the recorder or the gateway under concurrent load: every request ends, equal to an uninterrupted
greedy run token for token, with a complete lifecycle recorded. A client whose gateway died resumes its
stream on the restarted gateway with Last-Event-ID. A router service killed under load: tests/faults/
test_control_plane_ha.py."""

from __future__ import annotations

import asyncio

import pytest

from tests.faults.conftest import restart
from tests.faults.load import PROMPTS, check_results, expected_outputs, recorded_lifecycles, run_load

pytestmark = pytest.mark.faults
MAX_TOKENS = 96


def kill_and_restart(stack, name: str, down_s: float = 0.0):
    def fault() -> None:
        stack.kill(name)
        if down_s:
            import time

            time.sleep(down_s)
        restart(stack, name)

    return fault


async def _survives(stack, reference, store, name: str, **load) -> list:
    results = await asyncio.to_thread(
        run_load,
        stack.url,
        PROMPTS,
        MAX_TOKENS,
        kill_and_restart(stack, name, load.pop("down_s", 0.0)),
        **load,
    )
    lifecycles = await recorded_lifecycles(store, [r.request_id for r in results], timeout_s=90)
    check_results(results, expected_outputs(reference, PROMPTS, MAX_TOKENS), reference[1], lifecycles)
    return results


async def test_coordinator_killed_mid_decode_restarts_and_resumes_every_request_from_the_log(
    fault_stack, reference, store
):
    await _survives(fault_stack, reference, store, "coordinator", min_tokens_before=8)
    fault_stack.wait_ready(60)


async def test_recorder_killed_under_load_loses_no_event(fault_stack, reference, store):
    await _survives(fault_stack, reference, store, "recorder", min_tokens_before=4)


async def test_gateway_killed_mid_stream_clients_resume_with_last_event_id(fault_stack, reference, store):
    results = await _survives(fault_stack, reference, store, "gateway", min_tokens_before=8)
    assert all(r.resumes >= 1 for r in results)
