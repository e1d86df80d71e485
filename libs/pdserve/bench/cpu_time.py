"""CPU time of the processes a benchmark's requests pass through, read around a load.

A request through a stack wakes several processes (the gateway, the coordinator, a worker, the recorder,
NATS, Postgres, and the client that sends it); on a machine with few cores the time one of them waits for a
core is part of every hop after it. `CpuMeter` reads each process's user + system CPU seconds (all its
threads, from `psutil.Process.cpu_times`) before and after a load, grouped by a name per role, so a report
can say how much CPU each role spent per request and how busy the machine was meanwhile.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

import psutil

from pdserve.stack_state import StackState

# the machine's own NATS and Postgres (a stack that brings none of its own uses them): matched by name
SHARED_SERVERS = {"NATS": ("nats-server",), "Postgres": ("postgres",)}
WORKER_ROLES = ("prefill", "decode", "unified")


def _cpu_s(proc: psutil.Process) -> float | None:
    try:
        t = proc.cpu_times()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None
    return t.user + t.system


@dataclass
class CpuMeter:
    """`read()` → CPU seconds per name so far; `per_request(before, after, n)` → ms per request.

    `groups` maps a name to processes by pid, each with or without its descendants as they are at each read
    (an embedded Postgres starts a process per connection), and `by_name` a name to the process names
    (exact) of every process on the machine that counts for it, looked up at each read. A process that
    exits between two reads loses its time (none of these does during a load)."""

    groups: dict[str, list[tuple[int, bool]]] = field(default_factory=dict)
    by_name: dict[str, tuple[str, ...]] = field(default_factory=dict)

    def read(self) -> dict[str, float]:
        totals = {name: 0.0 for name in (*self.groups, *self.by_name)}
        for name, members in self.groups.items():
            for pid, with_descendants in members:
                totals[name] += sum(t for p in _tree(pid, with_descendants) if (t := _cpu_s(p)) is not None)
        if self.by_name:
            for proc in psutil.process_iter(["name"]):
                for name, patterns in self.by_name.items():
                    if proc.info["name"] in patterns and (t := _cpu_s(proc)) is not None:
                        totals[name] += t
        return totals

    @staticmethod
    def per_request(before: Mapping[str, float], after: Mapping[str, float],
                    requests: int) -> dict[str, float]:
        """CPU ms per request of each name between two reads (a name new in `after` counts whole)."""
        return {name: (after[name] - before.get(name, 0.0)) * 1e3 / max(requests, 1) for name in after}


def role_of(service: str, role: str) -> str:
    """The report's name for a stack service: every worker (prefill, decode, unified) is "workers"."""
    return "workers" if role in WORKER_ROLES else service.split("-")[0]


def stack_meter(state: StackState) -> CpuMeter:
    """A meter of a running stack's services by role, its embedded NATS and Postgres when it has them,
    else the machine's (every process of that name: other stacks on the same servers count too), and this
    process as "client"."""
    groups: dict[str, list[tuple[int, bool]]] = {}
    for name, svc in state.services.items():
        if svc.pid is not None:
            groups.setdefault(role_of(name, svc.role), []).append((svc.pid, False))
    by_name: dict[str, tuple[str, ...]] = {}
    for key, label in (("nats", "NATS"), ("postgres", "Postgres")):
        if (server := state.servers.get(key)) is not None:
            groups[label] = [(server.pid, True)]
        else:
            by_name[label] = SHARED_SERVERS[label]
    groups["client"] = [(os.getpid(), False)]
    return CpuMeter(groups, by_name)


def process_meter(pid: int, name: str) -> CpuMeter:
    """A meter of one server process (and this process as "client"): the floor's."""
    return CpuMeter({name: [(pid, False)], "client": [(os.getpid(), False)]})


def _tree(pid: int, with_descendants: bool) -> list[psutil.Process]:
    try:
        proc = psutil.Process(pid)
        return [proc, *proc.children(recursive=True)] if with_descendants else [proc]
    except psutil.NoSuchProcess:
        return []
