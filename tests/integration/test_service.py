"""`run_service` with a main task (the gateway's and recorder's shape): a signal ends the task and the
process exits 0 after its cleanup; a failing task, or a vital task that ends (`until_stopped`: a worker's
engine loop), is logged and the process exits 1 (so the supervisor restarts it)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

SERVICE = textwrap.dedent(
    """
    import asyncio, sys
    from pdserve.config import CommonSettings
    from pdserve.service import MainTask, run_service, until_stopped

    async def setup(bus):
        async def engine():
            await asyncio.sleep(0.2)
            raise RuntimeError("the loop broke")

        async def run(stop):
            print("running", flush=True)
            if sys.argv[1] == "fail":
                raise RuntimeError("the loop broke")
            if sys.argv[1] == "vital":
                await until_stopped(stop, asyncio.ensure_future(engine()))
            await stop.wait()

        async def cleanup():
            print("cleaned up", flush=True)

        return MainTask(run=run, cleanup=cleanup)

    run_service("stand-in", CommonSettings(), setup)
    """
)


def _start(mode: str, settings, tmp_path) -> subprocess.Popen:
    env = {**os.environ, "PDS_NATS_URL": settings.nats_url, "PDS_VAR_DIR": str(tmp_path)}
    return subprocess.Popen([sys.executable, "-c", SERVICE, mode], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def test_a_signal_ends_the_main_task_then_cleanup_runs_and_the_process_exits_0(settings, tmp_path):
    proc = _start("wait", settings, tmp_path)
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "running"
    time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=20)
    assert proc.returncode == 0, err
    assert "cleaned up" in out


@pytest.mark.parametrize("mode", ["fail", "vital"])
def test_a_failing_main_task_is_cleaned_up_logged_and_exits_1(settings, tmp_path, mode):
    proc = _start(mode, settings, tmp_path)
    out, err = proc.communicate(timeout=20)
    assert proc.returncode == 1, err
    assert "cleaned up" in out
    assert "stand-in failed" in err and "the loop broke" in err
