"""The shared KV store under faults, on a whole stack (tiny model, 2 prefill workers placed round robin,
so one worker's prompts are the other's store hits, a real Mooncake Store): the master killed under load
fails no request and changes no token; serving goes on from the workers' own pools."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.embedded import free_port
from tests.conftest import mooncake_importable
from tests.faults.conftest import EnvStack, open_store
from tests.faults.load import check_results, expected_outputs, recorded_lifecycles, run_load, stream_one

pytestmark = [pytest.mark.faults, pytest.mark.slow, pytest.mark.skipif(bool(mooncake_importable()),
                                                     reason=mooncake_importable() or "ok")]
PREFILL = ("prefill-0", "prefill-1")
SHARED = ("You are a careful assistant. Answer briefly, cite nothing, and stop when the question is "
          "answered. The conversation so far has been about the weather in several cities. ")
CITIES = ("Paris", "Oslo", "Rome", "Lima", "Cairo", "Perth")
# Each prompt's own part spans full blocks too: every prefill under load computes (and publishes) blocks
# and looks beyond its pool hit in the store, so the killed master is met by reads and writes alike.
PROMPTS = [SHARED + f"Now {c}: is it raining in {c} today, and how warm will {c} be tomorrow at noon, "
           f"and at midnight, in {c}?" for c in CITIES]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def store_server(tmp_path_factory):
    from pdserve.embedded import start_mooncake

    server = start_mooncake(tmp_path_factory.mktemp("mooncake"), segment_bytes=64 << 20)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def store_stack(isolated_settings, tmp_path_factory, store_server) -> Iterator[EnvStack]:
    ports = {name: free_port() for name in PREFILL}
    env = {"PDS_KV_STORE": "mooncake", "PDS_KV_STORE_URL": store_server.url, "PDS_POLICY": "round_robin",
           "PDS_KV_STORE_LOOKUP_TIMEOUT_S": "0.2", "PDS_KV_STORE_GET_TIMEOUT_S": "0.3",
           "PDS_KV_STORE_PUT_TIMEOUT_S": "0.3", "PDS_KV_STORE_RETRY_AFTER_S": "1.0",
           "PDS_COMMIT_EVERY_TOKENS": "8"}
    stack = EnvStack(isolated_settings("kvstore"), tmp_path_factory.mktemp("kvstore-stack"), env,
                     {name: {"PDS_METRICS_PORT": str(port)} for name, port in ports.items()}, model="tiny",
                     n_prefill=2, n_decode=1)
    stack.metrics_ports = ports
    try:
        yield stack.start()
    finally:
        stack.stop()


def samples(stack: EnvStack, name: str) -> list[tuple[dict[str, str], float]]:
    """(labels, value) of every sample called `name` on the prefill workers' /metrics."""
    out = []
    for worker in PREFILL:
        text = httpx.get(f"http://127.0.0.1:{stack.metrics_ports[worker]}/metrics", timeout=10).text
        out += [(s.labels, s.value) for f in text_string_to_metric_families(text) for s in f.samples
                if s.name == name]
    return out


def store_hit_tokens(stack: EnvStack) -> float:
    return sum(v for labels, v in samples(stack, "pdserve:prefix_cache_hits_total")
               if labels.get("tier") == "store")


def store_failures(stack: EnvStack) -> float:
    return sum(v for _, v in samples(stack, "pdserve:kv_store_failures_total"))


async def test_master_killed_under_load_fails_no_request_and_changes_no_token(
    store_stack, store_server, reference
):
    # Warm up one at a time: round robin sends consecutive requests to alternate workers, so the second
    # finds the first's shared prefix only in the store.
    for p in PROMPTS[:2]:
        r = await asyncio.to_thread(stream_one, store_stack.url, p, MAX_TOKENS, lambda r: None)
        assert r.error is None, r.error
    assert store_hit_tokens(store_stack) > 0, "no prefill was served from the store before the fault"
    failures_before = store_failures(store_stack)

    prompts = PROMPTS[2:] * 2
    results = await asyncio.to_thread(run_load, store_stack.url, prompts, MAX_TOKENS,
                                      lambda: os.kill(store_server.pid, signal.SIGKILL), stagger_s=0.1,
                                      during_at=2)
    async with open_store(store_stack.settings) as store:
        lifecycles = await recorded_lifecycles(store, [r.request_id for r in results])
    check_results(results, expected_outputs(reference, prompts, MAX_TOKENS), reference[1], lifecycles)
    assert store_failures(store_stack) > failures_before  # store calls did fail (bounded): no request did
