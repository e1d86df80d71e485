from __future__ import annotations

import time

import pytest

from pdserve.bus import RejectedError
from pdserve.messages import CompatibilityDescriptor, Heartbeat, RejectCode, Role, RouteRequest
from pdserve.routing.policy import LeastLoaded
from pdserve.routing.registry import WorkerRegistry

DESC = CompatibilityDescriptor(model="tiny", weights_hash="abc", dtype="float32", block_size=16, num_layers=2,
                               num_kv_heads=2, head_dim=16, hash_seed=0, layout_version=1)


def hb(worker_id: str, role: Role, running: int = 0, descriptor: CompatibilityDescriptor = DESC) -> Heartbeat:
    return Heartbeat(worker_id=worker_id, role=role, descriptor=descriptor, num_running=running, num_waiting=0,
                     kv_capacity_tokens=1000, kv_free_tokens=1000, ts=time.time())


def route(registry: WorkerRegistry):
    return LeastLoaded().choose(RouteRequest(request_id="r", num_prompt_tokens=10), registry)


def test_least_loaded_picks_the_idle_prefill_and_decode_workers():
    reg = WorkerRegistry(timeout_s=10)
    for h in (hb("p0", Role.PREFILL, 2), hb("p1", Role.PREFILL, 0), hb("d0", Role.DECODE, 0),
              hb("d1", Role.DECODE, 5)):
        reg.observe(h)
    decision = route(reg)
    assert (decision.mode, decision.prefill_worker_id, decision.decode_worker_id) == ("disaggregated", "p1", "d0")
    assert {c.worker_id for c in decision.candidates} == {"p0", "p1", "d0", "d1"}


def test_incompatible_workers_are_never_paired():
    reg = WorkerRegistry(timeout_s=10)
    reg.observe(hb("p0", Role.PREFILL))
    reg.observe(hb("d0", Role.DECODE, descriptor=DESC.model_copy(update={"block_size": 32})))
    with pytest.raises(RejectedError) as e:
        route(reg)
    assert e.value.code is RejectCode.NO_WORKERS


def test_only_unified_workers_route_colocated():
    reg = WorkerRegistry(timeout_s=10)
    reg.observe(hb("u0", Role.UNIFIED, 1))
    reg.observe(hb("u1", Role.UNIFIED, 0))
    decision = route(reg)
    assert (decision.mode, decision.prefill_worker_id, decision.decode_worker_id) == ("colocated", "u1", "u1")


def test_silent_workers_expire():
    reg = WorkerRegistry(timeout_s=0.0)
    reg.observe(hb("p0", Role.PREFILL))
    reg.observe(hb("d0", Role.DECODE))
    time.sleep(0.01)
    assert reg.live(Role.PREFILL, Role.DECODE) == []
