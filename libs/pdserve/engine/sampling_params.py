"""How a request's tokens are drawn: vLLM's `SamplingParams`, as the engine and the wire both carry it."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class SamplingParams(BaseModel):
    """Sampling as in vLLM's `SamplingParams`. temperature 0 = greedy. Immutable; unknown fields rejected
    (pydantic ValidationError)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_tokens: int = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1, description="-1 = all tokens")
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = Field(
        None, ge=0, le=5, description="Return each sampled token's logprob and its `logprobs` most likely "
        "alternatives (vLLM's `logprobs`); None = off.")
