"""The recorder: JetStream events stream → Postgres, the only writer of the event store (DESIGN §4).

A durable pull consumer on `settings.events_stream` is read in batches of up to `settings.batch_size`
events (`BatchPuller`: waiting at most `settings.fetch_timeout_s` for a first event, then `LINGER_S` for the
batch to fill; the next batch is already requested while this one commits). Each batch is one
transaction: the events are inserted (COPY; redeliveries skipped by event_id), the events actually
inserted are folded into their requests' projection rows (`projection.apply`, in stream order, one upsert
per request). Messages are acked only after the commit. When Postgres is unreachable nothing is acked: the
batch is retried with exponential backoff while later events wait in JetStream. So "Postgres holds every
event published so far" is exactly "the recorder's consumer has nothing pending or unacked" (`caught_up`).

Acks are explicit, one per message. `AckPolicy.ALL` (ack only a batch's last message) was measured and
rejected: no throughput difference within this machine's noise (docs/benchmarks/events.md), and it is
unsafe as such — a restarted recorder is delivered new events before the ones its predecessor held unacked
(those come back only after `ACK_WAIT_S`), so acking the last of its first batch would ack events never
committed; so would a delivery lost in transit during a NATS reconnect.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
import uuid
from collections import defaultdict

import nats.errors
import nats.js.errors
import sqlalchemy as sa
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from prometheus_client import Counter
from pydantic import TypeAdapter, ValidationError
from sqlalchemy.exc import DBAPIError, InterfaceError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from pdserve.bus import Bus
from pdserve.config import RecorderSettings
from pdserve.events import Event
from pdserve.store.projection import Row, apply, fold
from pdserve.store.pull import BatchPuller, stream_seq
from pdserve.store.rows import insert_events, request_dict, row_event, upsert_requests
from pdserve.store.tables import events, requests
from pdserve.telemetry.metrics import EVENTS_RECORDER_LAG_SECONDS

log = logging.getLogger(__name__)

DURABLE = "pdserve-recorder"
CONSUMER_CHECK_S = 5.0  # idle this long → make sure the consumer still exists
# A recorder killed mid-batch delays that batch's redelivery by this much; a batch waiting out a Postgres
# outage is kept from redelivery by `in_progress` at every retry instead.
ACK_WAIT_S = 10.0
BACKOFF_S = (0.1, 5.0)  # first and longest wait between attempts to commit a batch
# Longest wait for a batch to fill once its first event is in hand: under light load a pull returns one or
# two events, and a transaction (an fsync) per couple of events competes with serving for the same 2
# cores; lingering bounds commits to ~1/LINGER_S per second at the price of at most that much lag.
LINGER_S = 0.05

# pdserve:events_recorder_lag_seconds lives with every other metric name; the recorder sets it to the age
# (seconds since JetStream stored it) of the oldest event not yet committed, 0 once caught up.
RECORDER_LAG = EVENTS_RECORDER_LAG_SECONDS
EVENTS_RECORDED = Counter(
    "pdserve:events_recorded", "Events inserted into Postgres (redelivered duplicates not counted)."
)
EVENTS_REJECTED = Counter(
    "pdserve:events_rejected", "Messages on the events stream that are not an Event envelope (terminated)."
)

# JetStream ack bodies, as nats-py's `Msg.Ack` spells them.
ACK, NAK, TERM, IN_PROGRESS = b"+ACK", b"-NAK", b"+TERM", b"+WPI"

_CANONICAL_UUID = re.compile(r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}")
_BATCH = TypeAdapter(list[Event])
MSG_ID = "Nats-Msg-Id"
_DB_DOWN = (DBAPIError, InterfaceError, OSError, asyncio.TimeoutError)


def _is_uuid(s: str) -> bool:
    """Whether Postgres's uuid type takes `s` (the canonical form checked by regex, any other by `UUID`):
    one bad id would otherwise fail the whole batch's COPY."""
    if _CANONICAL_UUID.fullmatch(s):
        return True
    try:
        uuid.UUID(s)
    except ValueError:
        return False
    return True


def _parse(msg: Msg) -> Event | None:
    """The event a message carries, or None if it is not an envelope whose ids are UUIDs."""
    try:
        event = Event.model_validate_json(msg.data)
    except ValidationError:
        return None
    return event if _is_uuid(event.event_id) and _is_uuid(event.request_id) else None


def _parse_all(msgs: list[Msg]) -> list[Event | None]:
    """`_parse` of each message. Validated as one JSON array first (one pydantic-core call: ~3× faster
    per event than a call per message, measured on these envelopes); that result is used only if it
    provably lines up with the messages — as many events as messages, each message's `Nats-Msg-Id` its
    event's id (as `Bus.emit` publishes them) — and otherwise, or on any invalid message, per message."""
    try:
        events = _BATCH.validate_json(b"[" + b",".join(m.data for m in msgs) + b"]")
    except ValidationError:
        return [_parse(m) for m in msgs]
    if len(events) != len(msgs) or any((m.headers or {}).get(MSG_ID) != e.event_id
                                       for m, e in zip(msgs, events, strict=True)):
        return [_parse(m) for m in msgs]
    return [e if _is_uuid(e.event_id) and _is_uuid(e.request_id) else None for e in events]


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
        while recording) or if NATS is unreachable when it starts; later NATS and Postgres outages are
        waited out."""
        await self._ensure_consumer()
        puller = BatchPuller(self.bus.nc, self.settings.events_stream, self.durable, self.settings.batch_size)
        await puller.start()
        idle_since = time.monotonic()
        try:
            while not stop.is_set():
                try:
                    msgs = await puller.next_batch(self.settings.fetch_timeout_s, LINGER_S)
                    if not msgs and time.monotonic() - idle_since > self.consumer_check_s:
                        # A deleted stream or consumer looks exactly like an idle one to a pull.
                        idle_since = time.monotonic()
                        if not await self._consumer_exists():
                            log.warning("consumer %s is gone; creating it again", self.durable)
                            await self._ensure_consumer()
                except nats.errors.Error as e:  # NATS restarting: the client reconnects on its own
                    log.warning("fetch failed (%s); retrying", e)
                    await _sleep_unless(stop, BACKOFF_S[0])
                    continue
                if not msgs:
                    RECORDER_LAG.set(0.0)
                    continue
                idle_since = time.monotonic()
                await self._commit_until_done(msgs, puller.buffered, stop)
        finally:
            await puller.stop()
            # Delivered but not taken: handed back for immediate redelivery to the next recorder.
            await self._settle(puller.buffered, NAK)
            puller.buffered.clear()

    async def _ensure_consumer(self) -> None:
        """Create the stream and the durable consumer if absent. Raises `nats.errors.Error` if NATS does
        not answer."""
        await self.bus.ensure_events_stream()
        if not await self._consumer_exists():
            config = ConsumerConfig(durable_name=self.durable, filter_subject=self.bus.subjects.all_events,
                                    ack_policy=AckPolicy.EXPLICIT, deliver_policy=DeliverPolicy.ALL,
                                    ack_wait=ACK_WAIT_S, max_ack_pending=-1)
            try:
                await self.bus.js.add_consumer(self.settings.events_stream, config)
            except nats.js.errors.BadRequestError:
                pass  # created concurrently
        log.info("recording stream %s (consumer %s)", self.settings.events_stream, self.durable)

    async def _consumer_exists(self) -> bool:
        try:
            await self.bus.js.consumer_info(self.settings.events_stream, self.durable)
        except nats.js.errors.NotFoundError:
            return False
        except nats.errors.Error:
            return True  # NATS unreachable: nothing to conclude; the next check asks again
        return True

    async def _commit_until_done(self, msgs: list[Msg], buffered: list[Msg], stop: asyncio.Event) -> None:
        """Record `msgs`, retrying while Postgres is down; `buffered` (delivered, not yet taken) is kept
        from redelivery meanwhile too."""
        delay = BACKOFF_S[0]
        while True:
            try:
                await self.record(msgs)
                break
            except _DB_DOWN as e:
                RECORDER_LAG.set(_age_s(msgs[0]))
                log.warning("cannot commit %d events (%s: %s); retrying in %.1f s",
                            len(msgs), type(e).__name__, e, delay)
                await self._settle([*msgs, *buffered], IN_PROGRESS)  # still ours: no redelivery
                if await _sleep_unless(stop, delay):
                    await self._settle(msgs, NAK)  # stopping: hand the batch back for redelivery now
                    return
                delay = min(delay * 2, BACKOFF_S[1])
        last = msgs[-1].metadata
        RECORDER_LAG.set(0.0 if last.num_pending == 0 else _age_s(msgs[-1]))

    async def record(self, msgs: list[Msg]) -> int:
        """Write one batch in one transaction, then ack every message (terminate those that are not
        events). Returns the number of events newly inserted. Raises the database's error, acking nothing,
        if the transaction fails; retrying the same batch is safe (inserts are idempotent by event_id)."""
        batch: dict[str, tuple[int, Event]] = {}
        good: list[Msg] = []
        bad: list[Msg] = []
        for msg, event in zip(msgs, _parse_all(msgs), strict=True):
            if event is None:
                bad.append(msg)
                log.error("not an event on %s (stream seq %d): %.200r", msg.subject,
                          msg.metadata.sequence.stream, msg.data)
            else:  # the same event twice in one batch (republished outside the dedup window): keep the first
                good.append(msg)
                batch.setdefault(event.event_id, (stream_seq(msg), event))
        async with self.engine.begin() as conn:
            inserted = await insert_events(conn, list(batch.values()))
            new = sorted((se for eid, se in batch.items() if eid in inserted), key=lambda se: se[0])
            await self._project(conn, new)
        await self._settle(good, ACK)
        await self._settle(bad, TERM)
        EVENTS_RECORDED.inc(len(new))
        EVENTS_REJECTED.inc(len(bad))
        return len(new)

    async def _settle(self, msgs: list[Msg], how: bytes) -> None:
        """Ack, nak, term or mark in progress each message: one publish to its reply subject (what
        `Msg.ack()` and co. do, without their per-call checks). A failure only means JetStream
        redelivers after `ACK_WAIT_S`, which the idempotent insert absorbs: logged, not raised."""
        try:
            for msg in msgs:
                await self.bus.nc.publish(msg.reply, how)
        except nats.errors.Error as e:
            log.warning("could not settle %d messages with %s (%s); they will be redelivered",
                        len(msgs), how.decode(), e)

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
