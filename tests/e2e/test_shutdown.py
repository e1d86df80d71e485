"""Every process of a stack stops on SIGTERM by itself, promptly and cleanly (no supervisor SIGKILL)."""

from __future__ import annotations

import signal
import subprocess

from tests.e2e.stack import Stack


def test_every_service_exits_cleanly_on_sigterm_within_ten_seconds(isolated_settings, tmp_path):
    stack = Stack(isolated_settings("shutdown"), tmp_path / "stack", model="tiny").start()
    try:
        for p in stack.procs.values():
            p.send_signal(signal.SIGTERM)
        codes = {}
        for name, p in stack.procs.items():
            try:
                codes[name] = p.wait(10)
            except subprocess.TimeoutExpired:
                codes[name] = "still running after 10 s"
        assert codes == {name: 0 for name in stack.procs}, {n: stack.log_tail(n, 5) for n in codes}
    finally:
        stack.stop()
