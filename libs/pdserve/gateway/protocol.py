"""The OpenAI request bodies the gateway accepts: /v1/completions and /v1/chat/completions.

Field names, types, ranges and defaults follow the OpenAI API reference
(platform.openai.com/docs/api-reference) and vLLM's `vllm/entrypoints/openai/protocol.py`, so the official
clients work unchanged. Extensions taken from vLLM: `top_k`, `stop_token_ids`, `ignore_eos`. Fields a
client may send but that do not change what pdserve computes (`user`, `metadata`, `store`, ...) are
accepted and ignored; fields whose value pdserve cannot honour (`n` above 16, more than 5 logprobs,
`echo`, `tools`, a non-zero penalty) are refused with a 400 rather than silently ignored. Parsing errors are
pydantic `ValidationError`s; `errors.api_error_from_validation` turns them into OpenAI's 400 shape.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

TokenId = Annotated[int, Field(ge=0)]
MAX_CHOICES = 16  # pdserve.gateway.choices: each choice is a request of its own on the workers
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False


class _SamplingFields(BaseModel):
    """What both endpoints share. Ranges: OpenAI's (temperature 0..2, top_p 0..1, penalties -2..2)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = Field(None, description="Must be the served model name; None = the served model.")
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, description="Completion tokens at most; > 0.")
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1, description="vLLM extension; -1 or 0 = all tokens.")
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = Field(None, description="vLLM extension.")
    ignore_eos: bool = Field(False, description="vLLM extension: keep going past EOS (benchmarks).")
    n: int = Field(1, ge=1, le=MAX_CHOICES, description="Choices to generate (pdserve.gateway.choices).")
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    cache_salt: str | None = Field(
        None, description="Prefix-cache isolation: requests with other salts never share cached KV blocks.")

    @field_validator("stream", "temperature", "top_p", "top_k", "n", "presence_penalty", "frequency_penalty",
                     mode="before")
    @classmethod
    def _null_is_default(cls, v: Any, info: ValidationInfo) -> Any:
        # Clients and SDKs often send explicit nulls for "not set" (vLLM accepts them the same way).
        return cls.model_fields[info.field_name].default if v is None else v

    @field_validator("max_tokens")
    @classmethod
    def _positive_max_tokens(cls, v: int | None) -> int | None:
        if v is not None and v <= 0:
            raise ValueError("max_tokens must be at least 1")
        return v

    @field_validator("stop")
    @classmethod
    def _non_empty_stops(cls, v: str | list[str] | None) -> str | list[str] | None:
        stops = [v] if isinstance(v, str) else (v or [])
        if any(s == "" for s in stops):
            raise ValueError("stop strings must not be empty")
        if any("\x00" in s for s in stops):
            raise ValueError("stop strings must not contain NUL")
        return v

    @field_validator("cache_salt")
    @classmethod
    def _storable_salt(cls, v: str | None) -> str | None:
        if v is not None and "\x00" in v:
            raise ValueError("cache_salt must not contain NUL")
        return v

    @model_validator(mode="after")
    def _unsupported_and_combinations(self) -> _SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        if self.presence_penalty or self.frequency_penalty:
            raise ValueError("presence_penalty and frequency_penalty are not supported")
        if self.logit_bias:
            raise ValueError("logit_bias is not supported")
        return self

    @property
    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingFields):
    """POST /v1/completions. `prompt` is text or token ids, one prompt per request (a list of one
    prompt is accepted). `max_tokens` defaults to 16, as in OpenAI's legacy completions API."""

    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=5, description="Top alternatives per output token (0..5).")
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _one_non_empty_prompt(cls, v: Any) -> str | list[int]:
        if isinstance(v, list) and v and isinstance(v[0], (str, list)):
            if len(v) != 1:
                raise ValueError("exactly one prompt per request is supported")
            v = v[0]
        if len(v) == 0:
            raise ValueError("prompt must not be empty")
        return v

    @model_validator(mode="after")
    def _unsupported_completion_fields(self) -> CompletionRequest:
        if self.echo:
            raise ValueError("echo is not supported")
        if self.best_of not in (None, 1):
            raise ValueError("best_of must be 1")
        if self.suffix:
            raise ValueError("suffix is not supported")
        return self

    @property
    def num_logprobs(self) -> int | None:
        """Alternatives per output token to return; None = no logprobs."""
        return self.logprobs


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One message. `content` is text or a list of text parts (joined with newlines, as vLLM does);
    image and audio parts are refused."""

    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    @property
    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions. `max_completion_tokens` wins over the deprecated `max_tokens`; with
    neither, the completion may fill the rest of the context (vLLM's default)."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20, description="OpenAI's range; pdserve serves up to 5.")
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None

    @field_validator("max_completion_tokens")
    @classmethod
    def _positive_max_completion_tokens(cls, v: int | None) -> int | None:
        if v is not None and v <= 0:
            raise ValueError("max_completion_tokens must be at least 1")
        return v

    @model_validator(mode="after")
    def _unsupported_chat_fields(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        if self.top_logprobs is not None and self.top_logprobs > 5:
            raise ValueError("top_logprobs above 5 is not supported")
        if self.tools:
            raise ValueError("tools are not supported")
        return self

    @property
    def num_logprobs(self) -> int | None:
        """Alternatives per output token to return; None = no logprobs."""
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def template_messages(self) -> list[dict[str, str]]:
        """The messages as the chat template takes them: [{"role", "content"}] with text content."""
        return [{"role": m.role, "content": m.text} for m in self.messages]
