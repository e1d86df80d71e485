"""Decode full under load (tiny model): a long request fills a small decode worker, then a burst of
requests arrives at once against an admission queue of 2. Every request ends — completed equal to the
greedy oracle, refused with 503 and Retry-After, or failed with a reason — none hangs; the coordinator's
admission queue (its `pdserve:admission_queue_length` gauge, sampled every 10 ms while the load runs) fills
to its bound and never past it; no process's resident memory grows with the rounds served; every worker's
free KV returns to its start value.
"""

from __future__ import annotations

import asyncio
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from pdserve.embedded import free_port
from pdserve.events import TERMINAL_TYPES
from tests.faults.conftest import EnvStack, open_store
from tests.faults.load import (
    Result,
    check_results,
    expected_outputs,
    recorded_lifecycles,
    run_load,
    stream_one,
)
from tests.faults.test_transfer_faults import FreeKV

pytestmark = [pytest.mark.faults, pytest.mark.stack]

MAX_WAITING = 2
DECODE_CAPACITY_TOKENS = 1024  # 64 blocks of 16 tokens
# The filler holds 48 blocks from its reservation on and grows to 63 while it decodes: a burst request
# (21 blocks) never fits beside it, so the whole burst meets a full decode worker at once.
FILLER_TOKENS, FILLER_MAX_TOKENS = 750, 250
BURST, BURST_MAX_TOKENS = 24, 16
ROUNDS = 3  # the 1st warms every process up; resident memory is compared between the 1st and the last
# Measured growth from the 1st to the 3rd round: under 5 MiB (decode-0), under 1 MiB elsewhere. The bound
# catches whatever keeps 0.5 MiB or more per request, served or refused (50 requests in two rounds).
RSS_GROWTH_BOUND_MIB = 24


def filler_prompt(round_: int) -> str:
    return f"{round_} filler:" + " hello" * FILLER_TOKENS


def burst_prompt(round_: int, i: int) -> str:
    """~325 tokens (21 blocks), unique from its first token on: no prefix cache shares blocks."""
    return f"{round_}.{i}:" + " world" * 320


@pytest.fixture(scope="module")
def full_stack(isolated_settings, tmp_path_factory) -> Iterator[EnvStack]:
    metrics_port = free_port()
    stack = EnvStack(
        isolated_settings("decodefull"), tmp_path_factory.mktemp("decodefull-stack"),
        {"PDS_MAX_WAITING_REQUESTS": str(MAX_WAITING)},
        {"decode-0": {"PDS_KV_CAPACITY_TOKENS": str(DECODE_CAPACITY_TOKENS)},
         "coordinator": {"PDS_METRICS_PORT": str(metrics_port)}},
        model="tiny")
    stack.coordinator_metrics = f"http://127.0.0.1:{metrics_port}/metrics"
    try:
        yield stack.start()
    finally:
        stack.stop()


class QueueSampler:
    """Reads the coordinator's admission queue gauge every 10 ms on a thread of its own; `peak` is the
    largest value seen. Leaving the context raises what stopped the sampling, if anything did."""

    PATTERN = re.compile(r"^pdserve:admission_queue_length (\S+)$", re.M)

    def __init__(self, url: str) -> None:
        self.url = url
        self.peak = -1.0
        self.error: Exception | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> QueueSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(5)
        if self.error is not None:
            raise AssertionError(f"sampling {self.url} failed") from self.error

    def _run(self) -> None:
        try:
            with httpx.Client(timeout=2) as client:
                while not self._stop.is_set():
                    m = self.PATTERN.search(client.get(self.url).text)
                    assert m, "the coordinator exports no pdserve:admission_queue_length"
                    self.peak = max(self.peak, float(m.group(1)))
                    time.sleep(0.01)
        except Exception as e:  # raised again in the test's thread by __exit__
            self.error = e


def rss_mib(pid: int) -> float:
    """Resident set size of process `pid` (VmRSS of /proc/<pid>/status), MiB."""
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"^VmRSS:\s+(\d+) kB", status, re.M).group(1)) / 1024


def _filled_decode_then_burst(url: str, round_: int) -> tuple[Result, list[Result]]:
    """Stream the filler; once its first token arrived (it decodes: the decode worker is full), send the
    burst all at once; return (filler, burst) once every one ended."""
    decoding = threading.Event()
    filler: list[Result] = []
    thread = threading.Thread(target=lambda: filler.append(stream_one(
        url, filler_prompt(round_), FILLER_MAX_TOKENS, lambda _: decoding.set())), daemon=True)
    thread.start()
    assert decoding.wait(60), "the filler never started decoding"
    burst = run_load(url, [burst_prompt(round_, i) for i in range(BURST)], BURST_MAX_TOKENS)
    thread.join(120)
    return filler[0], burst


async def _round(stack: EnvStack, store, reference, round_: int) -> tuple[list[Result], float]:
    """One round; checks how each request ended; returns (every result, the admission queue's peak)."""
    with QueueSampler(stack.coordinator_metrics) as queue:
        filler, burst = await asyncio.to_thread(_filled_decode_then_burst, stack.url, round_)
    refused = [r for r in burst if r.status == 503]
    for r in refused:
        assert r.retry_after is not None and int(r.retry_after) >= 1, r
    served = [filler, *(r for r in burst if r.status != 503)]
    assert all(r.status == 200 and r.request_id for r in served), [(r.status, r.error) for r in served]
    lifecycles = await recorded_lifecycles(store, [r.request_id for r in served])
    groups = (([filler], FILLER_MAX_TOKENS), (served[1:], BURST_MAX_TOKENS))
    for group, max_tokens in groups:
        completed = [r for r in group if r.error is None]
        expected = expected_outputs(reference, [r.prompt for r in completed], max_tokens)
        check_results(completed, expected, reference[1], lifecycles)
    for r in served:
        if r.error is not None:  # failed with a reason, recorded as its one terminal event
            terminal = [e for e in lifecycles[r.request_id] if e.type in TERMINAL_TYPES]
            assert [e.type for e in terminal] == ["RequestFailed"] and terminal[0].payload["reason"], r
    return [filler, *burst], queue.peak


async def test_decode_full_under_load_every_request_ends_and_queue_and_memory_stay_bounded(
    full_stack, reference
):
    free_kv = FreeKV(full_stack.settings).start()
    try:
        start = free_kv.wait_back_to(dict(free_kv.free))
        async with open_store(full_stack.settings) as store:
            outcomes, peaks, rss = [], [], []
            for round_ in range(ROUNDS):
                results, peak = await _round(full_stack, store, reference, round_)
                outcomes.append(sorted((r.status, r.error is None) for r in results))
                peaks.append(peak)
                rss.append({name: rss_mib(p.pid) for name, p in full_stack.procs.items()})
        growth = {name: rss[-1][name] - rss[0][name] for name in rss[0]}
        print(f"outcomes {outcomes}\nqueue peaks {peaks}\nRSS MiB by round {rss}\ngrowth {growth}")
        # Decode was full and the queue filled: requests were refused, and the queue reached its bound.
        assert all(any(status == 503 for status, _ in o) for o in outcomes), outcomes
        assert all(p == MAX_WAITING for p in peaks), peaks
        assert all(g < RSS_GROWTH_BOUND_MIB for g in growth.values()), (growth, rss)
        assert free_kv.wait_back_to(start, timeout_s=15) == start
    finally:
        free_kv.stop()
