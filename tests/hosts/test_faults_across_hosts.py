"""Must-show 2 of issue 20 (its first two faults), on the test hosts under concurrent streamed load:

- kill -9 of the NATS server that leads the events stream: every request completes, equal to the greedy
  oracle token for token, and no event is lost (the stream's 3 replicas keep it; every service fails over
  to another server of its list; the event log holds exactly what the stream holds);
- the decode host's link cut mid-stream (`ip link set … down`): its requests migrate to the decode worker
  on another host and complete with the same greedy output.

The stack serves the tiny model (the mechanism under test is the network, not the model): recorder,
coordinator and gateway on `control`, prefill-0 and decode-1 on `prefill`, decode-0 on `decode`.
"""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from collections.abc import Callable, Iterator

import httpx
import pytest
import sqlalchemy as sa

from pdserve.bus import Bus
from pdserve.config import CoordinatorSettings
from tests.faults.conftest import FAULT_ENV, open_store
from tests.faults.load import (
    PROMPTS,
    Result,
    check_results,
    expected_outputs,
    recorded_lifecycles,
    run_load,
)
from tests.hosts.stack import HostStack

pytestmark = [pytest.mark.hosts, pytest.mark.faults, pytest.mark.stack]
MAX_TOKENS = 96
LINK_DOWN_S = 6.0  # past the coordinator's worker_timeout_s (2 s): the decode worker is dead to it
CUT_ROUNDS = 3
FREEZE_SETTLE_S = 0.3  # what a frozen worker published before SIGSTOP reaches the stream by then


@pytest.fixture(scope="module")
def hosts_fault_stack(host_settings, hosts, tmp_path_factory) -> Iterator[HostStack]:
    stack = HostStack(host_settings("hostfaults"), tmp_path_factory.mktemp("hosts-fault-stack"), hosts,
                      placement={"decode-1": "prefill"}, env=FAULT_ENV, model="tiny", n_prefill=1,
                      n_decode=2)
    try:
        yield stack.start()
    finally:
        stack.stop()


@pytest.fixture(scope="module")
def tiny_reference(tmp_path_factory):
    """(model, tokenizer) of the tiny Llama in this process: the greedy oracle."""
    from pdserve.engine.loader import load_model
    from pdserve.engine.model import LlamaModel

    loaded = load_model("tiny", tmp_path_factory.mktemp("tiny-weights"))
    return LlamaModel(loaded.config, loaded.weights), loaded.tokenizer


def frozen_while_decoding(stack: HostStack, worker_id: str) -> Callable[[list[Result]], bool]:
    """A `run_load(when=…)` predicate that is true with `worker_id` frozen (SIGSTOP) while a request on it
    still lacks committed tokens: the cut that follows then strands that request for certain. The tiny
    model decodes a token in milliseconds, so a request merely seen decoding there may end before the
    cut takes hold (a loaded CI host did that three rounds running); frozen, it cannot. The caller cuts
    the link, then thaws the worker (SIGCONT) on the far side of the cut. A request's placement is read
    from the gateway once (it does not change unless it fails); a frozen worker whose requests all had
    every token committed is thawed and the watch goes on."""
    placed: dict[str, str | None] = {}
    proc = stack.procs[worker_id]

    def lifecycle(request_id: str) -> dict:
        return httpx.get(f"{stack.url}/v1/requests/{request_id}", timeout=5).json()

    def unfinished_there(request_id: str) -> bool:
        commits = [e["payload"] for e in lifecycle(request_id)["events"] if e["type"] == "TokensCommitted"]
        return max((c["start_index"] + len(c["token_ids"]) for c in commits), default=0) < MAX_TOKENS

    def check(streams: list[Result]) -> bool:
        for r in streams:
            if not r.request_id or r.finish_reason is not None:
                continue
            if placed.get(r.request_id) is None:  # not known until its route is in the log
                placed[r.request_id] = (lifecycle(r.request_id).get("request") or {}).get("decode_worker_id")
            if placed[r.request_id] != worker_id:
                continue
            proc.send_signal(signal.SIGSTOP)
            time.sleep(FREEZE_SETTLE_S)
            if unfinished_there(r.request_id):
                return True
            proc.send_signal(signal.SIGCONT)
        return False

    return check


async def lead_elsewhere(bus: Bus, streams: list[str], host: str, timeout_s: float = 30.0) -> None:
    """Step each stream's RAFT leader down until a server other than `host`'s leads it. The cut below is
    of a decode host, not of the leader of the log or of the leases: a partitioned leader stalls every
    write to its stream for an election (4–9 s, past a coordinator's fencing: all of them hand their
    requests off, which is the NATS-kill test's subject), whereas a partitioned follower costs nothing."""
    deadline = time.monotonic() + timeout_s
    for stream in streams:
        while (await bus.js.stream_info(stream)).cluster.leader == host:
            assert time.monotonic() < deadline, f"{stream} still led by {host}"
            await bus.nc.request(f"$JS.API.STREAM.LEADER.STEPDOWN.{stream}", b"", timeout=5)
            await asyncio.sleep(0.5)


async def no_event_lost(store, stack: HostStack) -> None:
    """No service gave up publishing an event (`Bus._publish_event` logs each it could not store), and the
    event log (Postgres) holds exactly the events the stream holds: none lost, none twice."""
    for spec in stack.plan:
        log = (stack.var_dir / f"{spec.name}.log").read_text(errors="replace")
        assert " lost after " not in log, spec.name
    stream = stack.settings.events_stream
    db, bus = store
    info = await bus.js.stream_info(stream)
    async with db.connect() as conn:
        rows = (await conn.execute(sa.text("SELECT count(*), count(DISTINCT event_id) FROM events"))).one()
    assert rows[0] == rows[1] == info.state.messages, (rows, info.state.messages)


async def test_nats_server_killed_under_load_loses_no_request_and_no_event(
    hosts_fault_stack, nats_cluster, hosts, tiny_reference
):
    stack = hosts_fault_stack
    async with open_store(stack.settings) as store:
        info = await store[1].js.stream_info(stack.settings.events_stream)
        victim = hosts[info.cluster.leader]  # the server leading the events stream: the hardest loss
        results = await asyncio.to_thread(run_load, stack.url, PROMPTS, MAX_TOKENS,
                                          lambda: nats_cluster.kill(victim))
        try:
            lifecycles = await recorded_lifecycles(store, [r.request_id for r in results])
            check_results(results, expected_outputs(tiny_reference, PROMPTS, MAX_TOKENS), tiny_reference[1],
                          lifecycles)
            await no_event_lost(store, stack)
        finally:
            await asyncio.to_thread(nats_cluster.restart, victim)
            await asyncio.to_thread(nats_cluster.wait_jetstream)


async def test_decode_host_link_cut_mid_stream_migrates_its_requests_with_identical_greedy_output(
    hosts_fault_stack, nats_cluster, hosts, tiny_reference
):
    stack = hosts_fault_stack
    decode = hosts["decode"]
    leases = CoordinatorSettings(**stack.settings.model_dump()).lease_bucket
    # decode-0 is frozen with a request unfinished on it before the cut (`frozen_while_decoding`); a round
    # whose load ended without that moment (30 s) strands nothing and proves nothing, and the load runs again.
    for _ in range(CUT_ROUNDS):
        async with open_store(stack.settings) as (_, bus):
            await lead_elsewhere(bus, [stack.settings.events_stream, f"KV_{leases}"], "decode")
        restore = threading.Timer(LINK_DOWN_S, decode.restore_link)

        def cut(restore: threading.Timer = restore) -> None:
            decode.cut_link()
            stack.procs["decode-0"].send_signal(signal.SIGCONT)  # it wakes up cut off
            restore.start()

        try:
            results = await asyncio.to_thread(run_load, stack.url, PROMPTS, MAX_TOKENS, cut,
                                              when=frozen_while_decoding(stack, "decode-0"))
        finally:
            if restore.is_alive():
                restore.join()
            decode.restore_link()
            stack.procs["decode-0"].send_signal(signal.SIGCONT)  # were the load to fail while it is frozen
            # the healed cluster re-forms its JetStream groups (meta, streams) before anything asks it again
            await asyncio.to_thread(nats_cluster.wait_jetstream)
        async with open_store(stack.settings) as store:
            lifecycles = await recorded_lifecycles(store, [r.request_id for r in results])
            check_results(results, expected_outputs(tiny_reference, PROMPTS, MAX_TOKENS), tiny_reference[1],
                          lifecycles)
            await no_event_lost(store, stack)
        migrated = [rid for rid, evs in lifecycles.items() if any(
            e.type == "RequestMigrated" and e.payload["from_worker_id"] == "decode-0" for e in evs)]
        if migrated:
            break
    assert migrated, f"in {CUT_ROUNDS} rounds no request was decoding on the decode host at the cut"
