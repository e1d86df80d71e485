"""Output-token logprobs in OpenAI's two shapes: the legacy completions object and the chat `content` list.

Shapes: OpenAI API reference ("The completion object" → `choices[].logprobs`; "The chat completion object"
→ `choices[].logprobs.content`). Values come from `TokenChunk.logprobs` (the model's raw log-softmax, see
`pdserve.engine.sampler.token_logprobs`). A token's string is the tokenizer's decode of that one id, as vLLM
returns it; `bytes` is its UTF-8 encoding (for tokens that are parts of a multi-byte character the decoded
string holds U+FFFD, as in vLLM).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from pydantic import BaseModel

from pdserve.messages import TokenLogprobs

TokenText = Callable[[int], str]


class CompletionLogprobs(BaseModel):
    """/v1/completions `choices[0].logprobs`: per output token its string, logprob, the most likely
    alternatives (token string → logprob, the chosen token included, as vLLM does) and the character offset
    of its text in the completion."""

    text_offset: list[int]
    token_logprobs: list[float | None]
    tokens: list[str]
    top_logprobs: list[dict[str, float] | None]


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    """/v1/chat/completions `choices[0].logprobs`."""

    content: list[ChatTokenLogprob] | None


def completion_logprobs(entries: Sequence[TokenLogprobs], text_offsets: Sequence[int],
                        token_text: TokenText) -> CompletionLogprobs:
    """`entries[i]` is output token i's logprobs and `text_offsets[i]` where its text starts (characters from
    the start of the completion); both lists have one item per token."""
    tops = []
    for e in entries:
        top = {token_text(t): lp for t, lp in e.top}
        top.setdefault(token_text(e.token_id), e.logprob)
        tops.append(top)
    return CompletionLogprobs(text_offset=list(text_offsets), token_logprobs=[e.logprob for e in entries],
                              tokens=[token_text(e.token_id) for e in entries], top_logprobs=tops)


def chat_logprobs(entries: Sequence[TokenLogprobs], token_text: TokenText) -> ChatLogprobs:
    """One `content` item per output token, each with its `top_logprobs` (most likely first)."""

    def top(token_id: int, logprob: float) -> TopLogprob:
        text = token_text(token_id)
        return TopLogprob(token=text, logprob=logprob, bytes=list(text.encode("utf-8")))

    content = []
    for e in entries:
        chosen = top(e.token_id, e.logprob)
        content.append(ChatTokenLogprob(**chosen.model_dump(), top_logprobs=[top(t, lp) for t, lp in e.top]))
    return ChatLogprobs(content=content)
