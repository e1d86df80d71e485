"""What is sent to the coordinator (pds.coord.*: `Submit` → `Accepted`, `Abort` and `DecodeFinished` →
`Ack`) and what streams from a request's decode to the gateway (`TokenChunk` on pds.tokens.<request_id>)."""

from __future__ import annotations

from pydantic import Field

from pdserve.engine.outputs import FinishReason, TokenLogprobs
from pdserve.engine.sampling_params import SamplingParams
from pdserve.messages.common import Message


class Receipt(Message):
    """What the request's `RequestReceived` event holds beyond its `Submit`, as the gateway received it:
    the endpoint, whether it streams, its stop strings and `include_usage`, and `event_id`, the id the
    event is stored under (JetStream drops a second publish of one id, so a Submit sent again to another
    coordinator stores the event once)."""

    event_id: str
    endpoint: str
    stream: bool
    stop: tuple[str, ...] = ()
    include_usage: bool = False


class Submit(Message):
    """A request for the coordinator to run. With `receipt` (the gateway's Submits) the coordinator stores
    the request's first event, `RequestReceived`, before it answers `Accepted` — while the route's and the
    lease claim's round trips are in flight, so accepting costs no round trip of its own — and starts the
    run only once it is stored, so every later event of the request follows it in the stream. Without
    (recovery's, rebuilt from that event) it is stored already."""

    request_id: str
    model: str
    prompt_token_ids: tuple[int, ...] = Field(min_length=1)
    sampling: SamplingParams
    cache_salt: str | None = Field(None, description="Requests with different salts never share cached KV.")
    received_ts: float = Field(description="Gateway's receive time, UNIX seconds.")
    receipt: Receipt | None = None


class Accepted(Message):
    request_id: str


class Abort(Message):
    """Stop a request and free what it holds. `finish_reason` is set when the gateway ended the request
    as finished rather than cancelled (a stop string matched: "stop"), so the lifecycle records it as
    completed."""

    request_id: str
    reason: str
    finish_reason: FinishReason | None = None


class TokenChunk(Message):
    """Tokens of one request, streamed on pds.tokens.<request_id>. `index` is the position of
    `token_ids[0]` in the output, so a receiver can drop repeats and detect gaps. The last chunk has
    `finish_reason` (completed) or `error` (failed) set."""

    request_id: str
    index: int = Field(ge=0)
    token_ids: tuple[int, ...] = ()
    finish_reason: FinishReason | None = None
    error: str | None = None
    logprobs: tuple[TokenLogprobs, ...] | None = Field(
        None, description="Aligned with token_ids, when the request asked for logprobs.")


class DecodeFinished(Message):
    request_id: str
    worker_id: str
    finish_reason: FinishReason
    num_output_tokens: int
    first_token_ts: float
    last_token_ts: float
