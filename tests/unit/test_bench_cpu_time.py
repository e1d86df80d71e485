"""libs/pdserve/bench/cpu_time.py: CPU time per process group around a load."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from pdserve.bench.cpu_time import CpuMeter, process_meter, role_of

BUSY_S = 0.3
TICK_S = 0.02  # two of /proc's clock ticks
# spins BUSY_S of its own CPU time, then waits for its stdin to close (so it is alive at both reads)
SPIN = ("import sys, time\n"
        f"while time.process_time() < {BUSY_S}: pass\n"
        "print('spun', flush=True); sys.stdin.read()")


def test_per_request_is_each_groups_cpu_ms_between_two_reads_over_the_requests():
    got = CpuMeter.per_request({"gateway": 1.0, "NATS": 2.0}, {"gateway": 1.5, "NATS": 2.25, "new": 0.1}, 10)
    assert got == pytest.approx({"gateway": 50.0, "NATS": 25.0, "new": 10.0})


def test_every_worker_role_reads_as_workers_and_other_services_by_their_name():
    assert [role_of(s, r) for s, r in [("unified-0", "unified"), ("prefill-1", "prefill"),
                                       ("decode-0", "decode"), ("gateway", "gateway"),
                                       ("router-1", "router"), ("coordinator", "coordinator")]] == [
        "workers", "workers", "workers", "gateway", "router", "coordinator"]


def test_a_process_groups_cpu_seconds_grow_by_what_it_spent():
    proc = subprocess.Popen([sys.executable, "-c", SPIN], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    try:
        meter = process_meter(proc.pid, "server")
        assert proc.stdout is not None and proc.stdout.readline() == "spun\n"
        after = meter.read()
        assert set(after) == {"server", "client"}
        # /proc counts clock ticks (10 ms); the child's start-up (imports) adds a little
        assert BUSY_S - TICK_S <= after["server"] < BUSY_S + 0.5
        assert after["client"] == pytest.approx(sum(os.times()[:2]), abs=0.05)
    finally:
        proc.communicate("")


def test_a_group_with_descendants_counts_the_processes_started_after_the_meter():
    parent = subprocess.Popen([sys.executable, "-c",
                               "import subprocess, sys\n"
                               f"c = subprocess.Popen([sys.executable, '-c', {SPIN!r}], stdin=sys.stdin)\n"
                               "c.wait()"],
                              stdin=subprocess.PIPE, text=True)
    try:
        with_children = CpuMeter({"tree": [(parent.pid, True)]})
        alone = CpuMeter({"tree": [(parent.pid, False)]})
        deadline = time.monotonic() + 10
        while with_children.read()["tree"] < BUSY_S - TICK_S and time.monotonic() < deadline:
            time.sleep(0.05)
        assert with_children.read()["tree"] >= BUSY_S - TICK_S
        assert alone.read()["tree"] < BUSY_S - TICK_S
    finally:
        parent.communicate("")
