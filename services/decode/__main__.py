"""Decode worker: receives and verifies KV, then generates; `PDS_ROLE=unified` also prefills (colocated)."""

from pdserve.messages import Role
from pdserve.workers.runtime import run_worker

if __name__ == "__main__":
    run_worker(Role.DECODE)
