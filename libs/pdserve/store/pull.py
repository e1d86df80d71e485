"""Batches from a durable JetStream pull consumer, without nats-py's per-message `fetch` machinery.

nats-py's `PullSubscription.fetch(n)` waits for each of the n messages with its own `asyncio.wait_for`
(a task per message): measured here, draining a backlog that way costs ~65 µs of CPU per message and
tops out at ~14k messages/s before anything is done with them, below the recorder's 20k events/s target
(docs/benchmarks/events.md). `BatchPuller` speaks the same pull protocol directly: it publishes a pull
request (`$JS.API.CONSUMER.MSG.NEXT.<stream>.<consumer>`, `{"batch": n, "expires": ns}`) whose replies
land on one inbox subscription with a callback that only appends to a list, ~15 µs per message. Messages
arrive while the caller is busy (committing the previous batch), so receiving overlaps the database work.

At most one pull request is outstanding. It ends when its `batch` messages have arrived, when the server
answers with a status (408 on expiry; 409 when the consumer is deleted or changes; 503 when nobody serves
it), or, if that status is lost (NATS reconnecting), a little after its expiry. Messages delivered but not
yet taken wait in `buffered`: the caller acks, marks in progress or naks them like any other it holds.
"""

from __future__ import annotations

import asyncio
import json
import time

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

STATUS = "Status"  # header nats-py sets on a status message (no payload; "408", "409", "100", ...)
HEARTBEAT = "100"
EXPIRY_GRACE_S = 0.5  # a request whose expiry status never came is given up this long after its expiry


def stream_seq(msg: Msg) -> int:
    """The JetStream stream sequence of a delivered message, from its ack subject
    (`$JS.ACK.<stream>.<consumer>.<delivered>.<stream seq>.<consumer seq>.<ts ns>.<pending>`, or the
    12-token form with domain and account hash first). `msg.metadata` says the same but builds a dataclass
    and a datetime per message, a tenth of the recorder's per-event CPU when it was used for this."""
    tokens = msg.reply.split(".")
    return int(tokens[5] if len(tokens) == 9 else tokens[7])


class BatchPuller:
    """Pull batches of messages of durable consumer `durable` on `stream` over connection `nc`.

    Lifecycle: `await start()`, any number of `await next_batch(...)`, `await stop()`. The consumer must
    exist (`next_batch` returns nothing while it does not). Not safe for concurrent `next_batch` calls.
    """

    def __init__(self, nc: Client, stream: str, durable: str, batch_size: int) -> None:
        self.nc = nc
        self.batch_size = batch_size
        self.api_subject = f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{durable}"
        self.buffered: list[Msg] = []  # delivered to us, not yet handed out by `next_batch`
        self._inbox = nc.new_inbox()
        self._sub: Subscription | None = None
        self._owed = 0  # messages the outstanding request may still deliver (0: none outstanding)
        self._refused = False  # the last request was answered with an error status
        self._live_until = 0.0  # monotonic time past which the outstanding request is given up
        self._want = 1  # wake the waiter once this many messages are buffered
        self._wake = asyncio.Event()

    async def start(self) -> None:
        self._sub = await self.nc.subscribe(self._inbox, cb=self._on_msg)

    async def stop(self) -> None:
        """Let the outstanding request end (at most its expiry, a prefetch's is `timeout_s`), then
        unsubscribe; what it delivered joins `buffered`, the caller's to settle. A message still on the
        way after that is redelivered after the consumer's ack wait."""
        if self._outstanding():
            self._want = self.batch_size + 1  # wake on the request's end (status), not on a message
            self._wake.clear()
            try:
                async with asyncio.timeout(max(0.0, self._live_until - EXPIRY_GRACE_S - time.monotonic())):
                    while self._outstanding():
                        await self._wake.wait()
                        self._wake.clear()
            except TimeoutError:
                pass
        if self._sub is not None:
            await self._sub.unsubscribe()
            self._sub = None

    async def next_batch(self, timeout_s: float, linger_s: float) -> list[Msg]:
        """Up to `batch_size` messages, in delivery order: waits at most `timeout_s` for the first, then
        at most `linger_s` more for the batch to fill. Empty if none came within `timeout_s`. Raises
        `nats.errors.Error` if a pull request cannot be published (NATS reconnecting)."""
        await self._wait(1, time.monotonic() + timeout_s)
        if self.buffered:
            await self._wait(self.batch_size, time.monotonic() + linger_s)
        batch = self.buffered[:self.batch_size]
        del self.buffered[:self.batch_size]
        if batch and not self._outstanding() and len(self.buffered) < self.batch_size:
            # Prefetch: the next batch streams in (and is parsed off the socket) while the caller commits
            # this one, instead of after it — under a backlog that was a third of the recorder's time.
            await self._ask(self.batch_size - len(self.buffered), timeout_s)
        return batch

    def _outstanding(self) -> bool:
        return self._owed > 0 and time.monotonic() <= self._live_until

    async def _wait(self, want: int, until: float) -> None:
        """Until `want` messages are buffered or monotonic time `until`, keeping a request outstanding."""
        while len(self.buffered) < want and (left := until - time.monotonic()) > 0:
            if not self._outstanding():
                await self._ask(self.batch_size - len(self.buffered), left)
            self._want = want
            self._wake.clear()
            try:
                async with asyncio.timeout(min(left, self._live_until - time.monotonic())):
                    await self._wake.wait()
            except TimeoutError:
                pass
            if self._refused:  # consumer gone, JetStream unavailable: wait the call out
                self._refused = False
                await asyncio.sleep(max(0.0, until - time.monotonic()))

    async def _ask(self, n: int, expires_s: float) -> None:
        expires_s = max(expires_s, 0.01)
        self._owed = n
        self._live_until = time.monotonic() + expires_s + EXPIRY_GRACE_S
        req = {"batch": n, "expires": int(expires_s * 1e9)}
        await self.nc.publish(self.api_subject, json.dumps(req).encode(), reply=self._inbox)

    async def _on_msg(self, msg: Msg) -> None:
        status = msg.headers.get(STATUS) if msg.headers else None
        if status is None:
            self.buffered.append(msg)
            if self._owed > 0:  # (a stray message of an earlier request given up on is still kept)
                self._owed -= 1
            if len(self.buffered) >= self._want or self._owed == 0:
                self._wake.set()
        elif status != HEARTBEAT:
            # 408 (expired) and 404 end the request normally; anything else is a refusal.
            self._owed = 0
            self._refused = status not in ("404", "408")
            self._wake.set()
