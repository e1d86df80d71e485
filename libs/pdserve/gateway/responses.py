"""OpenAI response bodies, whole and streamed, for both endpoints.

Shapes: OpenAI API reference ("The completion object", "The chat completion object", "The chat completion
chunk object"). Ids are `cmpl-<request_id>` / `chatcmpl-<request_id>`. Streamed chunks are serialized with
`exclude_unset`, so a field appears exactly when it is set: the first chat chunk carries the role, the last
an empty delta with `finish_reason`, and `usage` is present (null until the final usage chunk) only when the
client asked for `stream_options.include_usage`, as OpenAI does. `logprobs` (`pdserve.gateway.logprobs`) is
filled when the request asked for it (the formatter has a `token_text`), per chunk when streamed.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel

from pdserve.gateway.logprobs import (
    ChatLogprobs,
    CompletionLogprobs,
    TokenText,
    chat_logprobs,
    completion_logprobs,
)
from pdserve.messages import TokenLogprobs


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    """OpenAI's usage object, in tokens. `prompt_tokens_details.cached_tokens`: leading prompt tokens whose
    KV came from a prefix cache instead of being computed (the prefill's `num_cached_tokens`)."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = PromptTokensDetails()

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> Usage:
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens,
                   prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens))


@dataclass
class ChoiceText:
    """One choice of a whole (non-streamed) answer, as collected: its text, finish reason, and, when the
    request asked for logprobs, one entry per output token and where each token's text starts."""

    text: str = ""
    finish_reason: str | None = None
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    text_offsets: list[int] = field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    """Both the whole /v1/completions answer and its stream chunks (OpenAI uses one object type)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class Formatter:
    """Builds one endpoint's bodies for one request. Subclasses: `CompletionFormatter`, `ChatFormatter`.

    `token_text`: a token id's string (the tokenizer's decode of that one id) when the request asked for
    logprobs; None = no logprobs. `logprobs` / `text_offsets` arguments: one item per output token covered
    (`TextDelta`'s)."""

    id_prefix: str

    def __init__(self, request_id: str, model: str, include_usage: bool = False,
                 token_text: TokenText | None = None) -> None:
        self.id = f"{self.id_prefix}{request_id}"
        self.model = model
        self.created = int(time.time())
        self.include_usage = include_usage
        self.token_text = token_text

    def whole(self, choices: Sequence[ChoiceText], usage: Usage) -> BaseModel:
        """The whole answer: `choices[i]` is choice index i."""
        raise NotImplementedError

    def opening_chunks(self, n: int = 1) -> list[BaseModel]:
        """Chunks sent as soon as the request is accepted (before any token), for `n` choices."""
        return []

    def text_chunk(self, text: str, finish_reason: str | None = None, logprobs: Sequence[TokenLogprobs] = (),
                   text_offsets: Sequence[int] = (), index: int = 0) -> BaseModel:
        """A streamed chunk of choice `index`."""
        raise NotImplementedError

    def usage_chunk(self, usage: Usage) -> BaseModel:
        raise NotImplementedError

    def _usage_field(self) -> dict[str, None]:
        return {"usage": None} if self.include_usage else {}


class CompletionFormatter(Formatter):
    id_prefix = "cmpl-"

    def whole(self, choices: Sequence[ChoiceText], usage: Usage) -> CompletionResponse:
        out = [CompletionChoice(index=i, text=c.text, finish_reason=c.finish_reason,
                                logprobs=self._logprobs(c.logprobs, c.text_offsets))
               for i, c in enumerate(choices)]
        return CompletionResponse(id=self.id, created=self.created, model=self.model, usage=usage,
                                  choices=out)

    def text_chunk(self, text: str, finish_reason: str | None = None, logprobs: Sequence[TokenLogprobs] = (),
                   text_offsets: Sequence[int] = (), index: int = 0) -> CompletionResponse:
        choice = CompletionChoice(index=index, text=text, logprobs=self._logprobs(logprobs, text_offsets),
                                  finish_reason=finish_reason)
        return CompletionResponse(id=self.id, object="text_completion", created=self.created,
                                  model=self.model, choices=[choice], **self._usage_field())

    def usage_chunk(self, usage: Usage) -> CompletionResponse:
        return CompletionResponse(id=self.id, object="text_completion", created=self.created,
                                  model=self.model, choices=[], usage=usage)

    def _logprobs(self, entries: Sequence[TokenLogprobs],
                  offsets: Sequence[int]) -> CompletionLogprobs | None:
        return None if self.token_text is None else completion_logprobs(entries, offsets, self.token_text)


class ChatFormatter(Formatter):
    id_prefix = "chatcmpl-"

    def whole(self, choices: Sequence[ChoiceText], usage: Usage) -> ChatCompletionResponse:
        out = [ChatChoice(index=i, message=AssistantMessage(content=c.text), finish_reason=c.finish_reason,
                          logprobs=self._logprobs(c.logprobs))
               for i, c in enumerate(choices)]
        return ChatCompletionResponse(id=self.id, created=self.created, model=self.model, choices=out,
                                      usage=usage)

    def opening_chunks(self, n: int = 1) -> list[BaseModel]:
        return [self._chunk(Delta(role="assistant", content=""), None, index=i) for i in range(n)]

    def text_chunk(self, text: str, finish_reason: str | None = None, logprobs: Sequence[TokenLogprobs] = (),
                   text_offsets: Sequence[int] = (), index: int = 0) -> ChatCompletionChunk:
        delta = Delta(content=text) if text or logprobs else Delta()
        return self._chunk(delta, finish_reason, self._logprobs(logprobs) if logprobs else None, index)

    def usage_chunk(self, usage: Usage) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.id, object="chat.completion.chunk", created=self.created,
                                   model=self.model, choices=[], usage=usage)

    def _logprobs(self, entries: Sequence[TokenLogprobs]) -> ChatLogprobs | None:
        return None if self.token_text is None else chat_logprobs(entries, self.token_text)

    def _chunk(self, delta: Delta, finish_reason: str | None,
               logprobs: ChatLogprobs | None = None, index: int = 0) -> ChatCompletionChunk:
        choice = ChatChunkChoice(index=index, delta=delta, logprobs=logprobs, finish_reason=finish_reason)
        return ChatCompletionChunk(id=self.id, object="chat.completion.chunk", created=self.created,
                                   model=self.model, choices=[choice], **self._usage_field())
