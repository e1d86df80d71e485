"""Reassembly of a request's token stream from `TokenChunk` messages.

Chunks travel on core NATS (at most once, and a resumed or migrated request may resend tokens it already
sent), so the gateway orders them by `index` (position of `token_ids[0]` in the output), drops what it
already has, and keeps chunks that arrive ahead of a gap until the gap is filled. The caller decides how
long a gap may stay open (`has_gap`). `event_chunk` turns the request's journal (its stored events) into
the same chunks, which fill what core NATS lost.
"""

from __future__ import annotations

from typing import NamedTuple

from pydantic import ValidationError

from pdserve.events import Event, RequestAborted, RequestCompleted, RequestFailed, TokensCommitted
from pdserve.messages import FinishReason, TokenChunk, TokenLogprobs


class Ready(NamedTuple):
    """Output that is now contiguous: new `token_ids` in order, and the end of the stream if it came
    (`finish_reason` on completion, `error` on failure). `logprobs`: aligned with `token_ids` when the
    chunks carried them (the request asked for logprobs), else empty."""

    token_ids: list[int]
    finish_reason: FinishReason | None = None
    error: str | None = None
    logprobs: tuple[TokenLogprobs, ...] = ()

    @property
    def done(self) -> bool:
        return self.finish_reason is not None or self.error is not None


class ChunkReassembler:
    """Push chunks in arrival order; get back what became contiguous.

    An error chunk ends the stream at once (tokens after a gap no longer matter); a finishing chunk ends it
    when everything before it has arrived. After the end, further chunks are ignored.
    """

    def __init__(self) -> None:
        self.next_index = 0
        self.done = False
        self._ahead: dict[int, TokenChunk] = {}

    @property
    def has_gap(self) -> bool:
        """Chunks wait beyond a missing index."""
        return bool(self._ahead) and not self.done

    def push(self, chunk: TokenChunk) -> Ready:
        if self.done:
            return Ready([])
        self._keep(chunk)
        tokens: list[int] = []
        logprobs: list[TokenLogprobs] = []
        while not self.done:
            usable = sorted(i for i in self._ahead if i <= self.next_index)
            if not usable:
                break
            for index in usable:
                c = self._ahead.pop(index)
                new = c.token_ids[self.next_index - index :]
                tokens.extend(new)
                if c.logprobs is not None:
                    logprobs.extend(c.logprobs[self.next_index - index :])
                self.next_index += len(new)
                if c.finish_reason is not None or c.error is not None:
                    self.done = True
                    self._ahead.clear()
                    return Ready(tokens, c.finish_reason, c.error, tuple(logprobs))
        if chunk.error is not None:
            self.done = True
            self._ahead.clear()
            return Ready(tokens, None, chunk.error, tuple(logprobs))
        return Ready(tokens, logprobs=tuple(logprobs))

    def _keep(self, chunk: TokenChunk) -> None:
        """Store `chunk` unless an equal-or-better one with the same index is already held."""
        held = self._ahead.get(chunk.index)
        ends = chunk.finish_reason is not None or chunk.error is not None
        if held is None or len(chunk.token_ids) > len(held.token_ids) or (
            ends and len(chunk.token_ids) == len(held.token_ids)
        ):
            self._ahead[chunk.index] = chunk


def event_chunk(event: Event) -> TokenChunk | None:
    """What one event of the request says about its token stream, as a chunk (None: nothing)."""
    try:
        p = event.typed_payload()
    except ValidationError:
        return None
    rid = event.request_id
    match p:
        case TokensCommitted():
            return TokenChunk(request_id=rid, index=p.start_index, token_ids=tuple(p.token_ids))
        case RequestCompleted():
            return TokenChunk(request_id=rid, index=p.completion_tokens, finish_reason=p.finish_reason)
        case RequestFailed():
            return TokenChunk(request_id=rid, index=0, error=f"{p.phase}: {p.reason}")
        case RequestAborted():
            return TokenChunk(request_id=rid, index=0, error=f"aborted: {p.reason}")
    return None
