"""One engine of a simulated pool: its queues, its decoding batch as counters (`sim/cluster.py` explains
why), its KV blocks and its prefix cache."""

from __future__ import annotations

from collections import deque

from pdserve.routing.cache_model import PrefixCacheModel
from pdserve.sim.config import PoolConfig, PoolRole


class Replica:
    """One engine of a pool, in the simulation. Request indices everywhere."""

    __slots__ = (
        "name",
        "role",
        "pool",
        "cost",
        "cache",
        "waiting",
        "prefilling",
        "pending",
        "heap",
        "n_dec",
        "ctx",
        "step_no",
        "busy",
        "free_blocks",
        "queued_blocks",
        "active",
        "link_free_s",
        "plan",
        "busy_s",
        "steps",
        "step_ends",
        "index",
        "starting",
        "prefill_step",
    )

    def __init__(self, index: int, name: str, pool: PoolConfig, prefix_caching: bool) -> None:
        self.index = index
        self.starting: list[int] = []  # colocated: started (first token out) during the step in flight
        self.name, self.role, self.pool, self.cost = name, pool.role, pool, pool.hardware.cost
        caches = prefix_caching and pool.role is not PoolRole.DECODE
        self.cache = PrefixCacheModel(name, pool.capacity_blocks) if caches else None
        self.waiting: deque[int] = deque()  # admitted to this engine, not yet scheduled
        self.prefilling: list[list[int]] = []  # [request, computed tokens], in admission order
        self.pending: deque[int] = deque()  # ready to decode, waiting for a batch slot
        self.heap: list[tuple[int, int]] = []  # (finish step, request) of decoding sequences
        self.n_dec = 0
        self.ctx = 0  # Σ context of the decoding sequences at the next step
        self.step_no = 0
        self.busy = False
        self.prefill_step = False  # the step in flight computes prefill tokens
        self.free_blocks = pool.capacity_blocks
        self.queued_blocks = 0  # uncomputed prompt blocks placed here (the router's active prefill blocks)
        self.active = 0  # requests placed here and not finished here
        self.link_free_s = 0.0
        self.plan: tuple = ()
        self.busy_s = 0.0
        self.steps = 0
        self.step_ends: list[float] = []  # end time of every step, in order
