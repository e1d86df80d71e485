"""`pdserve sim --search`: DistServe's goodput (Zhong et al., OSDI 2024, §2 and §4: the highest request
rate at which at least `attainment` of requests meet every SLO), found by bisection over the rate, each
probe a whole simulation of the same workload at that rate; and the cheapest pool split (fewest replicas
in all) that holds a target rate at that attainment."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

from pdserve.sim.cluster import simulate
from pdserve.sim.config import ClusterConfig
from pdserve.sim.workload import SimRequest

Workload = Callable[[float], Sequence[SimRequest]]  # request rate (req/s) → requests


class RateProbe(NamedTuple):
    rate: float
    attainment: float


class GoodputSearch(NamedTuple):
    """`goodput_rate`: highest rate probed that met `attainment` (0 when none did); `probes` in order."""

    goodput_rate: float
    attainment: float
    probes: list[RateProbe]


def max_rate(
    cfg: ClusterConfig,
    workload: Workload,
    slo_ms: Mapping[str, float],
    attainment: float = 0.9,
    lo: float = 0.0,
    hi: float | None = None,
    rel_tol: float = 0.05,
    max_probes: int = 24,
) -> GoodputSearch:
    """Bisection on the request rate. `hi` None: doubled from 1 req/s until a probe fails."""
    probes: list[RateProbe] = []

    def ok(rate: float) -> bool:
        a = simulate(cfg, workload(rate)).attainment(slo_ms)
        probes.append(RateProbe(rate, a))
        return a >= attainment

    if hi is None:
        hi = 1.0
        while ok(hi) and len(probes) < max_probes:
            lo, hi = hi, hi * 2
    while hi - lo > rel_tol * hi and len(probes) < max_probes:
        mid = (lo + hi) / 2
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return GoodputSearch(lo, attainment, probes)


class Split(NamedTuple):
    """A pool split and whether it held the target: `prefill`, `decode` replicas (colocated: `prefill`
    is the unified count, `decode` 0)."""

    prefill: int
    decode: int
    attainment: float


def cheapest_split(
    build: Callable[[int, int], ClusterConfig],
    requests: Sequence[SimRequest],
    slo_ms: Mapping[str, float],
    attainment: float,
    max_replicas: int,
    disaggregated: bool,
) -> tuple[Split | None, list[Split]]:
    """The split with the fewest replicas in all (at equal totals, the fewest prefill replicas) holding
    `attainment` on `requests`; every split tried, in order. `build(p, d)`
    makes the cluster (colocated: `build(n, 0)`). None when no split up to `max_replicas` holds it."""
    tried: list[Split] = []
    for total in range(1 if not disaggregated else 2, max_replicas + 1):
        splits = [(p, total - p) for p in range(1, total)] if disaggregated else [(total, 0)]
        for p, d in splits:
            a = simulate(build(p, d), requests).attainment(slo_ms)
            tried.append(Split(p, d, a))
            if a >= attainment:
                return tried[-1], tried
    return None, tried
