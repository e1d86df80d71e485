"""A prefill worker whose KV transport corrupts chunks in flight (`python -m tests.faults.corrupting_worker`):
the production worker (`run_worker`) with its transport wrapped in a `CorruptingTransport` that flips one
byte of the 1st, (n+1)-th, ... transfer it sends, n = `$PDS_TEST_KV_CORRUPT_EVERY_N` (0 = never); with
`$PDS_TEST_KV_CORRUPT_TARGET=state`, only a hybrid's state handoffs count and are corrupted (a state
tensor's first chunk), never its KV."""

from __future__ import annotations

import os

from pdserve.messages import KVTransportKind, Role
from pdserve.transfer import make_transport
from pdserve.workers.runtime import run_worker
from pdserve.workers.state_transfer import is_state_transfer
from tests.faults.corrupting import CorruptingTransport

EVERY_N_ENV = "PDS_TEST_KV_CORRUPT_EVERY_N"
TARGET_ENV = "PDS_TEST_KV_CORRUPT_TARGET"


def corrupting_transport(kind: KVTransportKind, host: str = "127.0.0.1") -> CorruptingTransport:
    only = is_state_transfer if os.environ.get(TARGET_ENV) == "state" else None
    return CorruptingTransport(make_transport(kind, host), every_n=int(os.environ.get(EVERY_N_ENV, "0")),
                               only=only)


if __name__ == "__main__":
    run_worker(Role.PREFILL, corrupting_transport)
