"""Side-by-side benchmarks: the order servers take in a round, the ratios, and the HTTP floor's stream."""

from __future__ import annotations

import asyncio
from collections import Counter

import httpx
import pytest

from pdserve.bench.client import send_completion
from pdserve.bench.datasets import SampleRequest
from pdserve.bench.sidebyside import ratio, round_order
from pdserve.bench.sse_floor import create_app

NAMES = ("vllm", "colocated", "disaggregated")


def test_every_round_runs_every_server_once():
    for r in range(6):
        for c in range(3):
            assert sorted(round_order(NAMES, r, c)) == sorted(NAMES)


def test_over_rounds_each_server_runs_first_and_last():
    first = Counter(round_order(NAMES, r)[0] for r in range(6))
    last = Counter(round_order(NAMES, r)[-1] for r in range(6))
    assert set(first) == set(NAMES) and set(last) == set(NAMES)


def test_the_second_round_runs_the_first_backwards():
    assert round_order(NAMES, 1) == round_order(NAMES, 0)[::-1]
    assert round_order(NAMES, 3, 1) == round_order(NAMES, 2, 1)[::-1]


def test_ratio_is_none_without_a_peer_value():
    assert ratio(3.0, 2.0) == pytest.approx(1.5)
    assert ratio(None, 2.0) is None and ratio(1.0, None) is None and ratio(1.0, 0.0) is None


def test_the_floor_streams_one_chunk_that_the_client_counts_as_a_token():
    async def go():
        transport = httpx.ASGITransport(app=create_app())
        async with httpx.AsyncClient(transport=transport, base_url="http://floor") as client:
            url = "http://floor/v1/completions"
            return await send_completion(client, url, 0, SampleRequest([5, 6, 7], 1))

    record = asyncio.run(go())
    assert record.success, record.error
    assert len(record.chunk_times_s) == 1
    assert record.output_tokens == 1 and record.prompt_len == 3
