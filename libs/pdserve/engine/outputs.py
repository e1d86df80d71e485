"""What the engine reports of a sequence: why it finished, and a sampled token's logprobs."""

from __future__ import annotations

from enum import StrEnum

from pydantic import BaseModel, ConfigDict


class FinishReason(StrEnum):
    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_tokens or the model's context
    ABORT = "abort"  # client went away or the request was cancelled


class TokenLogprobs(BaseModel):
    """One output token's log-probability under the model's raw distribution (log-softmax of the logits,
    before temperature / top-k / top-p: vLLM's default `logprobs_mode="raw_logprobs"`), and the `top`
    most likely tokens as (token_id, logprob), most likely first."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
