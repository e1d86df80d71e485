"""The router's own account of the work it has placed and not yet seen finish.

Heartbeats arrive every half second; a burst of requests routed between two of them would all see the
same stale load. So, like Dynamo's KV router ("slot tracker": active prefill blocks are released when the
first token signals prefill completion, active decode blocks when the request completes — Dynamo docs,
Router → Routing Concepts), the router books each request's prefill blocks on its prefill worker and its
KV blocks on its decode worker at decision time, and releases them on the request's `PrefillCompleted`
and terminal events. Bookings older than `max_age_s` are dropped, so a lost event cannot leak load.

Several routers may run at once, each answering part of the placements (the `router` queue group); each
publishes what it booked (`RouteBooked` on `pds.router.booked`) and books what the others publish
(`book_peer`), so that none of them places on a worker as if the others' placements of the last moment
were not there (docs/architecture.md §18). Every router hears every request's `PrefillCompleted` and
terminal event, so each releases every booking itself. A peer's booking heard after its request's end
(the release raced it) is not booked: the last `ENDED_MEMORY` ended request ids are remembered.

Beside those instantaneous counts it keeps a stable one for the router's balance term: per worker, an
exponentially weighted count of the decisions that placed a prefill there, over about `window` decisions
(each booking scales every count by 1 − 1/window and adds 1 to its prefill worker; the counts sum to at
most `window`). Conversations that stick to a worker keep adding to its count, so it tells where the
recent traffic went even while every queue is momentarily empty.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

ENDED_MEMORY = 4096  # ended (or prefilled) request ids remembered against late peer bookings


@dataclass
class Booking:
    prefill_worker_id: str
    prefill_blocks: int
    decode_worker_id: str
    decode_blocks: int
    booked_at: float
    prefill_done: bool = False


class ActiveLoad:
    """Per worker: uncached blocks of prefills queued or running, KV blocks held by booked requests, and
    the number of requests in either phase (all in blocks of the workers' block size)."""

    def __init__(
        self, max_age_s: float = 600.0, clock: Callable[[], float] = time.monotonic, window: int = 128
    ) -> None:
        self.max_age_s = max_age_s
        self.clock = clock
        self.window = window
        self._recent: dict[str, float] = {}
        self._bookings: dict[str, Booking] = {}
        self._prefill_blocks: dict[str, int] = {}
        self._kv_blocks: dict[str, int] = {}
        self._requests: dict[str, int] = {}
        self._ended: OrderedDict[str, bool] = OrderedDict()  # request id → ended (True) or prefilled (False)

    def _remember(self, request_id: str, ended: bool) -> None:
        self._ended[request_id] = ended or self._ended.get(request_id, False)
        self._ended.move_to_end(request_id)
        while len(self._ended) > ENDED_MEMORY:
            self._ended.popitem(last=False)

    def _apply(self, b: Booking, sign: int) -> None:
        """Add (`sign` +1) or take away (-1) what booking `b` contributes in its current phase."""
        p, d = b.prefill_worker_id, b.decode_worker_id
        if not b.prefill_done:
            self._prefill_blocks[p] = self._prefill_blocks.get(p, 0) + sign * b.prefill_blocks
        self._kv_blocks[d] = self._kv_blocks.get(d, 0) + sign * b.decode_blocks
        holders = {b.decode_worker_id} if b.prefill_done else {b.prefill_worker_id, b.decode_worker_id}
        for wid in holders:
            self._requests[wid] = self._requests.get(wid, 0) + sign

    def book(
        self,
        request_id: str,
        prefill_worker_id: str,
        prefill_blocks: int,
        decode_worker_id: str,
        decode_blocks: int,
    ) -> None:
        """Record a placement: `prefill_blocks` uncached prompt blocks to compute on the prefill worker,
        `decode_blocks` KV blocks the request will hold on the decode worker (for a local prefill both
        ids are the decode worker). Booking the same id again replaces the earlier booking (a retry)."""
        self._drop(request_id)
        b = Booking(prefill_worker_id, prefill_blocks, decode_worker_id, decode_blocks, self.clock())
        self._bookings[request_id] = b
        self._apply(b, +1)
        decay = 1.0 - 1.0 / self.window
        for wid in self._recent:
            self._recent[wid] *= decay
        self._recent[prefill_worker_id] = self._recent.get(prefill_worker_id, 0.0) + 1.0

    def book_peer(
        self,
        request_id: str,
        prefill_worker_id: str,
        prefill_blocks: int,
        decode_worker_id: str,
        decode_blocks: int,
    ) -> bool:
        """Book another router's placement (as `book`), unless the request already ended here; a request
        already prefilled is booked prefilled. Returns whether it was booked."""
        seen = self._ended.get(request_id)
        if seen:
            return False
        self.book(request_id, prefill_worker_id, prefill_blocks, decode_worker_id, decode_blocks)
        if seen is False:
            self.prefill_done(request_id)
        return True

    def booking(self, request_id: str) -> Booking | None:
        return self._bookings.get(request_id)

    def prefill_done(self, request_id: str) -> None:
        """The request's prefill finished: its prefill blocks no longer load the prefill worker."""
        self._remember(request_id, False)
        b = self._bookings.get(request_id)
        if b is not None and not b.prefill_done:
            self._apply(b, -1)
            b.prefill_done = True
            self._apply(b, +1)

    def release(self, request_id: str) -> None:
        """The request ended (completed, failed or aborted): everything booked for it is released."""
        self._remember(request_id, True)
        self._drop(request_id)

    def _drop(self, request_id: str) -> None:
        b = self._bookings.pop(request_id, None)
        if b is not None:
            self._apply(b, -1)

    def expire(self) -> int:
        """Release bookings older than `max_age_s` seconds; returns how many."""
        cutoff = self.clock() - self.max_age_s
        old = [rid for rid, b in self._bookings.items() if b.booked_at < cutoff]
        for rid in old:
            self.release(rid)
        return len(old)

    def prefill_blocks(self, worker_id: str) -> int:
        return self._prefill_blocks.get(worker_id, 0)

    def kv_blocks(self, worker_id: str) -> int:
        """KV blocks held there by booked requests that decode there (Dynamo's "active blocks"). A prefill
        worker holds a prompt's KV only until it is sent: its load is its prefill blocks."""
        return self._kv_blocks.get(worker_id, 0)

    def requests(self, worker_id: str) -> int:
        """Requests booked on the worker and not finished there (prefill pending, or decoding)."""
        return self._requests.get(worker_id, 0)

    def recent_requests(self, worker_id: str) -> float:
        """The worker's exponentially weighted count of recent prefill placements (module docstring)."""
        return self._recent.get(worker_id, 0.0)

    def __len__(self) -> int:
        return len(self._bookings)
