"""`pdserve up`'s readiness check against a real NATS: which workers heartbeat within the window."""

from __future__ import annotations

import asyncio
import threading

import nats

from pdserve.cli.readiness import heartbeating
from pdserve.messages import Subjects


def test_heartbeating_names_the_workers_heard_and_nobody_without_nats(nats_url: str, run_id: str) -> None:
    subjects = Subjects(f"t{run_id}ready")
    stop = threading.Event()

    async def beat() -> None:  # one worker, "w1", beating every 50 ms; "w2" never does
        nc = await nats.connect(nats_url)
        while not stop.is_set():
            await nc.publish(subjects.heartbeat("w1"), b"{}")
            await asyncio.sleep(0.05)
        await nc.close()

    beater = threading.Thread(target=lambda: asyncio.run(beat()))
    beater.start()
    try:
        assert heartbeating(nats_url, subjects, {"w1", "w2"}, window_s=0.5) == {"w1"}
    finally:
        stop.set()
        beater.join()
    assert heartbeating("nats://127.0.0.1:1", subjects, {"w1"}, window_s=0.2) == set()
