"""Operating-system process helpers shared by the supervisor and `pdserve down|status`.

A pid alone is not an identity (the kernel reuses pids), so every pid pdserve records comes with the
process's creation time, and nothing is signalled unless both still match.
"""

from __future__ import annotations

import ctypes
import signal
import sys
from typing import NamedTuple

import psutil

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


class ProcessRef(NamedTuple):
    """A process as recorded in var/run/stack.json: pid + creation time (seconds since the epoch)."""

    pid: int
    create_time: float

    @classmethod
    def of(cls, pid: int) -> ProcessRef:
        """The reference of a running process. Raises psutil.NoSuchProcess if it is gone."""
        return cls(pid, psutil.Process(pid).create_time())


def child_dies_with_parent() -> None:
    """`preexec_fn` for children: the kernel sends them SIGTERM when the parent dies, even by SIGKILL.

    Linux only (prctl PR_SET_PDEATHSIG); a no-op elsewhere, where `pdserve down` kills recorded pids.
    """
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def is_alive(ref: ProcessRef | None) -> bool:
    """True when the recorded process still runs (same pid *and* creation time) and is not a zombie."""
    if ref is None:
        return False
    try:
        proc = psutil.Process(ref.pid)
        # create_time has 10 ms resolution on Linux (jiffies); 1 s absorbs clock rounding only.
        return abs(proc.create_time() - ref.create_time) < 1.0 and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def stop_process(ref: ProcessRef, timeout_s: float = 10.0, sig: int = signal.SIGTERM) -> bool:
    """Send `sig`, wait up to `timeout_s` seconds for the process to exit, then SIGKILL it.

    Returns True if it exited on `sig`, False if it had to be killed (or was already gone: True).
    """
    if not is_alive(ref):
        return True
    proc = psutil.Process(ref.pid)
    try:
        proc.send_signal(sig)
        proc.wait(timeout_s)
        return True
    except psutil.TimeoutExpired:
        proc.kill()
        try:
            proc.wait(5.0)
        except psutil.TimeoutExpired:
            pass
        return False
    except psutil.NoSuchProcess:
        return True

