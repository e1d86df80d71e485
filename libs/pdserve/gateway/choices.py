"""The `n` choices of one OpenAI request, as pdserve serves them.

Design: choice i is a request of its own — its own request id, lifecycle, trace and token stream — with the
same prompt and sampling, and, when the client gave a `seed`, seed `seed + i` (so the choices differ under
sampling yet the whole answer is reproducible; without a seed each samples independently). Choice 0 is
submitted first; the others are submitted once choice 0 has its first token, that is once its prefill is
done and the prompt's full blocks sit in the prefill worker's (or, prefilled locally, the decode
worker's) prefix cache, so the KV-aware router sends the siblings where those blocks are and their
prefills compute only the prompt's last, partial block: the n sequences share the prompt's cached blocks
and the prompt is computed once. Every sibling's lifecycle shows it (`PrefillCompleted.num_cached_tokens`).

The answer's id, `X-Request-Id` and `usage.prompt_tokens_details.cached_tokens` are choice 0's (the prompt
as it was served); `usage.prompt_tokens` counts the prompt once and `completion_tokens` sums the choices,
as OpenAI bills them. `X-PDS-Request-Ids` lists every choice's request id, in choice order (what
`GET /v1/requests/{id}` and the resume endpoint take; a resumed stream is one choice's). When one choice
fails, the answer fails and the other choices are aborted.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, Protocol

from pdserve.gateway.generation import Generation, TextDelta
from pdserve.gateway.responses import PromptTokensDetails, Usage

CHOICE_REQUEST_IDS_HEADER = "X-PDS-Request-Ids"
_END = object()


class Observer(Protocol):
    def finish(self, **kwargs: Any) -> None: ...


def choice_seed(seed: int | None, index: int) -> int | None:
    """Choice `index`'s sampling seed: `seed + index` (None stays None: independent random draws)."""
    return None if seed is None else seed + index


class Choices:
    """The generations of one answer (`gens[i]` is choice i) and their observers (spans and metrics).

    `await start()` submits choice 0 (raises its `APIError`); `deltas()` yields `(index, TextDelta)` of
    every choice as they come, submitting the others after choice 0's first delta (a sibling's refused
    submit raises its `APIError` there, the others then being aborted by the caller's `disconnect()`);
    `close()` always."""

    def __init__(self, gens: Sequence[Generation], observers: Sequence[Observer],
                 on_finish: Callable[[str], None] | None = None) -> None:
        assert gens and len(gens) == len(observers)
        self.gens = list(gens)
        self.observers = list(observers)
        self._on_finish = on_finish
        self.bus = gens[0].bus
        self._started: set[int] = set()

    @property
    def first(self) -> Generation:
        return self.gens[0]

    @property
    def ended(self) -> bool:
        return all(g.ended for g in self.gens)

    async def start(self) -> None:
        await self._start(0)

    async def _start(self, index: int) -> None:
        self._started.add(index)
        observer = self.observers[index]
        current = getattr(observer, "current", None)
        if current is None:
            await self.gens[index].start()
            return
        with current():
            await self.gens[index].start()

    async def deltas(self) -> AsyncIterator[tuple[int, TextDelta]]:
        if len(self.gens) == 1:
            async for delta in self.first.deltas():
                yield 0, delta
            return
        queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

        async def pump(index: int) -> None:
            try:
                async for delta in self.gens[index].deltas():
                    await queue.put((index, delta))
                await queue.put((index, _END))
            except Exception as e:  # handed to the consumer, which raises it
                await queue.put((index, e))

        pumps = [asyncio.ensure_future(pump(0))]
        active, siblings_started = 1, False
        try:
            while active:
                index, item = await queue.get()
                if index == 0 and not siblings_started:
                    siblings_started = True
                    for i in range(1, len(self.gens)):
                        await self._start(i)
                        pumps.append(asyncio.ensure_future(pump(i)))
                        active += 1
                if item is _END:
                    active -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield index, item
        finally:
            for task in pumps:
                task.cancel()

    async def usage(self) -> Usage:
        """The answer's usage: the prompt once, every choice's completion tokens, choice 0's cached."""
        first = await self.first.usage()
        completion = sum(g.num_output_tokens for g in self.gens)
        return Usage(prompt_tokens=first.prompt_tokens, completion_tokens=completion,
                     total_tokens=first.prompt_tokens + completion,
                     prompt_tokens_details=PromptTokensDetails(
                         cached_tokens=first.prompt_tokens_details.cached_tokens))

    def disconnect(self) -> None:
        """The client left (or the answer failed): abort every submitted choice; the rest never start."""
        for i, gen in enumerate(self.gens):
            if i in self._started:
                gen.disconnect()
            else:
                gen.ended = True

    async def close(self) -> None:
        for gen in self.gens:
            await gen.close()

    def finish(self, status: int | None, error: str | None) -> None:
        """End every choice's span and record its metrics (once; later calls do nothing), and tell
        `on_finish` each choice's request id (its answer has ended)."""
        for gen, observer in zip(self.gens, self.observers, strict=True):
            if self._on_finish is not None:
                self._on_finish(gen.request_id)
            observer.finish(num_output_tokens=gen.num_output_tokens,
                            first_token_monotonic=gen.first_token_monotonic, finish_reason=gen.finish_reason,
                            last_token_monotonic=gen.last_token_monotonic, inter_token_s=gen.inter_token_s,
                            error_status=status, error=error)
