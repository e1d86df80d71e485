"""The coordinator's view of which workers are alive."""

from __future__ import annotations

import time

from pdserve.lifecycle.liveness import WorkerLiveness


class _NoBus:
    pass


def test_worker_silent_past_the_timeout_is_dead_and_beating_again_revives_it():
    live = WorkerLiveness(_NoBus(), timeout_s=0.05)  # type: ignore[arg-type]
    live._last_seen["w"] = time.monotonic()
    assert not live.is_dead("w")
    time.sleep(0.08)
    assert live.is_dead("w")
    live._last_seen["w"] = time.monotonic()
    assert not live.is_dead("w")


def test_worker_never_heard_of_is_dead_once_the_timeout_has_passed_since_watching_began():
    live = WorkerLiveness(_NoBus(), timeout_s=0.05)  # type: ignore[arg-type]
    assert not live.is_dead("ghost")
    time.sleep(0.08)
    assert live.is_dead("ghost")


def test_suspected_worker_is_dead_at_once_until_its_next_heartbeat():
    live = WorkerLiveness(_NoBus(), timeout_s=10.0)  # type: ignore[arg-type]
    live._last_seen["w"] = time.monotonic()
    live.suspect("w")
    assert live.is_dead("w")
    time.sleep(0.001)
    live._last_seen["w"] = time.monotonic()
    assert not live.is_dead("w")
