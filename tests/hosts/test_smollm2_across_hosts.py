"""Must-show 1 of issue 20: gateway, coordinator, router and recorder on one host, the prefill worker on a
second, the decode worker on a third, a 3-server NATS cluster across the three; a SmolLM2 request
completes, equal to the greedy oracle, with its KV carried by UCX over TCP from the prefill host's address
to the decode host's (no shared memory, no loopback)."""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import Iterator

import httpx
import pytest

from tests import oracle
from tests.faults.conftest import open_store
from tests.faults.load import recorded_lifecycles
from tests.hosts.nats_cluster import CLIENT_PORT, ROUTE_PORT
from tests.hosts.netns import Host
from tests.hosts.stack import HostStack

pytestmark = [pytest.mark.hosts, pytest.mark.smollm2, pytest.mark.stack]
PROMPT = "What is the capital of France?"
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def smollm2_hosts_stack(host_settings, hosts, tmp_path_factory) -> Iterator[HostStack]:
    stack = HostStack(host_settings("smollm2hosts"), tmp_path_factory.mktemp("smollm2-hosts"), hosts,
                      model="smollm2")
    try:
        yield stack.start()
    finally:
        stack.stop()


def netns_of(pid: int) -> str:
    """The name of the network namespace process `pid` runs in."""
    found = subprocess.run(["ip", "netns", "identify", str(pid)], capture_output=True, text=True)
    return found.stdout.strip()


def tcp_peers(host: Host) -> set[tuple[str, str]]:
    """(local address:port, peer address:port) of every established TCP connection inside `host`."""
    lines = host.run(["ss", "-Htn", "state", "established"]).stdout.splitlines()
    return {(f[-2], f[-1]) for f in (line.split() for line in lines) if len(f) >= 4}


async def test_smollm2_request_completes_with_its_kv_over_ucx_tcp_between_hosts(
    smollm2_hosts_stack, hosts, smollm2
):
    stack = smollm2_hosts_stack
    for name, host in [("gateway", "control"), ("coordinator", "control"), ("prefill-0", "prefill"),
                       ("decode-0", "decode")]:
        assert netns_of(stack.procs[name].pid) == hosts[host].netns, name

    r = await asyncio.to_thread(httpx.post, f"{stack.url}/v1/chat/completions", timeout=120, json={
        "model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    tok = smollm2.tokenizer
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": PROMPT}]))
    expected = tok.decode(oracle.greedy(oracle.build_model(smollm2), ids, MAX_TOKENS))
    assert r.json()["choices"][0]["message"]["content"] == expected
    assert "Paris" in expected

    async with open_store(stack.settings) as store:
        rid = r.headers["x-request-id"]
        events = (await recorded_lifecycles(store, [rid]))[rid]
    by_type = {e.type: e.payload for e in events}
    assert by_type["RequestRouted"]["mode"] == "disaggregated"
    assert (by_type["RequestRouted"]["prefill_worker_id"], by_type["RequestRouted"]["decode_worker_id"]) == (
        "prefill-0", "decode-0")
    transfer = by_type["TransferCompleted"]
    assert transfer["transport"] == "ucxx" and transfer["checksum_ok"]
    row_bytes = 30 * 2 * 3 * 64 * 4  # per token: layers x (K, V) x KV heads x head dim x fp32
    assert 0 < transfer["kv_bytes"] <= len(ids) * row_bytes and transfer["kv_bytes"] % row_bytes == 0

    # The KV went over TCP between the two hosts' own addresses: UCX's connection is there, beside NATS's.
    prefill, decode = hosts["prefill"].address, hosts["decode"].address
    nats_ports = {str(CLIENT_PORT), str(ROUTE_PORT)}
    ucx = {(a, b) for a, b in tcp_peers(hosts["decode"])
           if {a.rsplit(":", 1)[0], b.rsplit(":", 1)[0]} == {prefill, decode}
           and not nats_ports & {a.rsplit(":", 1)[1], b.rsplit(":", 1)[1]}}
    assert ucx, tcp_peers(hosts["decode"])
