"""Stop strings over streamed text: cut the output where the first stop string starts.

OpenAI semantics: the stop string itself is not returned, and `finish_reason` is "stop". Text arrives in
pieces, so a stop string may straddle two pieces; the matcher holds back the shortest tail that could still
grow into a stop string and releases it once it cannot (the same hold-back vLLM's output processor does).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple


class StopMatch(NamedTuple):
    """`text`: what may be sent now; `stopped`: a stop string was found (`text` ends right before it)."""

    text: str
    stopped: bool


class StopStringMatcher:
    """Feed text pieces in order; each `feed` returns the releasable text. After a match, the request is
    over: further input is not expected. `flush()` releases the held-back tail at the end of output."""

    def __init__(self, stops: Sequence[str]) -> None:
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        self._stops = tuple(stops)
        self._held = ""

    def feed(self, text: str) -> StopMatch:
        if not self._stops:
            return StopMatch(text, False)
        buf = self._held + text
        hits = [i for i in (buf.find(s) for s in self._stops) if i >= 0]
        if hits:
            self._held = ""
            return StopMatch(buf[: min(hits)], True)
        hold = self._partial_suffix_len(buf)
        self._held = buf[len(buf) - hold :]
        return StopMatch(buf[: len(buf) - hold], False)

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held

    def _partial_suffix_len(self, buf: str) -> int:
        """Length of the longest suffix of `buf` that is a proper prefix of some stop string."""
        longest = max(len(s) for s in self._stops) - 1
        for k in range(min(longest, len(buf)), 0, -1):
            tail = buf[-k:]
            if any(s.startswith(tail) for s in self._stops):
                return k
        return 0
