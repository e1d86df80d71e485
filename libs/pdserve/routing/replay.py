"""Offline replay of routing: re-decide logged requests with another policy or other weights and
measure the hit rate they would have reached.

The logged requests (their prompts' block hashes from `RequestRouted.prompt_block_hashes`, their
arrival times) go through `pdserve.routing.simulate` with one prefix-cache model per prefill worker;
the prefill time per uncached token is the median the log shows (`PrefillCompleted.prefill_s` over
computed tokens). Requests logged without block hashes (older routers) are left out.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.config import RouterSettings
from pdserve.routing.report import RoutedRequest
from pdserve.routing.simulate import SimConfig, SimRequest, ceiling_tokens, simulate


@dataclass(frozen=True)
class ReplayResult:
    """One setting's outcome on the logged requests; `summary` is `SimOutcome.summary`'s dict."""

    label: str
    summary: dict


def sim_requests(logged: Sequence[RoutedRequest]) -> list[SimRequest]:
    """The logged requests that carry block hashes, as simulation input (arrival from the first)."""
    usable = [r for r in logged if r.block_hashes and r.prompt_tokens > 0]
    t0 = min((r.ts for r in usable), default=0.0)
    return [SimRequest(r.request_id, r.ts - t0, r.prompt_tokens, r.block_hashes) for r in usable]


def logged_config(
    logged: Sequence[RoutedRequest], num_prefill_workers: int | None, capacity_blocks: int
) -> SimConfig:
    """A simulation shaped like the logged deployment: as many prefill workers as replicas ran
    prefills (unless given), the block size logged, the median prefill seconds per computed token."""
    per_token = [
        r.prefill_s / max(r.prompt_tokens - (r.actual_cached_tokens or 0), 1) for r in logged if r.prefill_s
    ]
    replicas = {r.replica for r in logged if r.mode == "disaggregated"} or {r.replica for r in logged}
    return SimConfig(
        num_prefill_workers=num_prefill_workers or max(len(replicas), 1),
        capacity_blocks=capacity_blocks,
        block_size=next((r.block_size for r in logged if r.block_size), 16),
        prefill_fixed_s=0.0,
        prefill_s_per_token=statistics.median(per_token) if per_token else 0.0004,
    )


def replay_routing(
    logged: Sequence[RoutedRequest], settings: Sequence[tuple[str, RouterSettings]], config: SimConfig
) -> list[ReplayResult]:
    """Each (label, settings) re-decides the same logged requests; the ceiling is shared."""
    reqs = sim_requests(logged)
    if not reqs:
        return []
    ceiling = ceiling_tokens(reqs, config)
    workers = [f"prefill-{i}" for i in range(config.num_prefill_workers)]
    return [ReplayResult(label, simulate(reqs, s, config, ceiling).summary(workers)) for label, s in settings]
