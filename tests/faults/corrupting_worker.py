"""A prefill worker whose KV transport corrupts chunks in flight (`python -m tests.faults.corrupting_worker`):
the production worker (`run_worker`) with its transport wrapped in a `CorruptingTransport` that flips one
byte of the 1st, (n+1)-th, ... transfer it sends, n = `$PDS_TEST_KV_CORRUPT_EVERY_N` (0 = never)."""

from __future__ import annotations

import os

from pdserve.messages import KVTransportKind, Role
from pdserve.transfer import make_transport
from pdserve.workers.runtime import run_worker
from tests.faults.corrupting import CorruptingTransport

EVERY_N_ENV = "PDS_TEST_KV_CORRUPT_EVERY_N"


def corrupting_transport(kind: KVTransportKind) -> CorruptingTransport:
    return CorruptingTransport(make_transport(kind), every_n=int(os.environ.get(EVERY_N_ENV, "0")))


if __name__ == "__main__":
    run_worker(Role.PREFILL, corrupting_transport)
