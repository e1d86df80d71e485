"""The recorder: JetStream events stream → Postgres, the only writer of the event store (DESIGN §4).

A durable pull consumer on `settings.events_stream` fetches batches of up to `settings.batch_size`
events (waiting at most `settings.fetch_timeout_s` for one to fill). Each batch is one transaction: the
events are inserted with `ON CONFLICT (event_id) DO NOTHING`, the events actually inserted are folded
into their requests' projection rows (`projection.apply`, in stream order). Messages are acked only
after the commit. When Postgres is unreachable nothing is acked: the batch is retried with exponential
backoff while later events wait in JetStream. So "Postgres holds every event published so far" is
exactly "the recorder's consumer has nothing pending or unacked" (`caught_up`).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import defaultdict
from collections.abc import Awaitable, Callable

import nats.errors
import nats.js.errors
import sqlalchemy as sa
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from prometheus_client import Counter
from pydantic import ValidationError
from sqlalchemy.exc import DBAPIError, InterfaceError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from pdserve.bus import Bus
from pdserve.config import RecorderSettings
from pdserve.events import Event
from pdserve.store.projection import Row, apply, fold
from pdserve.store.rows import event_row, insert_events, request_dict, row_event, upsert_requests
from pdserve.store.tables import events, requests
from pdserve.telemetry.metrics import EVENTS_RECORDER_LAG_SECONDS

log = logging.getLogger(__name__)

DURABLE = "pdserve-recorder"
CONSUMER_CHECK_S = 5.0  # idle this long → make sure the consumer still exists
# A recorder killed mid-batch delays that batch's redelivery by this much; a batch waiting out a Postgres
# outage is kept from redelivery by `in_progress` at every retry instead.
ACK_WAIT_S = 10.0
BACKOFF_S = (0.1, 5.0)  # first and longest wait between attempts to commit a batch
LINGER_S = 0.05  # longest wait for a batch to fill once its first event is in hand

# pdserve:events_recorder_lag_seconds lives with every other metric name; the recorder sets it to the age
# (seconds since JetStream stored it) of the oldest event not yet committed, 0 once caught up.
RECORDER_LAG = EVENTS_RECORDER_LAG_SECONDS
EVENTS_RECORDED = Counter(
    "pdserve:events_recorded", "Events inserted into Postgres (redelivered duplicates not counted)."
)
EVENTS_REJECTED = Counter(
    "pdserve:events_rejected", "Messages on the events stream that are not an Event envelope (terminated)."
)

_DB_DOWN = (DBAPIError, InterfaceError, OSError, asyncio.TimeoutError)


def _parse(msg: Msg) -> Event | None:
    """The event a message carries, or None if it is not an envelope whose ids are UUIDs."""
    try:
        event = Event.model_validate_json(msg.data)
        uuid.UUID(event.event_id)
        uuid.UUID(event.request_id)
    except (ValidationError, ValueError):
        return None
    return event


class Recorder:
    """Records the events stream into Postgres.

    Lifecycle: `Recorder(bus, engine, settings)`; `await run(stop)` returns once `stop` is set and the
    batch in hand is committed and acked (or, if Postgres is down, nak'ed for redelivery). The caller
    owns `bus` and `engine` and closes them afterwards. Run exactly one recorder per stream (DESIGN §4:
    a single writer): two folding the first events of one request concurrently could each upsert a row
    that lacks the other's events.
    """

    def __init__(
        self, bus: Bus, engine: AsyncEngine, settings: RecorderSettings, durable: str = DURABLE,
        consumer_check_s: float = CONSUMER_CHECK_S,
    ) -> None:
        self.bus = bus
        self.engine = engine
        self.settings = settings
        self.durable = durable
        self.consumer_check_s = consumer_check_s

    async def run(self, stop: asyncio.Event) -> None:
        """Fetch, record and ack batches until `stop` is set. Raises only on a bug (a non-database error
        while recording); NATS and Postgres outages are waited out."""
        sub = await self._subscribe()
        idle_since = time.monotonic()
        try:
            while not stop.is_set():
                try:
                    msgs = await sub.fetch(self.settings.batch_size, timeout=self.settings.fetch_timeout_s)
                except TimeoutError:  # nats' own, or asyncio's from a fetch deadline that ran out early
                    RECORDER_LAG.set(0.0)
                    if time.monotonic() - idle_since > self.consumer_check_s:
                        # A deleted stream or consumer looks exactly like an idle one to fetch().
                        idle_since = time.monotonic()
                        if not await self._consumer_exists():
                            log.warning("consumer %s is gone; subscribing again", self.durable)
                            await sub.unsubscribe()
                            sub = await self._subscribe()
                    continue
                except nats.errors.Error as e:  # NATS restarting: the client reconnects on its own
                    log.warning("fetch failed (%s); retrying", e)
                    await _sleep_unless(stop, BACKOFF_S[0])
                    continue
                idle_since = time.monotonic()
                if msgs:  # an interrupted fetch (disconnect, shutdown) returns nothing
                    msgs += await self._linger(sub, len(msgs))
                    await self._commit_until_done(msgs, stop)
        finally:
            await sub.unsubscribe()

    async def _linger(self, sub: JetStreamContext.PullSubscription, have: int) -> list[Msg]:
        """More messages for a batch that is not full, for at most `LINGER_S`: under light load each
        fetch returns one or two events, and a transaction (an fsync) per couple of events competes with
        serving for the same 2 cores; lingering bounds commits to ~1/LINGER_S per second at the price of
        at most that much lag."""
        more: list[Msg] = []
        deadline = time.monotonic() + LINGER_S
        while have + len(more) < self.settings.batch_size and (left := deadline - time.monotonic()) > 0.001:
            try:
                more += await sub.fetch(self.settings.batch_size - have - len(more), timeout=left)
            except (TimeoutError, nats.errors.Error):
                break
        return more

    async def _subscribe(self) -> JetStreamContext.PullSubscription:
        """Bind to the durable consumer, creating the stream and the consumer if absent."""
        await self.bus.ensure_events_stream()
        sub = await self.bus.js.pull_subscribe(
            self.bus.subjects.all_events, durable=self.durable, stream=self.settings.events_stream,
            config=ConsumerConfig(ack_policy=AckPolicy.EXPLICIT, deliver_policy=DeliverPolicy.ALL,
                                  ack_wait=ACK_WAIT_S, max_ack_pending=-1),
        )
        log.info("recording stream %s (consumer %s)", self.settings.events_stream, self.durable)
        return sub

    async def _consumer_exists(self) -> bool:
        try:
            await self.bus.js.consumer_info(self.settings.events_stream, self.durable)
        except nats.js.errors.NotFoundError:
            return False
        except nats.errors.Error:
            return True  # NATS unreachable: nothing to conclude; the next check asks again
        return True

    async def _commit_until_done(self, msgs: list[Msg], stop: asyncio.Event) -> None:
        delay = BACKOFF_S[0]
        while True:
            try:
                await self.record(msgs)
                break
            except _DB_DOWN as e:
                RECORDER_LAG.set(_age_s(msgs[0]))
                log.warning("cannot commit %d events (%s: %s); retrying in %.1f s",
                            len(msgs), type(e).__name__, e, delay)
                for msg in msgs:  # still ours: no redelivery while Postgres is waited out
                    await _settle(msg.in_progress)
                if await _sleep_unless(stop, delay):
                    for msg in msgs:  # stopping: hand the batch back for immediate redelivery
                        await _settle(msg.nak)
                    return
                delay = min(delay * 2, BACKOFF_S[1])
        last = msgs[-1].metadata
        RECORDER_LAG.set(0.0 if last.num_pending == 0 else _age_s(msgs[-1]))

    async def record(self, msgs: list[Msg]) -> int:
        """Write one batch in one transaction, then ack every message (terminate those that are not
        events). Returns the number of events newly inserted. Raises the database's error, acking nothing,
        if the transaction fails; retrying the same batch is safe (inserts are idempotent by event_id)."""
        batch: dict[str, tuple[int, Event]] = {}
        bad: list[Msg] = []
        for msg in msgs:
            event = _parse(msg)
            if event is None:
                bad.append(msg)
                log.error("not an event on %s (stream seq %d): %.200r", msg.subject,
                          msg.metadata.sequence.stream, msg.data)
            else:  # the same event twice in one batch (republished outside the dedup window): keep the first
                batch.setdefault(event.event_id, (msg.metadata.sequence.stream, event))
        async with self.engine.begin() as conn:
            inserted = await insert_events(conn, [event_row(e, seq) for seq, e in batch.values()])
            new = sorted((se for eid, se in batch.items() if eid in inserted), key=lambda se: se[0])
            await self._project(conn, new)
        bad_ids = {id(m) for m in bad}
        for msg in msgs:
            await _settle(msg.term if id(msg) in bad_ids else msg.ack)
        EVENTS_RECORDED.inc(len(new))
        EVENTS_REJECTED.inc(len(bad))
        return len(new)

    async def _project(self, conn: AsyncConnection, new: list[tuple[int, Event]]) -> None:
        """Fold newly inserted events, in stream order, into their requests' rows."""
        by_request: dict[str, list[tuple[int, Event]]] = defaultdict(list)
        for seq, event in new:
            by_request[event.request_id].append((seq, event))
        if not by_request:
            return
        q = sa.select(requests).where(requests.c.request_id.in_(list(by_request))).with_for_update()
        current = {str(r["request_id"]): request_dict(r) for r in (await conn.execute(q)).mappings()}
        rows: list[Row] = []
        for request_id, evs in by_request.items():
            row = current.get(request_id)
            if row is not None and evs[0][0] < row["last_stream_seq"]:
                # An older event landed after newer ones were folded (redelivery across a restart):
                # fold the request again from its whole history, which now holds it.
                row = await _fold_from_table(conn, request_id)
            else:
                for seq, event in evs:
                    row = apply(row, event, seq)
            assert row is not None
            rows.append(row)
        await upsert_requests(conn, rows)


async def _fold_from_table(conn: AsyncConnection, request_id: str) -> Row | None:
    q = sa.select(events).where(events.c.request_id == request_id).order_by(events.c.stream_seq)
    return fold(row_event(r) for r in (await conn.execute(q)).mappings())


async def _settle(how: Callable[[], Awaitable[None]]) -> None:
    """Ack, nak or term one message. A failure only means JetStream redelivers it after `ACK_WAIT_S`,
    which the idempotent insert absorbs, so it is logged, not raised."""
    try:
        await how()
    except nats.errors.Error as e:
        log.warning("could not %s a message (%s); it will be redelivered", how.__name__, e)


def _age_s(msg: Msg) -> float:
    """Seconds since JetStream stored `msg`."""
    return max(0.0, time.time() - msg.metadata.timestamp.timestamp())


async def _sleep_unless(stop: asyncio.Event, seconds: float) -> bool:
    """Sleep `seconds` or until `stop` is set; True if it was set."""
    try:
        await asyncio.wait_for(stop.wait(), seconds)
    except TimeoutError:
        return False
    return True


async def caught_up(bus: Bus, durable: str = DURABLE) -> bool:
    """True when every event published on the bus's events stream before this call is committed to
    Postgres: the recorder's consumer has no event left to deliver and none delivered but unacked. False
    too while the consumer does not exist yet (no recorder has ever run). Raises `nats.errors.Error` if
    NATS does not answer."""
    try:
        info = await bus.js.consumer_info(bus.settings.events_stream, durable)
    except nats.js.errors.NotFoundError:
        return False
    return info.num_pending == 0 and info.num_ack_pending == 0
