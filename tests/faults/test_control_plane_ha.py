"""No single point of failure in the control plane (docs/architecture.md §18): a stack with two
coordinators and two routers; under concurrent load, kill -9 of the coordinator that owns the most
requests and of one router. Every request ends completed with the uninterrupted greedy output, and the
event log shows one owner per request at a time (a change of owner only by a `RequestTakenOver` from the
previous one, who emits nothing after it) and each output token index committed once."""

from __future__ import annotations

import asyncio
import signal
import time
from collections import Counter
from collections.abc import Iterator

import pytest

from pdserve.bus import Bus
from pdserve.config import CoordinatorSettings
from tests.e2e.stack import Stack
from tests.faults.conftest import open_store
from tests.faults.load import PROMPTS, check_results, expected_outputs, recorded_lifecycles, run_load

pytestmark = [pytest.mark.faults, pytest.mark.slow]
MAX_TOKENS = 96


@pytest.fixture(scope="module")
def ha_stack(isolated_settings, tmp_path_factory, fault_env) -> Iterator[Stack]:
    stack = Stack(isolated_settings("ha"), tmp_path_factory.mktemp("ha-stack"), model="tiny",
                  n_prefill=1, n_decode=2, n_coordinators=2, n_routers=2)
    try:
        yield stack.start()
    finally:
        stack.stop()


async def lease_holders(settings) -> Counter[str]:
    """Requests owned now, per coordinator lease holder (the lease bucket's `request.*` keys)."""
    bus = await Bus.connect(settings, "ha-test")
    try:
        kv = await bus.js.key_value(CoordinatorSettings(**settings.model_dump()).lease_bucket)
        owners: Counter[str] = Counter()
        for key in await kv.keys():
            if key.startswith("request."):
                owners[(await kv.get(key)).value.decode()] += 1
        return owners
    finally:
        await bus.close()


def check_one_owner_at_a_time(events: list) -> list[str]:
    """The request's owners in order, from its coordinator events' `worker_id` (the lease holder that
    emitted them); asserts every change is a `RequestTakenOver` from the previous owner."""
    owners: list[str] = []
    for e in events:
        if e.service != "coordinator":
            continue
        if e.type == "RequestTakenOver":
            if not owners:  # its first owner was killed after claiming it, before emitting anything
                owners.append(e.payload["from_coordinator_id"])
            assert e.payload["from_coordinator_id"] == owners[-1], (e.request_id, owners, e)
            assert e.worker_id not in owners, (e.request_id, owners, e)
            owners.append(e.worker_id)
        elif not owners:
            owners.append(e.worker_id)
        assert e.worker_id == owners[-1], (e.request_id, e.type, e.worker_id, owners)
    return owners


def check_each_token_committed_once(events: list) -> None:
    commits = [e.payload for e in events if e.type == "TokensCommitted"]
    indices = [c["start_index"] + i for c in commits for i in range(len(c["token_ids"]))]
    assert sorted(indices) == list(range(MAX_TOKENS)), (events[0].request_id, Counter(indices).most_common(3))


async def test_kill_one_of_two_coordinators_and_one_of_two_routers_every_request_completes_once(
    ha_stack, reference
):
    killed: dict[str, str] = {}

    def fault() -> None:
        # The coordinator owning most requests is frozen (SIGSTOP), and killed only if it still owns one:
        # a request it held may end between reading the leases and the kill (the tiny model decodes 96
        # tokens in well under a second), and a coordinator killed owning nothing leaves nothing to take over
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if not (owners := asyncio.run(lease_holders(ha_stack.settings))):
                time.sleep(0.02)
                continue
            holder, _ = owners.most_common(1)[0]
            name = holder.rsplit(".", 1)[0]  # the process name: coordinator or coordinator-1
            ha_stack.procs[name].send_signal(signal.SIGSTOP)
            if asyncio.run(lease_holders(ha_stack.settings))[holder]:
                killed["holder"] = holder
                ha_stack.kill(name)
                ha_stack.kill("router-1")
                return
            ha_stack.procs[name].send_signal(signal.SIGCONT)
        raise AssertionError("no coordinator owned a request in flight during the load")

    results = await asyncio.to_thread(run_load, ha_stack.url, PROMPTS, MAX_TOKENS, fault, stagger_s=0.3,
                                      during_at=3)
    async with open_store(ha_stack.settings) as store:
        lifecycles = await recorded_lifecycles(store, [r.request_id for r in results], timeout_s=90)
    check_results(results, expected_outputs(reference, PROMPTS, MAX_TOKENS), reference[1], lifecycles)
    took_over = 0
    for r in results:
        events = lifecycles[r.request_id]
        owners = check_one_owner_at_a_time(events)
        assert owners and all(o.startswith("coordinator") for o in owners), (r.request_id, owners)
        # one owner (the killed one may have finished it before it died), or the killed one then the survivor
        two = len(owners) == 2 and owners[0] == killed["holder"]
        assert len(owners) == 1 or two, (r.request_id, owners)
        took_over += len(owners) == 2
        check_each_token_committed_once(events)
    assert took_over >= 1, killed  # the killed coordinator owned requests in flight, and they were taken
    print(f"killed {killed['holder']} and router-1: {took_over} of {len(results)} requests taken over")
