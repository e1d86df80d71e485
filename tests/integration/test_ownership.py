"""Request leases on a real JetStream KV bucket (lifecycle/ownership.py): one owner per request, a
takeover only after the owner's lease expired (and then by exactly one sweeper), the expired owner
fenced, a released lease taken at once."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.bus import Bus
from pdserve.config import CoordinatorSettings
from pdserve.ids import new_id
from pdserve.lifecycle.ownership import Ownership

LEASE_S, RENEW_S = 1.0, 0.1


@pytest.fixture
async def coordinators(settings):
    """Three `Ownership`s of one bucket (their own), on buses of their own; each records when it is fenced."""
    made: list[tuple[Ownership, Bus]] = []
    stream = f"{settings.events_stream}_own{new_id()[:8]}"
    fenced: dict[str, list[str]] = {}

    async def make(name: str) -> Ownership:
        s = CoordinatorSettings(**{**settings.model_dump(), "events_stream": stream, "worker_id": name,
                                   "lease_s": LEASE_S, "lease_renew_s": RENEW_S})
        bus = await Bus.connect(s, name)

        async def on_fenced(holder: str) -> None:
            fenced.setdefault(name, []).append(holder)

        own = Ownership(bus, s, on_fenced=on_fenced)
        await own.start()
        made.append((own, bus))
        return own

    yield make, fenced
    for own, bus in made:
        if own._renewer is not None:
            own._renewer.cancel()
        await bus.close()
    cleanup = await Bus.connect(settings, "cleanup")
    for name in (stream, f"KV_{stream}_LEASES"):
        try:
            await cleanup.js.delete_stream(name)
        except Exception:
            pass
    await cleanup.close()


def kill(own: Ownership) -> None:
    """What kill -9 does to a lease: it is never renewed again."""
    assert own._renewer is not None
    own._renewer.cancel()


async def test_one_owner_per_request_and_a_takeover_only_after_the_lease_expires(coordinators):
    make, fenced = coordinators
    a, b, c = await make("coordinator-a"), await make("coordinator-b"), await make("coordinator-c")
    rids = [new_id() for _ in range(6)]
    assert [await a.claim(r) for r in rids] == [None] * 6
    assert {await b.claim(r) for r in rids} == {a.holder}  # a retried Submit elsewhere: not a second owner

    assert await b.sweep() == [] and await c.sweep() == []  # a renews: nothing is taken
    await asyncio.sleep(LEASE_S * 1.5)
    assert await b.sweep() == [] and await c.sweep() == []

    kill(a)
    await asyncio.sleep(LEASE_S + 3 * RENEW_S)
    taken_b, taken_c = await asyncio.gather(b.sweep(), c.sweep())
    taken = taken_b + taken_c
    assert sorted(t.request_id for t in taken) == sorted(rids)  # each taken once, by one of the two
    assert {t.from_holder for t in taken} == {a.holder} and {t.reason for t in taken} <= {"expired", "dead"}
    assert all(b.owns(t.request_id) for t in taken_b) and all(c.owns(t.request_id) for t in taken_c)
    assert await b.sweep() == [] and await c.sweep() == []  # owned by live coordinators now

    # a was only stalled: its next renewal is refused (fenced) and it starts over under a new holder id
    old = a.holder
    await a.renew()
    assert fenced["coordinator-a"] == [old] and a.holder != old and a.valid()


async def test_a_released_lease_is_taken_at_the_next_sweep_and_a_finished_request_is_not(coordinators):
    make, _ = coordinators
    a, b = await make("coordinator-a"), await make("coordinator-b")
    running, finished = new_id(), new_id()
    assert await a.claim(running) is None and await a.claim(finished) is None
    await a.release(finished)  # its terminal event stored: the key goes
    await a.give_up()  # a graceful stop
    taken = await b.sweep()
    assert [(t.request_id, t.from_holder, t.reason) for t in taken] == [(running, a.holder, "released")]
    assert await b.claim(finished) is None  # nobody owned it any more


async def test_a_coordinator_that_cannot_renew_stops_acting_before_anyone_may_take_over(coordinators):
    make, _ = coordinators
    a = await make("coordinator-a")
    assert a.valid()
    kill(a)
    await asyncio.sleep(a.fence_s + RENEW_S)
    assert not a.valid()  # RequestContext.command refuses to send from here on
    assert a.fence_s < LEASE_S


async def test_a_renewal_that_comes_after_the_fence_still_gives_the_lease_up(coordinators):
    """Its lifecycles stopped once the lease was no longer valid (LeaseLost): the holder is abandoned
    even though nobody declared it dead, so that its requests are taken over instead of orphaned."""
    make, fenced = coordinators
    a = await make("coordinator-a")
    kill(a)
    await asyncio.sleep(a.fence_s + RENEW_S)
    old = a.holder
    await a.renew()  # the store answers again: too late
    assert fenced["coordinator-a"] == [old] and a.holder != old and a.valid()
