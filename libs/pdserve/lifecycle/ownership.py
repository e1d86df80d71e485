"""Which coordinator owns each request: leases in a JetStream KV bucket (docs/architecture.md §18).

Several coordinators run at once; a Submit reaches one of them (the `coordinator` queue group), and every
request is owned by exactly one coordinator at a time. The bucket (`CoordinatorSettings.lease_bucket`)
holds two kinds of keys:

- `coordinator.<holder>`: a coordinator's lease. `holder` is `<name>.<incarnation>`, new at every start.
  Its owner renews it every `lease_renew_s` with a revision-checked update (`update(last=revision)`): it
  fails if anyone else wrote the key, and that is how a taker fences a coordinator it declares dead.
- `request.<request_id>`: the holder that owns the request. Created (`create`: only if absent) by the
  coordinator that accepts the Submit, deleted by it once the request's terminal event is stored, moved to
  another holder only by a revision-checked update — so of two coordinators taking the same request, one
  wins.

A coordinator is live while its lease key exists, says `live`, and has changed within `lease_s` by the
observer's own monotonic clock (Kubernetes' leader election judges a lease the same way: by when the
observer saw it change, not by a timestamp in it, so no clocks need to agree). Every coordinator sweeps
every `lease_renew_s`: it reads the request keys, then the lease key of each owner they name (in that
order: a request key is written after its owner's lease key), marks an expired coordinator
`dead` (revision-checked: a renewal in between wins) and takes every request whose owner is not live.
A coordinator that sees its own renewal refused, or that has not renewed for `lease_s − 2·lease_renew_s`
(NATS unreachable, its loop stalled), stops acting on its requests (fenced) and starts over with a new
holder id: the old one then expires and its requests are taken over, by whoever sweeps first.

Why JetStream KV and not Postgres: the leases sit on the bus the coordinators already need to do anything
at all (a coordinator that cannot reach NATS can command no worker), they survive a Postgres outage
(the soak stops Postgres; requests keep completing), and a KV bucket is a stream, replicated as the
events stream is in a NATS cluster. Renewal is per coordinator, not per request: the requests' keys are
written twice in their life (create, delete) plus once per takeover, whatever their length.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import nats.errors
import nats.js.errors
from nats.js.api import KeyValueConfig, StorageType
from nats.js.kv import KeyValue

from pdserve.bus import Bus
from pdserve.config import CoordinatorSettings

log = logging.getLogger(__name__)

LIVE, DEAD, RELEASED = "live", "dead", "released"


@dataclass(frozen=True)
class Taken:
    """A request this coordinator now owns, taken from `from_holder` (`reason`: expired, released, or
    unowned), at lease key revision `revision`."""

    request_id: str
    from_holder: str
    reason: str
    revision: int


@dataclass
class _Seen:
    revision: int
    state: str
    since: float  # monotonic time this observer first saw `revision`


def _request_key(request_id: str) -> str:
    return f"request.{request_id}"


def _coordinator_key(holder: str) -> str:
    return f"coordinator.{holder}"


class Ownership:
    """This coordinator's lease and the requests it owns. `start()` → `claim` / `release` / `sweep` →
    `stop()`. `on_fenced` is called (awaited) when the lease is lost; the holder id is new after it."""

    def __init__(
        self,
        bus: Bus,
        settings: CoordinatorSettings,
        on_fenced: Callable[[str], Awaitable[None]] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.bus = bus
        self.settings = settings
        self.on_fenced = on_fenced
        self.clock = clock
        self.kv: KeyValue | None = None
        self.holder = ""
        self._lease_rev = 0
        self._renewed_at = 0.0
        self._revs: dict[str, int] = {}  # request id → revision of its key this coordinator wrote
        self._seen: dict[str, _Seen] = {}  # holder → what its lease key looked like, and since when
        self._renewer: asyncio.Task | None = None

    @property
    def fence_s(self) -> float:
        """How long after its last successful renewal a coordinator still acts (< `lease_s`, so it has
        stopped before any other coordinator can judge its lease expired)."""
        return self.settings.lease_s - 2 * self.settings.lease_renew_s

    def valid(self) -> bool:
        """Whether this coordinator may act on its requests now (its lease renewed within `fence_s`)."""
        return self.kv is not None and self.clock() - self._renewed_at < self.fence_s

    async def start(self, timeout_s: float = 30.0) -> None:
        """Open (or create) the bucket and take a lease under a new holder id, retried for `timeout_s`
        (a bucket just created on a cluster answers once its replicas have elected a leader). Raises
        `nats.errors.Error` when NATS does not answer by then."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                await self._open()
                await self._join()
                break
            except (nats.errors.Error, nats.js.errors.Error) as e:
                if time.monotonic() > deadline:
                    raise
                log.warning("lease bucket not ready (%s: %s); retrying", type(e).__name__, e)
                await asyncio.sleep(0.5)
        self._renewer = asyncio.ensure_future(self._renew_forever())

    async def _open(self) -> None:
        js = self.bus.js
        try:
            self.kv = await js.key_value(self.settings.lease_bucket)
        except nats.js.errors.BucketNotFoundError:
            try:
                self.kv = await js.create_key_value(KeyValueConfig(
                    bucket=self.settings.lease_bucket, history=1, storage=StorageType.FILE,
                    replicas=self.settings.events_replicas))
            except nats.js.errors.BadRequestError:  # created concurrently by another coordinator
                self.kv = await js.key_value(self.settings.lease_bucket)

    async def _join(self) -> None:
        assert self.kv is not None
        self.holder = f"{self.settings.worker_id}.{secrets.token_hex(4)}"
        self._lease_rev = await self.kv.create(_coordinator_key(self.holder), LIVE.encode())
        self._renewed_at = self.clock()
        self._revs.clear()
        self.bus.instance = self.holder
        log.info("coordinator lease %s taken", self.holder)

    async def _renew_forever(self) -> None:
        while True:
            await asyncio.sleep(self.settings.lease_renew_s)
            await self.renew()

    async def renew(self) -> None:
        """Renew the lease once; when it is refused (declared dead) or `fence_s` passed since the last
        renewal, call `on_fenced` and take a new lease under a new holder id."""
        assert self.kv is not None
        reason = None
        stale = not self.valid()  # past fence_s: its lifecycles may have stopped (LeaseLost) already
        try:
            self._lease_rev = await self.kv.update(
                _coordinator_key(self.holder), LIVE.encode(), last=self._lease_rev)
            if stale:  # renewed too late: the requests it stopped must go to a takeover, not stay with it
                reason = f"renewed only {self.clock() - self._renewed_at:.1f} s after the last renewal"
            self._renewed_at = self.clock()
        except nats.js.errors.KeyWrongLastSequenceError:
            reason = "another coordinator declared this lease dead"
        except Exception as e:  # NATS unreachable: renewed later, unless fence_s passes first
            log.warning("lease %s not renewed (%s: %s)", self.holder, type(e).__name__, e)
            if not self.valid():
                reason = f"not renewed for {self.clock() - self._renewed_at:.1f} s"
        if reason is not None:
            await self._fenced(reason)

    async def _fenced(self, reason: str) -> None:
        old = self.holder
        log.warning("coordinator lease %s lost: %s; its requests go to whoever takes them over", old, reason)
        self._renewed_at = float("-inf")  # `valid()` is False from here until the new lease
        if self.on_fenced is not None:
            await self.on_fenced(old)
        while True:
            try:
                await self._join()
                return
            except Exception as e:  # NATS still unreachable
                log.warning("new lease not taken yet (%s: %s)", type(e).__name__, e)
                await asyncio.sleep(self.settings.lease_renew_s)

    async def claim(self, request_id: str) -> str | None:
        """Own a new request: None when this coordinator now owns it, else the holder that does (another
        coordinator, or this one already). Raises `nats.errors.Error` when NATS does not answer."""
        assert self.kv is not None
        key = _request_key(request_id)
        try:
            self._revs[request_id] = await self.kv.create(key, self.holder.encode())
            return None
        except nats.js.errors.KeyWrongLastSequenceError:
            entry = await self.kv.get(key)
            return (entry.value or b"").decode()

    def owns(self, request_id: str) -> bool:
        return request_id in self._revs

    async def release(self, request_id: str) -> None:
        """The request ended (its terminal event stored): delete its key if this coordinator still owns
        it. A failure is logged; a key left behind names a holder that will expire, and the taker finds
        the request finished in the log."""
        rev = self._revs.pop(request_id, None)
        if rev is None or self.kv is None:
            return
        try:
            await self.kv.delete(_request_key(request_id), last=rev)
        except nats.js.errors.KeyWrongLastSequenceError:
            pass  # taken over meanwhile: the taker owns the key now
        except Exception as e:
            log.warning("lease of %s not released (%s: %s)", request_id, type(e).__name__, e)

    def forget(self, request_id: str) -> None:
        """Stop counting the request as this coordinator's without touching its key (handed off)."""
        self._revs.pop(request_id, None)

    async def _get(self, key: str) -> tuple[str, int] | None:
        """(value, revision) of `key`, None when absent or deleted."""
        assert self.kv is not None
        try:
            entry = await self.kv.get(key)
        except (nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError):
            return None
        return (entry.value or b"").decode(), entry.revision or 0

    async def _read(self) -> tuple[dict[str, tuple[str, int]], dict[str, tuple[str, int]]]:
        """(request id → (owner, revision), holder → (state, revision)): the request keys first, then the
        lease key of every coordinator listed or named by a request, each read after the request keys (a
        request key read names a holder whose lease key was created before it)."""
        assert self.kv is not None
        try:
            keys = await self.kv.keys()
        except nats.js.errors.NoKeysError:
            return {}, {}
        requests: dict[str, tuple[str, int]] = {}
        for key in keys:
            if key.startswith("request.") and (got := await self._get(key)) is not None:
                requests[key.removeprefix("request.")] = got
        holders = {k.removeprefix("coordinator.") for k in keys if k.startswith("coordinator.")}
        holders |= {owner for owner, _ in requests.values()}
        coordinators: dict[str, tuple[str, int]] = {}
        for holder in sorted(holders - {self.holder}):
            if (got := await self._get(_coordinator_key(holder))) is not None:
                coordinators[holder] = got
        return requests, coordinators

    def _observe(self, coordinators: dict[str, tuple[str, int]]) -> None:
        now = self.clock()
        for holder, (state, rev) in coordinators.items():
            seen = self._seen.get(holder)
            if seen is None or seen.revision != rev:
                self._seen[holder] = _Seen(rev, state, now)
        for holder in set(self._seen) - set(coordinators):
            del self._seen[holder]

    def _live(self, holder: str) -> bool:
        if holder == self.holder:
            return True
        seen = self._seen.get(holder)
        return (seen is not None and seen.state == LIVE
                and self.clock() - seen.since <= self.settings.lease_s)

    async def sweep(self) -> list[Taken]:
        """Take every request whose owner is not live (expired, dead, released, or without a lease key);
        fence expired owners first. Returns what this coordinator took. Raises `nats.errors.Error` when
        NATS does not answer."""
        assert self.kv is not None
        if not self.valid():
            return []
        requests, coordinators = await self._read()
        self._observe(coordinators)
        taken: list[Taken] = []
        for request_id, (owner, rev) in requests.items():
            if self._live(owner) or request_id in self._revs:
                continue
            seen = self._seen.get(owner)
            reason = "unowned" if seen is None else ("expired" if seen.state == LIVE else seen.state)
            if seen is not None and seen.state == LIVE and not await self._declare_dead(owner, seen):
                continue
            try:
                new_rev = await self.kv.update(_request_key(request_id), self.holder.encode(), last=rev)
            except nats.js.errors.KeyWrongLastSequenceError:
                continue  # another coordinator took it (or its owner ended it) first
            self._revs[request_id] = new_rev
            taken.append(Taken(request_id, owner, reason, new_rev))
        await self._drop_empty_leases(requests, coordinators)
        return taken

    async def _declare_dead(self, holder: str, seen: _Seen) -> bool:
        """Fence an expired coordinator: its next renewal fails. False if it renewed meanwhile (alive)."""
        assert self.kv is not None
        try:
            seen.revision = await self.kv.update(_coordinator_key(holder), DEAD.encode(), last=seen.revision)
            seen.state = DEAD
            log.warning("coordinator %s missed its renewals for %.1f s: declared dead by %s",
                        holder, self.clock() - seen.since, self.holder)
            return True
        except nats.js.errors.KeyWrongLastSequenceError:
            entry = await self.kv.get(_coordinator_key(holder))
            state = (entry.value or b"").decode()
            self._seen[holder] = _Seen(entry.revision or 0, state, self.clock())
            return state != LIVE  # another taker fenced it first: its requests may be taken

    async def _drop_empty_leases(self, requests: dict[str, tuple[str, int]],
                                 coordinators: dict[str, tuple[str, int]]) -> None:
        """Delete the lease keys of coordinators that are not live and own no request any more."""
        assert self.kv is not None
        owners = {owner for owner, _ in requests.values()}
        for holder, (_, rev) in coordinators.items():
            if holder != self.holder and holder not in owners and not self._live(holder):
                try:
                    await self.kv.delete(_coordinator_key(holder), last=rev)
                except (nats.js.errors.KeyWrongLastSequenceError, nats.errors.Error):
                    pass

    async def give_up(self) -> None:
        """A graceful stop: mark the lease released, so the others take its requests at their next sweep
        instead of after `lease_s`."""
        if self._renewer is not None:
            self._renewer.cancel()
            await asyncio.gather(self._renewer, return_exceptions=True)
        if self.kv is None:
            return
        try:
            await self.kv.update(_coordinator_key(self.holder), RELEASED.encode(), last=self._lease_rev)
        except Exception as e:
            log.warning("lease %s not given up (%s: %s); it expires instead",
                        self.holder, type(e).__name__, e)
