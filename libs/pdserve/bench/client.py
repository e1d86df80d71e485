"""One streamed completion against an OpenAI-compatible `/v1/completions`, timed as `vllm bench serve`
times it (vllm/benchmarks/lib/endpoint_request_func.py `async_request_openai_completions`).

The request asks for `stream_options.include_usage` so the output token count is the server's; every SSE
`data:` message that carries `choices` is one chunk, timestamped when its line arrives.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable

import httpx

from pdserve.bench.datasets import SampleRequest
from pdserve.bench.metrics import RequestRecord

REQUEST_ID_HEADER = "X-Request-Id"


def completion_body(sample: SampleRequest, model: str | None, ignore_eos: bool) -> dict:
    """The JSON body for one sample: greedy, streamed, usage included, `max_tokens = output_len`."""
    body: dict = {
        "prompt": sample.prompt,
        "max_tokens": sample.output_len,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": ignore_eos,
    }
    if model is not None:
        body["model"] = model
    return body


async def send_completion(client: httpx.AsyncClient, url: str, index: int, sample: SampleRequest,
                          model: str | None = None, ignore_eos: bool = True,
                          clock: Callable[[], float] = time.perf_counter) -> RequestRecord:
    """POST `sample` to `url` and record every chunk's arrival on `clock`. Never raises for a failed
    request: a non-200 answer, a transport error or a stream without any chunk gives `success=False` and
    the reason in `error`."""
    record = RequestRecord(index=index, prompt_len=sample.prompt_len, expected_output_len=sample.output_len)
    text: list[str] = []
    record.start_s = clock()
    try:
        async with client.stream("POST", url, json=completion_body(sample, model, ignore_eos)) as resp:
            record.request_id = resp.headers.get(REQUEST_ID_HEADER)
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")
                record.error = f"HTTP {resp.status_code}: {body[:500]}"
                return record
            async for line in resp.aiter_lines():
                now = clock()
                if not line.startswith("data:"):
                    continue  # blank separators and ":" comments (keep-alive pings)
                data = line.removeprefix("data:").strip()
                if data == "[DONE]":
                    break
                message = json.loads(data)
                if choices := message.get("choices"):
                    record.chunk_times_s.append(now)
                    text.append(choices[0].get("text") or "")
                elif usage := message.get("usage"):
                    record.output_tokens = usage.get("completion_tokens")
                    record.prompt_len = usage.get("prompt_tokens") or record.prompt_len
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        record.error = f"{type(e).__name__}: {e}"
        return record
    record.text = "".join(text)
    record.success = bool(record.chunk_times_s)
    if not record.success:
        record.error = "the stream ended without a chunk carrying a token"
    return record
