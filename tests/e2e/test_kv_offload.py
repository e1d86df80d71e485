"""The offload tier through a whole stack (tiny model, one unified worker whose pool holds 8 blocks and
whose offload tier holds 64): a prompt pushed out of the pool by others comes back from the offload tier —
its cached tokens recorded under "offload" in PrefillCompleted and in pdserve:prefix_cache_hits{tier}, the
router's candidate record showing it learned the tier from the worker's KV events — and the text is the
same as the first time."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from pdserve.embedded import free_port
from pdserve.service_plan import ServiceSpec
from tests.e2e.stack import Stack
from tests.e2e.test_prefix_cache import complete, lifecycle

pytestmark = pytest.mark.stack

BLOCK_SIZE = 16
PROMPT_LEN = 3 * BLOCK_SIZE + 1  # 3 full blocks may hit


class OffloadStack(Stack):
    metrics_port = free_port()

    def env(self, spec: ServiceSpec) -> dict[str, str]:
        env = super().env(spec)
        if spec.is_worker:
            env["PDS_KV_CAPACITY_TOKENS"] = str(8 * BLOCK_SIZE)
            env["PDS_KV_OFFLOAD_BLOCKS"] = "64"
            env["PDS_METRICS_PORT"] = str(self.metrics_port)
        return env


@pytest.fixture(scope="module")
def offload_stack(isolated_settings, tmp_path_factory) -> Iterator[Stack]:
    stack = OffloadStack(isolated_settings("offload"), tmp_path_factory.mktemp("offload-stack"), model="tiny",
                         mode="colocated", n_prefill=1, n_decode=0)
    try:
        yield stack.start()
    finally:
        stack.stop()


def prompt(seed: int) -> list[int]:
    return torch.randint(100, 40000, (PROMPT_LEN,), generator=torch.Generator().manual_seed(seed)).tolist()


def hits_by_tier(stack: OffloadStack) -> dict[str, float]:
    text = httpx.get(f"http://127.0.0.1:{stack.metrics_port}/metrics", timeout=10).text
    return {s.labels["tier"]: s.value for family in text_string_to_metric_families(text)
            for s in family.samples if s.name == "pdserve:prefix_cache_hits_total"}


def test_a_prompt_evicted_from_the_pool_comes_back_from_the_offload_tier(offload_stack):
    before = hits_by_tier(offload_stack)
    assert set(before) == {"pool", "offload"}
    first_id, first_text = complete(offload_stack, prompt(0))
    assert lifecycle(offload_stack, first_id)["PrefillCompleted"]["num_cached_tokens"] == 0
    for seed in range(1, 5):  # 4 other prompts of 4 blocks each push the first out of the 8-block pool
        complete(offload_stack, prompt(seed))
    time.sleep(1.0)  # the worker's KV events reach the router
    again_id, again_text = complete(offload_stack, prompt(0))
    assert again_text == first_text
    events = lifecycle(offload_stack, again_id)
    done = events["PrefillCompleted"]
    assert done["num_cached_tokens"] == 3 * BLOCK_SIZE
    assert done["cached_tokens_by_tier"] == {"offload": 3 * BLOCK_SIZE}
    assert done["num_computed_tokens"] == PROMPT_LEN - 3 * BLOCK_SIZE
    (candidate,) = events["RequestRouted"]["candidates"]
    assert candidate["cached_blocks_by_tier"] == {"offload": 3}
    after = hits_by_tier(offload_stack)
    assert after["offload"] - before["offload"] == 3 * BLOCK_SIZE
