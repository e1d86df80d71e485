"""Pin the worker pools of a running stack to cores, from outside the stack (no supervisor change).

Linux affinity is per thread, so every thread of the process (/proc/<pid>/task) is pinned; threads made
later inherit their creator's mask. A worker the supervisor restarts comes back unpinned: call
`pin_pools` again before each measurement.
"""

from __future__ import annotations

import os
from pathlib import Path

from pdserve.stack_state import StackState


def pool_cores(state: StackState, ncpu: int | None = None) -> dict[str, int]:
    """Worker name → core. Disaggregated: the prefill pool on core 0, the decode pool on core 1.
    Colocated: unified worker i on core i. Cores wrap around `ncpu` (default os.cpu_count())."""
    ncpu = ncpu or os.cpu_count() or 1
    cores: dict[str, int] = {}
    unified = 0
    for name, svc in state.services.items():
        if svc.role == "prefill":
            cores[name] = 0
        elif svc.role == "decode":
            cores[name] = 1 % ncpu
        elif svc.role == "unified":
            cores[name] = unified % ncpu
            unified += 1
    return cores


def pin_process(pid: int, core: int) -> int:
    """Pin every thread of `pid` to `core`; returns the number of threads pinned. Threads that exit
    meanwhile are skipped; raises ProcessLookupError when the process is gone."""
    pinned = 0
    tasks = Path(f"/proc/{pid}/task")
    if not tasks.exists():
        raise ProcessLookupError(pid)
    for task in tasks.iterdir():
        try:
            os.sched_setaffinity(int(task.name), {core})
            pinned += 1
        except (ProcessLookupError, FileNotFoundError):
            continue
    return pinned


def pin_pools(state: StackState) -> dict[str, int]:
    """Pin each worker of `state` to its pool's core (`pool_cores`); returns worker name → core for the
    workers that were running."""
    done: dict[str, int] = {}
    for name, core in pool_cores(state).items():
        pid = state.services[name].pid
        if pid:
            try:
                pin_process(pid, core)
                done[name] = core
            except ProcessLookupError:
                continue
    return done
