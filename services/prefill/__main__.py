"""Prefill worker: runs prompts and streams their KV, layer by layer, to the reserved decode worker."""

from pdserve.messages import Role
from pdserve.workers.runtime import run_worker

if __name__ == "__main__":
    run_worker(Role.PREFILL)
