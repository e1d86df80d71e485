"""The test hosts themselves and the NATS cluster across them: hosts reach each other only over their
bridge, a cut link isolates one, and the events stream on 3 replicas keeps every event a client stored
while one server was killed (the client fails over to the others through its list of URLs)."""

from __future__ import annotations

import asyncio
import sys
import time

import nats.errors
import pytest

from pdserve.bus import Bus
from pdserve.events import RequestReceived
from pdserve.lifecycle.journal import read_stream
from tests.hosts.nats_cluster import CLIENT_PORT

pytestmark = pytest.mark.hosts

_CONNECT = ("import socket, sys\n"
            "try:\n"
            " socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=1).close(); print('ok')\n"
            "except OSError as e:\n print(type(e).__name__)")


def _reach(src, dst_address: str, port: int) -> str:
    return src.run([sys.executable, "-c", _CONNECT, dst_address, str(port)]).stdout.strip()


def test_hosts_have_their_own_addresses_and_a_cut_link_isolates_one(hosts, nats_cluster):
    control, decode = hosts["control"], hosts["decode"]
    import ipaddress

    addresses = {h.address for h in hosts}
    assert len(addresses) == 3 and all(ipaddress.ip_address(a) in hosts.subnet for a in addresses)
    assert _reach(control, decode.address, CLIENT_PORT) == "ok"
    assert _reach(control, "127.0.0.1", CLIENT_PORT) != "ok"  # a host's loopback is its own
    decode.cut_link()
    try:
        assert _reach(control, decode.address, CLIENT_PORT) != "ok"
    finally:
        decode.restore_link()
    assert _reach(control, decode.address, CLIENT_PORT) == "ok"


async def test_events_stream_on_three_replicas_keeps_every_event_through_a_killed_server(
    host_settings, nats_cluster, hosts
):
    settings = host_settings("cluster")
    bus = await Bus.connect(settings, "cluster-test")
    victim = hosts["prefill"]
    try:
        info = await bus.js.stream_info(settings.events_stream)
        assert info.config.num_replicas == 3
        assert len(info.cluster.replicas or []) == 2  # a leader and two followers
        emitted = []
        for i in range(200):
            if i == 100:
                await asyncio.to_thread(nats_cluster.kill, victim)
            ev = await bus.emit_stored(f"req-{i:03d}", RequestReceived(
                model="m", endpoint="/v1/completions", num_prompt_tokens=1, max_tokens=1, stream=False))
            emitted.append(ev.event_id)
        # A new consumer needs the JetStream API, which waits for the meta leader the survivors elect
        # when the killed server held that role, and the stream's own leader when it held that one.
        await asyncio.to_thread(nats_cluster.wait_jetstream)
        deadline = time.monotonic() + 30
        while True:
            try:
                recorded = await read_stream(bus, bus.subjects.all_events)
                break
            except nats.errors.Error:  # the stream's group still electing (timeout, 503): ask again
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.5)
        assert [r.event.event_id for r in recorded] == emitted
    finally:
        await bus.close()
        if nats_cluster.procs[victim.name].poll() is not None:
            await asyncio.to_thread(nats_cluster.restart, victim)
            await asyncio.to_thread(nats_cluster.wait_jetstream)
