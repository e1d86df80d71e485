"""The NATS bus: typed request/reply, typed publish/subscribe, lifecycle events into JetStream.

Every command is one `Message` subclass sent with `Bus.request(subject, msg, ReplyType)`; a handler
registered with `Bus.serve(subject, RequestType, handler)` returns its reply type or raises
`RejectedError`, which travels back as a typed `Rejected` (header `Pds-Reply: rejected`) and is raised
again on the caller's side. The W3C trace context rides in the `traceparent` header both ways
(docs/architecture.md §8: no maintained nats-py instrumentation exists; manual inject/extract keeps one
trace).

Lifecycle: `await Bus.connect(settings, service)` … `await bus.close()` (drains subscriptions first).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

import nats
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout
from nats.js import JetStreamContext
from nats.js.api import RetentionPolicy, StorageType, StreamConfig
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from pydantic import ValidationError

from pdserve.config import CommonSettings
from pdserve.events import Event, Payload
from pdserve.messages import Message, RejectCode, Rejected, Subjects

log = logging.getLogger(__name__)
JETSTREAM_READY_S = 30.0  # how long a starting service waits for JetStream to answer about the stream
# An event publish: JetStream's ack takes ~0.4 ms here, so an attempt unanswered for 2 s went to a server that
# died or a stream that lost its leader; it is sent again (the event id deduplicates it) every ≤ 0.5 s, so a
# stored commit follows a stream's new leader (elected in 4-9 s after its old one dies) by at most that, for
# up to a minute of outage (a NATS server's restart) before the event is logged as lost.
EVENT_ACK_TIMEOUT_S = 2.0
EVENT_RETRY_MAX_S = 0.5
EVENT_RETRY_FOR_S = 60.0

Req = TypeVar("Req", bound=Message)
Rep = TypeVar("Rep", bound=Message)
M = TypeVar("M", bound=Message)

REPLY_HEADER = "Pds-Reply"


class RejectedError(Exception):
    """A command was refused: `code` says why (see `RejectCode`)."""

    def __init__(self, code: RejectCode, message: str) -> None:
        super().__init__(f"{code.value}: {message}")
        self.code = code
        self.message = message


class BusTimeout(Exception):
    """No reply within the deadline, or nobody serves the subject."""


def _inject_headers() -> dict[str, str]:
    headers: dict[str, str] = {}
    propagate.inject(headers)
    return headers


def extract_context(msg: Msg) -> otel_context.Context:
    """The trace context a message carried (empty when none)."""
    return propagate.extract(msg.headers or {})


class Bus:
    def __init__(self, nc: Client, js: JetStreamContext, settings: CommonSettings, service: str) -> None:
        self.nc = nc
        self.js = js
        self.settings = settings
        self.service = service
        self.subjects = Subjects(settings.subject_prefix)
        # Stamped as `worker_id` on events that name none: a coordinator's lease holder id (its events
        # record which coordinator owned the request when it emitted them, lifecycle/ownership.py).
        self.instance: str | None = None
        self._tasks: set[asyncio.Task] = set()

    @classmethod
    async def connect(cls, settings: CommonSettings, service: str) -> Bus:
        """Connect with unlimited reconnects (a NATS restart is survived) and make sure the events
        stream exists. Raises `nats.errors.NoServersError` if no server answers at start."""

        async def on_disconnect() -> None:
            log.warning("%s: disconnected from NATS", service)

        async def on_reconnect() -> None:
            log.warning("%s: reconnected to NATS", service)

        nc = await nats.connect(
            settings.nats_servers,
            **settings.nats_credentials(),
            name=service,
            max_reconnect_attempts=-1,
            reconnect_time_wait=0.5,
            ping_interval=settings.nats_ping_interval_s,
            max_outstanding_pings=2,
            connect_timeout=1,
            disconnected_cb=on_disconnect,
            reconnected_cb=on_reconnect,
        )
        js = nc.jetstream()
        bus = cls(nc, js, settings, service)
        await bus.ensure_events_stream()
        return bus

    async def ensure_events_stream(self) -> None:
        """Create the events stream if absent. File storage: a server restart keeps unrecorded events;
        `events_replicas` copies on a cluster: the loss of a server keeps them too."""
        config = StreamConfig(
            name=self.settings.events_stream,
            subjects=[self.subjects.all_events],
            retention=RetentionPolicy.LIMITS,
            storage=StorageType.FILE,
            duplicate_window=120.0,
            num_replicas=self.settings.events_replicas,
        )
        deadline = asyncio.get_running_loop().time() + JETSTREAM_READY_S
        while True:
            try:
                try:
                    await self.js.stream_info(self.settings.events_stream)
                except nats.js.errors.NotFoundError:
                    try:
                        await self.js.add_stream(config)
                    except nats.js.errors.BadRequestError:
                        pass  # created concurrently by another service
                return
            except (NatsTimeout, NoRespondersError, nats.js.errors.ServiceUnavailableError) as e:
                # A cluster still electing its meta or the stream's leader (a server just lost or
                # restarted, a cluster forming): a service starting then waits rather than exits.
                if asyncio.get_running_loop().time() > deadline:
                    raise
                log.warning("%s: JetStream not ready (%s), asking again", self.service, type(e).__name__)
                await asyncio.sleep(0.5)

    # ------------------------------------------------------------ commands

    async def request(self, subject: str, msg: Message, reply_type: type[Rep], timeout_s: float) -> Rep:
        """Send one command and wait for its reply. Raises `RejectedError` on a typed refusal and
        `BusTimeout` when no reply comes within `timeout_s` seconds or nobody serves `subject`."""
        try:
            reply = await self.nc.request(
                subject, msg.model_dump_json().encode(), timeout=timeout_s, headers=_inject_headers()
            )
        except (TimeoutError, NatsTimeout, NoRespondersError) as e:
            raise BusTimeout(f"{subject}: {type(e).__name__}") from e
        if (reply.headers or {}).get(REPLY_HEADER) == "rejected":
            rej = Rejected.model_validate_json(reply.data)
            raise RejectedError(rej.code, rej.message)
        return reply_type.model_validate_json(reply.data)

    async def serve(
        self,
        subject: str,
        request_type: type[Req],
        handler: Callable[[Req], Awaitable[Message]],
        queue: str | None = None,
    ) -> None:
        """Answer `subject` with `handler`. Each message runs in its own task under the caller's trace
        context. Invalid payloads are rejected with `RejectCode.INVALID`; unexpected exceptions with
        `RejectCode.INTERNAL` (and logged) — a caller is never left without an answer."""
        tracer = trace.get_tracer(self.service)

        async def run(msg: Msg) -> None:
            token = otel_context.attach(extract_context(msg))
            try:
                try:
                    req = request_type.model_validate_json(msg.data)
                except ValidationError as e:
                    raise RejectedError(RejectCode.INVALID, str(e)) from e
                with tracer.start_as_current_span(f"{self.service}.handle {subject.rsplit('.', 1)[-1]}"):
                    reply = await handler(req)
                await msg.respond(reply.model_dump_json().encode())
            except RejectedError as e:
                await self._reject(msg, Rejected(code=e.code, message=e.message))
            except Exception as e:  # a handler bug must still answer, or the caller hangs
                log.exception("%s: handler for %s failed", self.service, subject)
                await self._reject(msg, Rejected(code=RejectCode.INTERNAL, message=repr(e)))
            finally:
                otel_context.detach(token)

        async def on_msg(msg: Msg) -> None:
            self.spawn(run(msg))

        await self.nc.subscribe(subject, queue=queue or "", cb=on_msg)
        await self.nc.flush()

    async def _reject(self, msg: Msg, rejected: Rejected) -> None:
        if msg.reply:
            await self.nc.publish(msg.reply, rejected.model_dump_json().encode(),
                                  headers={REPLY_HEADER: "rejected"})

    # ------------------------------------------------------------ publish / subscribe

    async def publish(self, subject: str, msg: Message, *, now: bool = False) -> None:
        """Fire-and-forget on core NATS (heartbeats, token chunks). nats-py buffers a publish and its
        flusher task writes the buffer once the caller yields; `now` yields at once, so the message leaves
        before whatever the caller does next (a request's first token, ahead of the events and the reply
        its prefill handler builds after it: worker → gateway 1.0 → 0.5 ms p50 here, docs/architecture.md
        §3)."""
        await self.nc.publish(subject, msg.model_dump_json().encode(), headers=_inject_headers())
        if now:
            await asyncio.sleep(0)

    async def subscribe(self, subject: str, msg_type: type[M], handler: Callable[[M], Awaitable[None]],
                        flush: bool = True):
        """Subscribe with a typed handler; malformed messages are logged and skipped. Returns the
        subscription (call `unsubscribe()` on it). With `flush` (the default) it returns once the server
        has the subscription, so another connection may publish to it at once. Without, the caller relies
        on NATS's per-connection order instead: a message this connection publishes later (a Submit, a
        JetStream publish) reaches the server after the subscription, so whatever it causes elsewhere
        does too — one round trip less on a request's path."""

        async def on_msg(msg: Msg) -> None:
            try:
                parsed = msg_type.model_validate_json(msg.data)
            except ValidationError:
                log.warning("%s: malformed %s on %s", self.service, msg_type.__name__, msg.subject)
                return
            await handler(parsed)

        sub = await self.nc.subscribe(subject, cb=on_msg)
        if flush:
            await self.nc.flush()
        return sub

    # ------------------------------------------------------------ events

    def event(self, request_id: str, payload: Payload, worker_id: str | None = None,
              event_id: str | None = None) -> Event:
        """Build an event stamped with this service and the current span (`event_id`: see `Event.of`)."""
        ctx = trace.get_current_span().get_span_context()
        return Event.of(
            request_id, payload, service=self.service,
            worker_id=worker_id if worker_id is not None else self.instance,
            trace_id=f"{ctx.trace_id:032x}" if ctx.is_valid else None,
            span_id=f"{ctx.span_id:016x}" if ctx.is_valid else None, event_id=event_id,
        )

    async def emit(self, request_id: str, payload: Payload, worker_id: str | None = None) -> Event:
        """Publish a lifecycle event without waiting for JetStream's ack on the caller's path: the ack
        is awaited in a background task that retries until stored (dedup by event id makes retries
        safe)."""
        ev = self.event(request_id, payload, worker_id)
        self.spawn(self._publish_event(ev))
        return ev

    async def emit_stored(self, request_id: str, payload: Payload, worker_id: str | None = None,
                          event_id: str | None = None) -> Event:
        """Publish a lifecycle event and wait until JetStream has stored it (retried as `emit` does), for
        an event every later one must follow in the stream: a request's `RequestReceived` before the
        coordinator accepts it (recovery rebuilds the request from it). Costs one JetStream round trip
        (~0.4 ms here). Publishing an `event_id` JetStream holds already stores nothing (deduplication,
        within the stream's `duplicate_window`)."""
        ev = self.event(request_id, payload, worker_id, event_id)
        await self._publish_event(ev)
        return ev

    async def _publish_event(self, ev: Event) -> None:
        data = ev.model_dump_json().encode()
        deadline = asyncio.get_running_loop().time() + EVENT_RETRY_FOR_S
        attempt = 0
        while True:
            attempt += 1
            try:
                await self.js.publish(self.subjects.event(ev.request_id, ev.type), data,
                                      headers={"Nats-Msg-Id": ev.event_id}, timeout=EVENT_ACK_TIMEOUT_S)
                if attempt > 1:
                    log.info("event %s of %s stored at attempt %d", ev.type, ev.request_id, attempt)
                return
            except Exception as e:  # server restarting: back off and retry, never drop silently
                if attempt == 1:
                    log.warning("event %s of %s publish failed (%s); retrying", ev.type, ev.request_id, e)
                if asyncio.get_running_loop().time() >= deadline:
                    break
                await asyncio.sleep(min(0.05 * 2**attempt, EVENT_RETRY_MAX_S))
        log.error("event %s of %s lost after %d attempts", ev.type, ev.request_id, attempt)

    # ------------------------------------------------------------ lifecycle

    def spawn(self, coro: Awaitable) -> asyncio.Task:
        """Run `coro` in a task this bus keeps a reference to (and awaits on close)."""
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def close(self) -> None:
        """Let pending event publishes finish (bounded), then drain and close the connection."""
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=5.0)
        try:
            await self.nc.drain()
        except Exception:
            await self.nc.close()
