"""Stage 3's what-if: would splitting this fleet into a prefill and a decode pool serve more of the log's
own requests within the SLO? DistServe's method (goodput of each placement, from a simulator fitted to
the measured engine), asked of the traffic the baseline actually served.

The log's requests (arrival, prompt and completion tokens, prompt block hashes: `RequestFacts`) replay in
`pdserve sim` with a hardware profile (the one `pdserve profile` measured here, or a published
accelerator's) on the baseline's own shape, N unified replicas, with the control plane fitted to the log:
the time before the engine (median TTFT − queue_s − prefill_s of the log) and the time per emitted token
(`sim/calibrate.py`, until the simulated TPOT p50 is the log's). The same fitted simulator then runs every
split P + D = N (P, D ≥ 1) over the deployment's link. A split that needs more than N replicas is not the
question: the seed compares pools of the same hardware.

Each number is a `Measurement` whose source names the simulation, so the decision (`decide.py`) stays a
pure function of the evidence.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Iterable, Mapping, Sequence

from pdserve.advise.evidence import Evidence, Measurement, RequestFacts, fold, measured, missing, tpot_s
from pdserve.events import Event
from pdserve.hardware.links import GB, Link
from pdserve.sim.calibrate import fit_decode_token_s
from pdserve.sim.cluster import simulate
from pdserve.sim.config import ClusterConfig, LinkConfig, Overheads, PoolConfig, PoolRole
from pdserve.sim.profile import HardwareProfile
from pdserve.sim.results import SimResult
from pdserve.sim.workload import SimRequest

GAIN = "split_goodput_gain"
NAMES = ("split_goodput_colocated", "split_goodput_best", GAIN)


def log_requests(facts: Iterable[RequestFacts]) -> list[SimRequest]:
    """The completed requests of a log, sent at their receive times (seconds from the first), with their
    prompt and completion token counts and their prompt's block hashes (`RequestRouted`)."""
    done = sorted(
        (r for r in facts if r.completion_tokens and r.received_ts is not None and r.prompt_tokens),
        key=lambda r: r.received_ts or 0.0,
    )
    if not done:
        return []
    t0 = done[0].received_ts or 0.0
    return [
        SimRequest((r.received_ts or 0.0) - t0, r.prompt_tokens, r.completion_tokens or 1, r.block_hashes)
        for r in done
    ]


def _pools(
    hardware: HardwareProfile, shape: Mapping[str, int], roles: Iterable[tuple[PoolRole, int]]
) -> list[PoolConfig]:
    return [PoolConfig(role=role, replicas=n, hardware=hardware, **shape) for role, n in roles]


def simulate_split(
    facts: Iterable[RequestFacts],
    hardware: HardwareProfile,
    link: Link,
    fleet: int,
    slo_ms: Mapping[str, float],
    shape: Mapping[str, int],
    source: str,
) -> dict[str, Measurement]:
    """The split what-if's measurements (`NAMES`): simulated goodput (req/s within `slo_ms`) of the
    baseline's `fleet` unified replicas, of the best P + D = `fleet` split, and their ratio (best split ÷
    colocated; inf when only the split meets the SLO). `shape`: each replica's `PoolConfig` limits
    (max_num_seqs, max_num_batched_tokens, kv_capacity_tokens, block_size). Missing (with why) when the
    log has no completed request or the fleet cannot be split (< 2 replicas)."""
    facts = list(facts)
    reqs = log_requests(facts)
    src = f"pdserve sim on this log's {len(reqs)} completed requests ({source})"
    if not reqs or fleet < 2:
        why = "no completed request to replay" if not reqs else f"a fleet of {fleet} cannot be split"
        return {n: missing(n, "req/s" if n != GAIN else "×", src, why) for n in NAMES}
    done = [r for r in facts if r.completion_tokens and r.ttft_s is not None]
    # what the simulator does not queue itself: the log's TTFT less the admission queue and the prefill
    request_s = max(
        0.0, statistics.median(r.ttft_s - (r.queue_s or 0.0) - (r.prefill_s or 0.0) for r in done)
    )
    base = Overheads(request_s=request_s)
    colocated_pools = _pools(hardware, shape, [(PoolRole.UNIFIED, fleet)])

    def colocated(ov: Overheads) -> SimResult:
        return simulate(ClusterConfig(pools=colocated_pools, overheads=ov), reqs)

    def tpot_p50_s(decode_token_s: float) -> float:
        ov = base.model_copy(update={"decode_token_s": decode_token_s})
        return colocated(ov).metrics().latency["tpot"].median_ms / 1e3

    tpots = [tpot_s(r) for r in done if (r.completion_tokens or 0) > 1]
    token_s = fit_decode_token_s(tpot_p50_s, statistics.median(tpots)) if tpots else 0.0
    ov = base.model_copy(update={"decode_token_s": token_s})
    sim_link = LinkConfig(
        name=link.name, bandwidth_bytes_per_s=link.achievable_GB_s * GB, latency_s=link.latency_s
    )
    g_co = colocated(ov).metrics(slo_ms).request_goodput or 0.0
    splits = {}
    for p in range(1, fleet):
        cfg = ClusterConfig(
            pools=_pools(hardware, shape, [(PoolRole.PREFILL, p), (PoolRole.DECODE, fleet - p)]),
            link=sim_link,
            overheads=ov,
        )
        splits[p] = simulate(cfg, reqs).metrics(slo_ms).request_goodput or 0.0
    p_best = max(splits, key=lambda p: splits[p])
    g_best = splits[p_best]
    fitted = (
        f"control plane fitted to the log: {request_s * 1e3:.0f} ms before the engine (median TTFT − "
        f"queue_s − prefill_s) and {token_s * 1e3:.1f} ms per emitted token (simulated TPOT p50 = the log's)"
    )
    each = ", ".join(f"{p}P+{fleet - p}D {g:.3f} req/s" for p, g in splits.items())
    ratio = g_best / g_co if g_co > 0 else (float("inf") if g_best > 0 else 0.0)
    best = f"{p_best} prefill + {fleet - p_best} decode over {link.name}"
    return {
        "split_goodput_colocated": measured(
            "split_goodput_colocated", g_co, "req/s", src, len(reqs), f"{fleet} unified replicas ({fitted})"
        ),
        "split_goodput_best": measured("split_goodput_best", g_best, "req/s", src, len(reqs), best),
        GAIN: measured(GAIN, ratio, "×", src, len(reqs), f"best split ÷ colocated; every split: {each}"),
    }


def with_split(
    ev: Evidence,
    evts: Sequence[Event],
    hardware: HardwareProfile,
    link: Link,
    fleet: int,
    slo_ms: Mapping[str, float],
    shape: Mapping[str, int],
    source: str,
) -> Evidence:
    """`ev` (measured from `evts`) with the split what-if's measurements added (`simulate_split`)."""
    split = simulate_split(fold(evts).values(), hardware, link, fleet, slo_ms, shape, source)
    return dataclasses.replace(ev, m={**ev.m, **split})
