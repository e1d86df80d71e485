"""Must-show 3 of issue 18, the denials: a worker's NATS user cannot publish a coordinator command
(`<prefix>.coord.*`), another worker's subjects or another service's event types; the gateway's cannot
reach worker subjects; nobody connects without a user; a process of one subject prefix has no rights under
another. In Postgres only the recorder's role writes `events` (and the projection); the gateway's may write
its `api_keys`. The server is a real nats-server started with `pdserve.nats_auth`'s configuration, the
database the test run's, migrated (migration 0004 makes the roles)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator

import asyncpg
import nats
import pytest
from sqlalchemy.engine import make_url

from pdserve.embedded import free_port, start_nats
from pdserve.nats_auth import NatsUser, stack_users, write_server_config
from pdserve.service_plan import role_url, service_plan


@pytest.fixture(scope="module")
def prefix(run_id: str) -> str:
    return f"t{run_id}lp"


@pytest.fixture(scope="module")
def secured_nats(tmp_path_factory, prefix: str) -> Iterator[tuple[str, dict[str, NatsUser]]]:
    """An embedded nats-server requiring the users of a disaggregated stack with a router under `prefix`."""
    tmp = tmp_path_factory.mktemp("secured-nats")
    users = stack_users([(s.name, s.role) for s in service_plan("disaggregated", n_routers=1)], prefix)
    write_server_config(tmp / "auth.conf", users)
    server = start_nats(tmp / "js", port=free_port(), config_path=tmp / "auth.conf")
    try:
        yield server.url, {u.name: u for u in users}
    finally:
        server.stop()


class Client:
    """A connection as one user that collects the errors the server reports asynchronously."""

    def __init__(self) -> None:
        self.errors: list[str] = []
        self.nc: nats.NATS | None = None

    async def connect(self, url: str, user: NatsUser) -> Client:
        async def on_error(e: Exception) -> None:
            self.errors.append(str(e))

        self.nc = await nats.connect(url, user=user.name, password=user.password, error_cb=on_error,
                                     allow_reconnect=False)
        return self

    async def publish(self, subject: str) -> bool:
        """Publish and round-trip the server; True if it reported no violation for `subject`."""
        assert self.nc is not None
        before = len(self.errors)
        await self.nc.publish(subject, b"{}")
        await self.nc.flush()
        await asyncio.sleep(0.05)  # the -ERR comes asynchronously, before the PONG in practice
        # nats-py lowercases the server's -ERR text: 'permissions violation for publish to "<subject>"'.
        return not any(subject.lower() in e for e in self.errors[before:])

    def violated(self, kind: str, subject: str) -> bool:
        return any(f"permissions violation for {kind}" in e and subject.lower() in e for e in self.errors)


@pytest.fixture
async def connect(secured_nats) -> AsyncIterator:
    url, users = secured_nats
    clients: list[Client] = []

    async def make(name: str) -> Client:
        client = await Client().connect(url, users[name])
        clients.append(client)
        return client

    yield make
    for c in clients:
        await c.nc.close()


async def test_a_worker_cannot_command_the_coordinator_or_speak_for_another_worker(connect, prefix):
    admin, worker = await connect("admin"), await connect("decode-0")
    seen: list[str] = []

    async def on_msg(msg) -> None:
        seen.append(msg.subject)

    await admin.nc.subscribe(f"{prefix}.>", cb=on_msg)
    await admin.nc.flush()
    denied = [f"{prefix}.coord.submit", f"{prefix}.coord.abort", f"{prefix}.router.route",
              f"{prefix}.heartbeat.prefill-0", f"{prefix}.kv.prefill-0", f"{prefix}.kvdigest.prefill-0",
              f"{prefix}.worker.prefill-0.finished", f"{prefix}.worker.prefill-0.prefill",
              f"{prefix}.events.r1.RequestCompleted", f"{prefix}.events.r1.RequestRouted",
              "pds.heartbeat.decode-0"]  # another prefix's subjects: none
    for subject in denied:
        assert not await worker.publish(subject), subject
    allowed = [f"{prefix}.heartbeat.decode-0", f"{prefix}.worker.decode-0.finished", f"{prefix}.tokens.r1"]
    for subject in allowed:
        assert await worker.publish(subject), (subject, worker.errors)
    await asyncio.sleep(0.2)
    assert sorted(seen) == sorted(allowed)  # nothing denied was delivered
    assert len(worker.errors) == len(denied)
    assert all(worker.violated("publish", subject) for subject in denied)


async def test_a_worker_hears_only_its_own_commands(connect, prefix):
    worker = await connect("prefill-0")
    await worker.nc.subscribe(f"{prefix}.worker.decode-0.start")
    await worker.nc.subscribe(f"{prefix}.coord.submit")
    await worker.nc.flush()
    await asyncio.sleep(0.1)
    assert worker.violated("subscription", f"{prefix}.worker.decode-0.start"), worker.errors
    assert worker.violated("subscription", f"{prefix}.coord.submit"), worker.errors


async def test_the_gateway_cannot_reach_worker_subjects(connect, prefix):
    gateway = await connect("gateway")
    for command in ("reserve", "prefill", "start", "release", "finished"):
        assert not await gateway.publish(f"{prefix}.worker.decode-0.{command}"), command
    assert not await gateway.publish(f"{prefix}.heartbeat.decode-0")
    await gateway.nc.subscribe(f"{prefix}.worker.decode-0.start")
    await gateway.nc.flush()
    await asyncio.sleep(0.1)
    assert gateway.violated("subscription", f"{prefix}.worker.decode-0.start"), gateway.errors
    assert await gateway.publish(f"{prefix}.coord.submit"), gateway.errors  # what it is for


async def test_no_user_no_connection(secured_nats):
    url, users = secured_nats
    with pytest.raises(Exception):  # noqa: B017 (nats-py raises its last connect error, whichever)
        await nats.connect(url, allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=2)
    with pytest.raises(Exception):  # noqa: B017
        await nats.connect(url, user="decode-0", password="not-its-password", allow_reconnect=False,
                           max_reconnect_attempts=0, connect_timeout=2)


async def as_role(database_url: str, role: str) -> asyncpg.Connection:
    url = make_url(role_url(database_url, role)).set(drivername="postgresql")
    return await asyncpg.connect(url.render_as_string(hide_password=False))


EVENT = ("INSERT INTO events (event_id, stream_seq, request_id, type, schema_version, ts, service, payload) "
         "VALUES (gen_random_uuid(), (random() * 1e12)::bigint, gen_random_uuid(), 'RequestFailed', 1, "
         "now(), 'x', '{}'::jsonb)")


@pytest.mark.parametrize("role", ["pdserve_reader", "pdserve_gateway"])
async def test_only_the_recorder_role_writes_the_event_store(database_url, role):
    conn = await as_role(database_url, role)
    try:
        await conn.fetchval("SELECT count(*) FROM events")  # reading is what it is for
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            await conn.execute(EVENT)
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            await conn.execute("UPDATE requests SET state = state")
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            await conn.execute("DELETE FROM events")
    finally:
        await conn.close()
    recorder = await as_role(database_url, "pdserve_recorder")
    try:
        tx = recorder.transaction()
        await tx.start()
        await recorder.execute(EVENT)
        assert await recorder.fetchval("SELECT count(*) FROM events WHERE service = 'x'") == 1
        await tx.rollback()
        with pytest.raises(asyncpg.InsufficientPrivilegeError):  # the log is append-only, even for it
            await recorder.execute("DELETE FROM events")
    finally:
        await recorder.close()


async def test_the_gateway_role_writes_its_api_keys_and_the_reader_does_not(database_url):
    insert = ("INSERT INTO api_keys (key_id, name, key_sha256, prefix) VALUES "
              "(gen_random_uuid(), 'probe', md5(random()::text), 'pds-')")
    gateway = await as_role(database_url, "pdserve_gateway")
    reader = await as_role(database_url, "pdserve_reader")
    try:
        tx = gateway.transaction()
        await tx.start()
        await gateway.execute(insert)
        await tx.rollback()
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            await reader.execute(insert)
    finally:
        await gateway.close()
        await reader.close()


STREAM = "PDS_EVENTS"  # the secured server is this module's own: the default stream name is free
DURABLE = "pdserve-recorder"


@pytest.fixture(scope="module")
async def events_stream(secured_nats, prefix) -> str:
    """The events stream with one event and the recorder's durable consumer, made as admin."""
    from nats.js.api import AckPolicy, ConsumerConfig, StreamConfig

    url, users = secured_nats
    nc = await nats.connect(url, user="admin", password=users["admin"].password)
    js = nc.jetstream()
    await js.add_stream(StreamConfig(name=STREAM, subjects=[f"{prefix}.events.>"]))
    await js.add_consumer(STREAM, ConsumerConfig(durable_name=DURABLE, ack_policy=AckPolicy.EXPLICIT,
                                                 filter_subject=f"{prefix}.events.>"))
    await js.publish(f"{prefix}.events.r1.RequestReceived", b"{}")
    await nc.close()
    return STREAM


def js_api(*tail: str) -> str:
    return ".".join(("$JS.API", *tail))


async def test_workers_and_the_router_only_publish_to_jetstream(connect, events_stream, prefix):
    for name in ("decode-0", "prefill-0", "router"):
        client = await connect(name)
        js = client.nc.jetstream(timeout=2)
        assert (await js.stream_info(STREAM)).config.name == STREAM  # Bus.connect looks it up
        denied = [js_api("CONSUMER.CREATE", STREAM, "c1", f"{prefix}.events.>"),
                  js_api("CONSUMER.CREATE", STREAM), js_api("CONSUMER.DURABLE.CREATE", STREAM, DURABLE),
                  js_api("CONSUMER.MSG.NEXT", STREAM, DURABLE),
                  js_api("CONSUMER.INFO", STREAM, DURABLE), js_api("CONSUMER.DELETE", STREAM, DURABLE),
                  js_api("STREAM.DELETE", STREAM), js_api("STREAM.PURGE", STREAM),
                  js_api("STREAM.UPDATE", STREAM), js_api("STREAM.MSG.GET", STREAM), js_api("INFO"),
                  js_api("STREAM.INFO", "ANOTHER_STREAM"), f"$JS.ACK.{STREAM}.{DURABLE}.1.1.1.0.0"]
        for subject in denied:
            assert not await client.publish(subject), (name, subject)


async def test_journal_readers_read_the_stream_but_never_the_recorders_consumer(connect, events_stream,
                                                                                 prefix):
    from nats.js.api import AckPolicy, ConsumerConfig

    for name in ("gateway", "coordinator"):
        client = await connect(name)
        js = client.nc.jetstream(timeout=2)
        # What lifecycle/journal.py's read_stream does: an ephemeral, ack-less pull consumer.
        sub = await js.pull_subscribe(f"{prefix}.events.r1.*", stream=STREAM,
                                      config=ConsumerConfig(ack_policy=AckPolicy.NONE,
                                                            inactive_threshold=5.0))
        msgs = await sub.fetch(1, timeout=2)
        assert [m.subject for m in msgs] == [f"{prefix}.events.r1.RequestReceived"]
        await sub.unsubscribe()
        info = await js.consumer_info(STREAM, DURABLE)  # the recorder's ack floor (recorded_floor)
        assert info.name == DURABLE
        denied = [js_api("CONSUMER.MSG.NEXT", STREAM, DURABLE),
                  js_api("CONSUMER.CREATE", STREAM, DURABLE, f"{prefix}.events.>"),
                  js_api("CONSUMER.DURABLE.CREATE", STREAM, DURABLE),
                  js_api("CONSUMER.DELETE", STREAM, DURABLE),
                  js_api("STREAM.DELETE", STREAM), js_api("STREAM.PURGE", STREAM),
                  f"$JS.ACK.{STREAM}.{DURABLE}.1.1.1.0.0"]
        for subject in denied:
            assert not await client.publish(subject), (name, subject)
    admin = await connect("admin")
    info = await admin.nc.jetstream().consumer_info(STREAM, DURABLE)
    assert info.num_pending == 1 and info.delivered.stream_seq == 0  # nobody took the recorder's event


async def test_only_the_recorder_consumes_the_events_stream_with_acks(connect, events_stream, prefix):
    recorder = await connect("recorder")
    js = recorder.nc.jetstream(timeout=2)
    sub = await js.pull_subscribe(f"{prefix}.events.>", durable=DURABLE, stream=STREAM)
    msgs = await sub.fetch(1, timeout=2)
    assert [m.subject for m in msgs] == [f"{prefix}.events.r1.RequestReceived"]
    await msgs[0].ack_sync(timeout=2)
    denied = [js_api("CONSUMER.CREATE", STREAM, "other", f"{prefix}.events.>"),
              js_api("CONSUMER.DURABLE.CREATE", STREAM, "other"),
              js_api("CONSUMER.MSG.NEXT", STREAM, "other"),
              js_api("CONSUMER.DELETE", STREAM, DURABLE), js_api("STREAM.DELETE", STREAM),
              js_api("STREAM.PURGE", STREAM)]
    for subject in denied:
        assert not await recorder.publish(subject), subject
    admin = await connect("admin")
    info = await admin.nc.jetstream().consumer_info(STREAM, DURABLE)
    assert info.ack_floor.stream_seq == 1 and info.num_ack_pending == 0
