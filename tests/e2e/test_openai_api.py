"""The OpenAI API of a whole disaggregated stack (tiny model) through the official `openai` client:
`usage.prompt_tokens_details.cached_tokens` from the prefill's prefix cache, `n` choices that share the
prompt's cached blocks, read-your-writes on `GET /v1/requests/{id}`, and a stream framed as OpenAI's
(`data:` lines only) that a `vllm bench serve`-style parser reads."""

from __future__ import annotations

import json

import httpx
import openai
import torch

from tests.e2e.stack import Stack

BLOCK_SIZE = 16
PROMPT_LEN = 2 * BLOCK_SIZE + 1  # two full blocks can be cached; the last token is always computed


def prompt(seed: int) -> list[int]:
    return torch.randint(100, 40000, (PROMPT_LEN,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_cached_tokens_n_and_read_your_writes_through_the_openai_client(tiny_stack: Stack):
    client = openai.OpenAI(base_url=f"{tiny_stack.url}/v1", api_key="unused", max_retries=0)
    ids = prompt(101)
    first = client.completions.create(model=tiny_stack.served_model, prompt=ids, max_tokens=4, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    # read-your-writes: asked right away, the lifecycle is there and complete
    rid = first.id.removeprefix("cmpl-")
    got = httpx.get(f"{tiny_stack.url}/v1/requests/{first.id}", timeout=30)
    assert got.status_code == 200, got.text
    assert got.json()["events"][-1]["type"] == "RequestCompleted"
    assert got.json()["request"]["request_id"] == rid

    again = client.completions.create(model=tiny_stack.served_model, prompt=ids, max_tokens=4, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert again.usage.prompt_tokens_details.cached_tokens == 2 * BLOCK_SIZE
    assert again.choices[0].text == first.choices[0].text

    fresh = prompt(202)
    raw = client.completions.with_raw_response.create(
        model=tiny_stack.served_model, prompt=fresh, max_tokens=4, temperature=0, n=3,
        extra_body={"ignore_eos": True})
    multi = raw.parse()
    assert [c.index for c in multi.choices] == [0, 1, 2]
    assert len({c.text for c in multi.choices}) == 1  # greedy: the same text three times
    assert multi.usage.prompt_tokens == PROMPT_LEN and multi.usage.completion_tokens == 12
    siblings = raw.headers["x-pds-request-ids"].split(",")
    cached = []
    for sibling in siblings:
        events = httpx.get(f"{tiny_stack.url}/v1/requests/{sibling}", timeout=30).json()["events"]
        prefill = next(e["payload"] for e in events if e["type"] == "PrefillCompleted")
        cached.append(prefill["num_cached_tokens"])
    assert cached == [0, 2 * BLOCK_SIZE, 2 * BLOCK_SIZE]  # the prompt is computed once
    client.close()


def test_a_stream_is_data_lines_only_as_vllm_bench_parses_it(tiny_stack: Stack):
    body = {"model": tiny_stack.served_model, "prompt": prompt(303), "max_tokens": 8, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    r = httpx.post(f"{tiny_stack.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200
    # vllm/benchmarks/lib/endpoint_request_func.py: each event, split on blank lines, is one "data: " line
    usage = None
    for event in (e for e in r.text.split("\n\n") if e):
        assert event.startswith("data: ") and "\n" not in event, event
        data = event.removeprefix("data: ")
        if data != "[DONE]":
            usage = json.loads(data).get("usage") or usage
    assert usage["completion_tokens"] == 8
