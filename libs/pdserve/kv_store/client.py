"""One process's client of a Mooncake Store, every call bounded in time (docs/architecture.md §16).

`mooncake.store.MooncakeDistributedStore` is synchronous C++: with its master gone a `put_from` or
`batch_is_exist` blocks ~4.4 s before failing (RPC_FAIL, -900; measured here, the GIL released meanwhile), its
`setup` retries an absent master for ~90 s holding the GIL (so a TCP connect to the master comes first), and
its `health_check` still says healthy. So each call runs on a lane of its own (one thread for reads — lookups
and gets — one for puts) and is waited for at most its timeout. A call that times out or fails with an RPC
error marks the store down for `retry_after_s`: meanwhile every call returns at once as failed, and a lane
whose last call still hangs refuses the next one (`busy`) instead of queueing behind it. The caller treats
every failure as a miss, so serving goes on from the local caches.

Metadata goes over P2PHANDSHAKE, never the master's HTTP metadata server (it binds every interface). The
client contributes no memory of its own to the store (global segment 0): the blocks live in the store's
`mooncake_client` process (`pdserve.embedded.start_mooncake`, compose's `mooncake-store`), so a worker's
restart loses none of them.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Literal, TypeVar
from urllib.parse import urlsplit

import torch

log = logging.getLogger(__name__)

T = TypeVar("T")
Lane = Literal["read", "write"]
Failure = Literal["timeout", "error", "down", "busy"]

# mooncake-store's ErrorCode (mooncake-store/include/types.h): a missing object is a miss, not a failure.
OBJECT_NOT_FOUND = -704
RPC_FAIL = -900


def master_address(url: str) -> str:
    """`mooncake://host:port` (or a bare `host:port`) → `host:port`, what `setup` takes.
    Raises ValueError for another scheme or a missing port."""
    parts = urlsplit(url if "://" in url else f"mooncake://{url}")
    if parts.scheme != "mooncake" or not parts.hostname or not parts.port:
        raise ValueError(f"a Mooncake master URL is mooncake://host:port, got {url!r}")
    return f"{parts.hostname}:{parts.port}"


@dataclass(frozen=True)
class StoreTimeouts:
    """Upper bounds in seconds. Measured here, store up: a 32-key exists ~0.1–0.3 ms, a 768 KiB block's
    get 2–4 ms and put 6–17 ms (tests/integration/test_kv_store_mooncake.py checks the bounds, not speed)."""

    setup_s: float = 5.0
    lookup_s: float = 0.25
    get_s: float = 1.0
    put_s: float = 2.0
    retry_after_s: float = 2.0


class StoreFailed(Exception):
    """A store call that did not complete: `reason` is timeout, error, down or busy."""

    def __init__(self, reason: Failure, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason: Failure = reason


class MooncakeClient:
    """Bounded calls into one Mooncake Store (master at `url`). Thread-safe. `local_host`: the address this
    client gives its peers in the P2P handshake.

    `register(buffer)` names a contiguous CPU tensor that `put_from` / `get_into` move bytes through
    (Mooncake's zero-copy path needs registered memory); registration happens at setup, which runs
    lazily on the first call and again after a failed one. Each call raises `StoreFailed` or returns
    Mooncake's result.
    """

    def __init__(self, url: str, timeouts: StoreTimeouts | None = None, *, local_host: str = "127.0.0.1",
                 local_buffer_bytes: int = 16 << 20) -> None:
        self.address = master_address(url)
        self.local_host = local_host
        self.timeouts = timeouts or StoreTimeouts()
        self._local_buffer_bytes = local_buffer_bytes
        self._lanes: dict[Lane, ThreadPoolExecutor] = {
            lane: ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"kv-store-{lane}")
            for lane in ("read", "write")
        }
        self._inflight: dict[Lane, Future | None] = {"read": None, "write": None}
        self._lock = threading.Lock()
        self._setup_lock = threading.Lock()  # one setup at a time, whichever lane needs it first
        self._store = None
        self._buffers: list[torch.Tensor] = []
        self._down_until = 0.0
        self._closed = False

    # ------------------------------------------------------------------ setup
    def register(self, buffer: torch.Tensor) -> None:
        """Register `buffer` (contiguous, CPU) for put_from / get_into, now or at the next setup."""
        if buffer.device.type != "cpu" or not buffer.is_contiguous():
            raise ValueError("a registered buffer must be contiguous CPU memory")
        with self._lock:
            self._buffers.append(buffer)
            store = self._store
        if store is not None:
            store.register_buffer(buffer.data_ptr(), buffer.numel() * buffer.element_size())

    def connect(self) -> bool:
        """Set the client up now (at most `timeouts.setup_s`): True when connected. A False is no error:
        the next call tries again (a setup that outlives its call finishes in the background)."""
        try:
            self._call("read", self.timeouts.setup_s, lambda s: None)
            return True
        except StoreFailed as e:
            log.warning("kv store %s not reachable at start (%s): will retry", self.address, e)
            return False

    def _ensure_setup(self):
        """The set-up store (called on a lane thread). Raises StoreFailed("error") if setup fails."""
        with self._setup_lock:
            return self._setup()

    def _setup(self):
        with self._lock:
            if self._store is not None:
                return self._store
            buffers = list(self._buffers)
        # `setup` holds the GIL while it retries an absent master (20 tries, ~90 s measured: every thread of
        # the worker stops, its heartbeats too); get, put and exists release it. So the master must answer
        # a TCP connect first.
        host, port = self.address.rsplit(":", 1)
        try:
            socket.create_connection((host, int(port)), timeout=min(1.0, self.timeouts.setup_s)).close()
        except OSError as e:
            raise StoreFailed("down", f"master {self.address} does not accept connections ({e})") from None
        from mooncake.store import MooncakeDistributedStore

        store = MooncakeDistributedStore()
        # global segment 0: this client lends the store no memory (module docstring)
        rc = store.setup(self.local_host, "P2PHANDSHAKE", 0, self._local_buffer_bytes, "tcp", "",
                         self.address)
        if rc != 0:
            raise StoreFailed("error", f"setup against {self.address} returned {rc}")
        for b in buffers:
            if (rc := store.register_buffer(b.data_ptr(), b.numel() * b.element_size())) != 0:
                raise StoreFailed("error", f"register_buffer returned {rc}")
        with self._lock:
            self._store = store
        log.info("kv store: connected to mooncake master %s", self.address)
        return store

    # ------------------------------------------------------------------ bounded calls
    def _call(self, lane: Lane, timeout_s: float, fn: Callable[[object], T]) -> T:
        if self._closed:
            raise StoreFailed("down", "client closed")
        now = time.monotonic()
        if now < self._down_until:
            raise StoreFailed("down", f"retrying in {self._down_until - now:.1f} s")
        with self._lock:
            prev = self._inflight[lane]
            if prev is not None and not prev.done():
                raise StoreFailed("busy", f"the {lane} lane's previous call has not returned")

            def run() -> T:
                return fn(self._ensure_setup())

            fut = self._lanes[lane].submit(run)
            self._inflight[lane] = fut
        try:
            return fut.result(timeout=timeout_s)
        except FutureTimeout:
            self._mark_down(f"{lane} call exceeded {timeout_s} s")
            raise StoreFailed("timeout", f"{lane} call exceeded {timeout_s} s") from None
        except StoreFailed as e:
            self._mark_down(str(e))
            raise
        except Exception as e:  # the binding raises nothing documented; anything else is an error too
            self._mark_down(repr(e))
            raise StoreFailed("error", repr(e)) from e

    def _mark_down(self, why: str) -> None:
        if time.monotonic() >= self._down_until:
            log.warning("kv store %s unavailable (%s): serving from local caches for %.1f s",
                        self.address, why, self.timeouts.retry_after_s)
        self._down_until = time.monotonic() + self.timeouts.retry_after_s

    def _rc(self, rc: int, what: str) -> int:
        if rc == RPC_FAIL:
            self._mark_down(f"{what}: RPC_FAIL")
            raise StoreFailed("error", f"{what}: RPC_FAIL ({rc})")
        return rc

    def exists(self, keys: list[str]) -> list[bool]:
        """Which of `keys` the store holds. Raises StoreFailed."""
        res = self._call("read", self.timeouts.lookup_s, lambda s: s.batch_is_exist(keys))
        if any(r < 0 for r in res):
            self._mark_down(f"batch_is_exist returned {min(res)}")
            raise StoreFailed("error", f"batch_is_exist returned {min(res)}")
        return [r == 1 for r in res]

    def get_into(self, key: str, ptr: int, size: int) -> int:
        """Copy the object under `key` into registered memory at `ptr` (at most `size` bytes). Returns its
        length, or a negative Mooncake error code for a miss (OBJECT_NOT_FOUND) or a too-small buffer.
        Raises StoreFailed."""
        return self._rc(self._call("read", self.timeouts.get_s, lambda s: s.get_into(key, ptr, size)), "get")

    def put_from(self, key: str, ptr: int, size: int) -> int:
        """Store `size` bytes of registered memory at `ptr` under `key`. Returns 0 or a negative Mooncake
        error code (a full store, -200 for a segment too small). Raises StoreFailed."""
        return self._rc(self._call("write", self.timeouts.put_s, lambda s: s.put_from(key, ptr, size)), "put")

    def remove(self, key: str) -> None:
        """Drop `key` (a corrupt copy), best effort: never raises, never waits for the store."""
        with self._lock:
            store = self._store
        if store is not None and not self._closed:
            self._lanes["write"].submit(store.remove, key, True)

    def close(self) -> None:
        """Stop both lanes (a hung call is abandoned) and close the Mooncake client."""
        self._closed = True
        for lane in self._lanes.values():
            lane.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            store, self._store = self._store, None
        if store is not None:
            threading.Thread(target=store.close, daemon=True, name="kv-store-close").start()
