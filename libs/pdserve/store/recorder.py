"""The recorder: JetStream events stream → Postgres, the only writer of the event store
(docs/architecture.md §7).

A durable pull consumer on `settings.events_stream` is read in batches of up to `settings.batch_size`
events (`BatchPuller`: waiting at most `settings.fetch_timeout_s` for a first event, then `settings.linger_s`
for the batch to fill; the next batch is already requested while this one commits). Each batch is one
transaction: the events are inserted (COPY; redeliveries skipped by event_id), the events actually
inserted are folded into their requests' projection rows (`rows.project`, in stream order, one upsert
statement). Under a backlog (full batches) two batches' transactions overlap, on two connections: a
batch's COPY runs while the batch before folds and commits, and it folds only after that commit (so both
see each request's rows in stream order). Messages are acked only after their batch's commit. When
Postgres is unreachable nothing is acked: the batch is retried with exponential backoff while later
events wait in JetStream. So "Postgres holds every event published so far" is exactly "the recorder's
consumer has nothing pending or unacked" (`caught_up`).

Acks are explicit, one per message. `AckPolicy.ALL` (ack only a batch's last message) was measured and
rejected: no throughput difference within this machine's noise (docs/benchmarks/events.md), and it is
unsafe as such — a restarted recorder is delivered new events before the ones its predecessor held unacked
(those come back only after `ACK_WAIT_S`), so acking the last of its first batch would ack events never
committed; so would a delivery lost in transit during a NATS reconnect.

One file past ~300 lines on purpose: the overlap of two batches' transactions, their acks and the retry
under an outage are one protocol (`run` → `_commit_until_done` → `_write`), read best on one page.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import asyncpg
import nats.errors
import nats.js.errors
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from prometheus_client import Counter
from sqlalchemy.exc import DBAPIError, InterfaceError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from pdserve.bus import Bus
from pdserve.config import RecorderSettings
from pdserve.events import Event
from pdserve.store import event_metrics
from pdserve.store.batch import Batch, prepare
from pdserve.store.pull import BatchPuller
from pdserve.store.rows import insert_events, insert_new_events, project
from pdserve.telemetry.metrics import EVENTS_RECORDER_LAG_SECONDS

log = logging.getLogger(__name__)

DURABLE = "pdserve-recorder"
CONSUMER_CHECK_S = 5.0  # idle this long → make sure the consumer still exists
# A recorder killed mid-batch delays that batch's redelivery by this much; a batch waiting out a Postgres
# outage is kept from redelivery by `in_progress` at every retry instead.
ACK_WAIT_S = 10.0
BACKOFF_S = (0.1, 5.0)  # first and longest wait between attempts to commit a batch

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

# Postgres unreachable, restarting or shutting down, as SQLAlchemy (connecting) and asyncpg (statements on
# the driver connection) raise it: the batch waits and is retried. Any other error is a bug.
_DB_DOWN = (DBAPIError, InterfaceError, OSError, asyncio.TimeoutError, asyncpg.InterfaceError,
            asyncpg.PostgresConnectionError, asyncpg.exceptions.OperatorInterventionError)
EVENTS_PKEY = "events_pkey"  # the events table's primary key (event_id), as Postgres names it
Inserter = Callable[[asyncpg.Connection, Sequence[tuple[Any, ...]]], Awaitable[set[int]]]


class _Stopped(Exception):  # noqa: N818 (a signal, not an error)
    """The batch before was handed back (stopping) instead of committed: roll this one back too."""


class Recorder:
    """Records the events stream into Postgres.

    Lifecycle: `Recorder(bus, db, settings)`; `await run(stop)` returns once `stop` is set and the
    batch in hand is committed and acked (or, if Postgres is down, nak'ed for redelivery). The caller
    owns `bus` and `db` and closes them afterwards. Run exactly one recorder per stream
    (docs/architecture.md §7: a single writer): two folding the first events of one request concurrently
    could each upsert a row that lacks the other's events.
    """

    def __init__(
        self, bus: Bus, db: AsyncEngine, settings: RecorderSettings, durable: str = DURABLE,
        consumer_check_s: float = CONSUMER_CHECK_S,
    ) -> None:
        self.bus = bus
        self.db = db
        self.settings = settings
        self.durable = durable
        self.consumer_check_s = consumer_check_s
        self._ahead: list[Msg] = []  # the batch prepared while the two before it commit
        self._conns: list[AsyncConnection | None] = [None, None]  # held while it works (`_driver`)
        self._slot = 0  # the connection of the batch last started

    async def run(self, stop: asyncio.Event) -> None:
        """Fetch, record and ack batches until `stop` is set. Raises only on a bug (a non-database error
        while recording) or if NATS is unreachable when it starts; later NATS and Postgres outages are
        waited out.

        Pipelined: batch N+1 is pulled and parsed while batch N's transaction runs in Postgres (the two
        use different cores); if N+1 is full (a backlog), its transaction, on the other of two
        connections, starts at once: its COPY runs while N's projection and commit do; N+1 folds its
        requests' rows only once N has committed (`_write`), so commits, projections and acks stay in
        batch order."""
        await self._ensure_consumer()
        event_metrics.init_series()
        puller = BatchPuller(self.bus.nc, self.settings.events_stream, self.durable, self.settings.batch_size)
        await puller.start()
        committing: list[asyncio.Future[bool]] = []  # at most two batches in flight, oldest first
        idle_since = time.monotonic()
        try:
            while not stop.is_set():
                try:
                    msgs = await puller.next_batch(self.settings.fetch_timeout_s, self.settings.linger_s)
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
                    if all(c.done() for c in committing):
                        RECORDER_LAG.set(0.0)
                    continue
                idle_since = time.monotonic()
                batch = prepare(msgs)
                if len(committing) == 2:
                    self._ahead = msgs  # kept from redelivery too while the batches before wait out Postgres
                    await committing.pop(0)
                    self._ahead = []
                after = committing[-1] if committing and not committing[-1].done() else None
                if after is not None and len(msgs) < self.settings.batch_size:
                    # No backlog (the batch is not full): no overlap, so at serving rates the recorder
                    # works as one connection, one transaction at a time.
                    self._ahead = msgs
                    await after
                    self._ahead = []
                    after = None
                if after is not None:  # a backlog: overlap it on the other connection
                    self._slot = 1 - self._slot
                slot = self._slot
                committing.append(asyncio.ensure_future(
                    self._commit_until_done(batch, puller.buffered, stop, slot, after)))
        finally:
            for c in committing:
                await c
            await puller.stop()
            # Delivered but not taken: handed back for immediate redelivery to the next recorder.
            await self._settle(puller.buffered, NAK)
            puller.buffered.clear()
            await self._release()

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

    async def _commit_until_done(self, batch: Batch, buffered: list[Msg], stop: asyncio.Event, slot: int = 0,
                                 after: asyncio.Future[bool] | None = None) -> bool:
        """Write `batch` on connection `slot` once `after` (the batch before, if still in flight) has
        committed, retrying while Postgres is down; the messages delivered after it (`buffered`, and the
        batch prepared next) are kept from redelivery meanwhile too. True once committed; False if
        stopped first (the batch is nak'ed)."""
        msgs = batch.msgs
        delay = BACKOFF_S[0]
        while True:
            try:
                if await self._write(batch, slot, after) is None:
                    await self._settle(msgs, NAK)  # the batch before was handed back: so is this one
                    return False
                break
            except _DB_DOWN as e:
                RECORDER_LAG.set(_age_s(msgs[0]))
                log.warning("cannot commit %d events (%s: %s); retrying in %.1f s",
                            len(msgs), type(e).__name__, e, delay)
                await self._settle([*msgs, *self._ahead, *buffered], IN_PROGRESS)  # still ours
                if await _sleep_unless(stop, delay):
                    await self._settle(msgs, NAK)  # stopping: hand the batch back for redelivery now
                    return False
                delay = min(delay * 2, BACKOFF_S[1])
        last = msgs[-1].metadata
        RECORDER_LAG.set(0.0 if last.num_pending == 0 else _age_s(msgs[-1]))
        return True

    async def record(self, msgs: list[Msg]) -> int:
        """Write one batch in one transaction, then ack every message (terminate those that are not
        events). Returns the number of events newly inserted. Raises the database's error, acking nothing,
        if the transaction fails; retrying the same batch is safe (inserts are idempotent by event_id)."""
        try:
            n_new = await self._write(prepare(msgs))
        finally:
            await self._release()
        assert n_new is not None
        return n_new

    async def _driver(self, slot: int) -> asyncpg.Connection:
        """The recorder's connection `slot` (0 or 1; asyncpg's, under a pooled SQLAlchemy one): checked
        out once and kept while it works, so a batch does not pay the pool's checkout ping (three round
        trips) nor SQLAlchemy's per-statement machinery; dropped by `_release` after a database error."""
        if self._conns[slot] is None:
            self._conns[slot] = await self.db.connect()
        return (await self._conns[slot].get_raw_connection()).driver_connection

    async def _release(self, slot: int | None = None, broken: bool = False) -> None:
        """Return connection `slot` (all if None) to the pool, invalidated if `broken`."""
        for i in range(len(self._conns)) if slot is None else (slot,):
            conn, self._conns[i] = self._conns[i], None
            if conn is not None:
                with contextlib.suppress(*_DB_DOWN):
                    if broken:
                        await conn.invalidate()
                    await conn.close()

    async def _write(self, batch: Batch, slot: int = 0,
                     after: asyncio.Future[bool] | None = None) -> int | None:
        """One transaction on connection `slot`: the batch's events inserted, then — once `after` is done
        — folded into their requests' rows; acks after the commit. Returns the number of events newly
        inserted, or None (nothing committed, nothing settled) if `after` was stopped before committing."""
        try:
            pg = await self._driver(slot)
            try:
                async with pg.transaction():
                    new = await self._insert_and_project(pg, batch, insert_events, after)
            except asyncpg.UniqueViolationError as e:  # some already stored: again, skipping those
                if e.constraint_name != EVENTS_PKEY:
                    raise
                async with pg.transaction():
                    new = await self._insert_and_project(pg, batch, insert_new_events, after)
        except _Stopped:
            return None
        except _DB_DOWN:
            await self._release(slot, broken=True)
            raise
        await self._settle(batch.good, ACK)
        await self._settle(batch.bad, TERM)
        EVENTS_RECORDED.inc(len(new))
        EVENTS_REJECTED.inc(len(batch.bad))
        event_metrics.observe(e for _, e in new)
        return len(new)

    async def _insert_and_project(self, pg: asyncpg.Connection, batch: Batch, insert: Inserter,
                                  after: asyncio.Future[bool] | None) -> list[tuple[int, Event]]:
        """Insert the batch's events with `insert`; once `after` has committed, fold those inserted into
        their requests' rows. Those inserted, (stream seq, event) in stream order. Raises `_Stopped` if
        `after` did not commit."""
        inserted = await insert(pg, batch.records)
        if after is not None and not await after:
            raise _Stopped
        new = sorted((se for se in batch.events.values() if se[0] in inserted), key=lambda se: se[0])
        await project(pg, new)
        return new

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


async def recorded_floor(bus: Bus, durable: str = DURABLE) -> int:
    """The highest stream sequence at or below which Postgres holds every event: the recorder's ack floor
    (it acks only after commit). 0 if no recorder ever ran. Raises `nats.errors.Error` if NATS does not
    answer."""
    try:
        info = await bus.js.consumer_info(bus.settings.events_stream, durable)
    except nats.js.errors.NotFoundError:
        return 0
    return info.ack_floor.stream_seq if info.ack_floor else 0
