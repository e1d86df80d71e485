"""Routing policies: which of a set of candidate workers runs a request's prefill.

A policy sees one `Candidate` per compatible worker — its cached blocks for this prompt (from the KV
index) and its load (from the router's bookings and the worker's heartbeat) — and picks one. Every
policy also reports each candidate's score, so the decision is auditable from `RequestRouted`.

`kv` starts from Dynamo's KV router cost (docs.nvidia.com/dynamo, Router → Routing Concepts, "Cost
Calculation" and "Worker Selection"):

    cost = overlap_score_weight · prefill_blocks + decode_blocks
    prefill_blocks = uncached prompt blocks + active_prefill_weight · active prefill blocks
    decode_blocks  = active decode blocks (+ the request's own blocks where it will decode)

and adds a stable load term, vLLM production-stack's load-aware routing (docs.vllm.ai/projects/
production-stack, "Load Aware Routing": score = matched/prompt − β · relative_load) written in blocks:

    + balance_weight · prompt_blocks · (r − mean r) / max(1, mean r)

r being each candidate's exponentially weighted share of recent routing decisions (`ActiveLoad`). Two
departures from Dynamo, both measured in docs/benchmarks/routing.md: Dynamo has active_prefill_weight 1,
which sends a request away from the worker holding its prefix as soon as that worker's queue outweighs
the hit (a TTFT-neutral trade that duplicates the prefix elsewhere and evicts other prefixes there); and
without the r term, a prompt whose only cached part is shared by everyone (a system prompt) goes to
whichever worker cached it first, so sticky conversations pile up there. Guard (SGLang's cache-aware
router, `--balance-abs-threshold` / `--balance-rel-threshold`): when the candidates' active requests are
imbalanced by both thresholds, the least loaded candidate wins whatever is cached. Lowest cost wins, ties
to the most cached blocks, then the fewest active requests, then the smallest r; with `temperature` > 0
the worker is sampled by softmax over the costs normalised to [0, 1] (min-max), logits −cost/temperature,
as Dynamo's `--router-temperature` does. `round_robin`, `least_loaded` and `random` are the comparison
baselines (Dynamo's `--router-mode round-robin|random`).

Tiers (issue 16): a cached block need not be in the worker's pool; it may be in a tier below it (its
offload tier, or the shared store) and be copied back instead of computed. In `kv`'s cost the cached
blocks are then weighed by what using them saves: a block in tier t counts

    weight_t = max(0, 1 − copy_s_per_token_t / prefill_s_per_token)

of an uncached block (the pool's weight is 1: nothing to copy), so a pool block counts more than an offload
block, which counts more than a store-only block whenever the copies cost in that order (`tier_weights`,
from `RouterSettings`: configured, defaults measured by benchmarks/kv_tiers.py).
"""

from __future__ import annotations

import math
import random
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

from pdserve.config import PolicyName, RouterSettings
from pdserve.messages import CandidateCost, Role


@dataclass(frozen=True)
class Candidate:
    """One worker as a place for this request's prefill. Block counts are in the worker's block size.

    `prompt_blocks`: blocks of the whole prompt (ceil); `cached_blocks`: its leading blocks the worker's
    prefix cache holds (per the KV index); `active_prefill_blocks`: uncached blocks of prefills already
    placed there and not finished; `active_decode_blocks`: KV blocks held there by requests decoding
    there (Dynamo's "active blocks"; 0 on a prefill worker), plus this request's own when it would decode
    there; `active_requests`: requests there now;
    `kv_usage`: fraction of its KV capacity in use (heartbeat), 0..1; `recent_requests`: its exponentially
    weighted count of recent routing decisions (`ActiveLoad.recent_requests`), the stable load.
    `checkpoint_blocks`: for a model with recurrent state (a hybrid), the longest state checkpoint the
    worker holds within its KV hit (<= `cached_blocks`): its prefill resumes there, so only that much of
    the hit saves compute; None for a model without state (the whole KV hit is usable).
    `cached_blocks_by_tier`: cached_blocks split by the tier holding each block ("pool", "offload", ...:
    `KVIndex.overlaps_by_tier`); empty means all in the pool."""

    worker_id: str
    role: Role
    prompt_blocks: int
    cached_blocks: int
    active_prefill_blocks: int
    active_decode_blocks: int
    active_requests: int
    kv_usage: float
    recent_requests: float = 0.0
    checkpoint_blocks: int | None = None
    cached_blocks_by_tier: Mapping[str, int] = field(default_factory=dict)

    @property
    def usable_blocks(self) -> int:
        """Blocks of the prompt the prefill does not compute: the KV hit, or for a hybrid the checkpoint."""
        return self.cached_blocks if self.checkpoint_blocks is None else self.checkpoint_blocks

    @property
    def uncached_blocks(self) -> int:
        """Blocks the prefill computes (prompt − usable hit)."""
        return max(self.prompt_blocks - self.usable_blocks, 0)

    def weighted_cached_blocks(self, tier_weights: Mapping[str, float]) -> float:
        """Σ over tiers of weight_t · blocks held there (a tier without a weight counts 0); the pool's
        weight is 1 unless given. Without a split, all cached blocks count as the pool's."""
        if not self.cached_blocks_by_tier:
            return float(self.cached_blocks)
        return sum(n * (tier_weights.get(t, 1.0 if t == "pool" else 0.0))
                   for t, n in self.cached_blocks_by_tier.items())

    def cost_record(self, score: float) -> CandidateCost:
        """The candidate as recorded in `RouteDecision.candidates`, with the policy's `score` as cost."""
        return CandidateCost(
            worker_id=self.worker_id,
            role=self.role,
            cost=score,
            active_requests=self.active_requests,
            kv_usage=self.kv_usage,
            cached_blocks=self.cached_blocks,
            uncached_blocks=self.uncached_blocks,
            active_prefill_blocks=self.active_prefill_blocks,
            active_decode_blocks=self.active_decode_blocks,
            checkpoint_blocks=self.checkpoint_blocks or 0,
            cached_blocks_by_tier=dict(self.cached_blocks_by_tier),
        )


class RoutingPolicy(ABC):
    """Picks one candidate. Lifecycle: one instance per router; `select` is called per request on the
    router's event loop and must not block. Policies with state (a turn, a random generator) keep it
    between calls. `candidates` is never empty and is sorted by worker id."""

    name: ClassVar[str]

    @abstractmethod
    def scores(self, candidates: Sequence[Candidate]) -> list[float]:
        """One score per candidate, lower is better (what `RequestRouted` records as `cost`)."""

    _tie_turn: int = 0

    def select(self, candidates: Sequence[Candidate]) -> int:
        """Index of the chosen candidate: the lowest score, ties to the fewest active requests, then in
        turn (so idle workers share cold prompts instead of the first taking them all)."""
        scores = self.scores(candidates)
        n, turn = len(candidates), self._tie_turn
        self._tie_turn += 1
        return min(range(n), key=lambda i: (scores[i], candidates[i].active_requests, (i - turn) % n))


class KVCost(RoutingPolicy):
    """The KV-aware cost (module docstring). `overlap_score_weight` ≥ 0: higher favours cache reuse
    (TTFT), lower favours spreading decode load (ITL); Dynamo's default is 1.0. `active_prefill_weight`
    ≥ 0: how much a queued prefill block counts against an uncached one of this request (Dynamo: 1).
    `balance_weight` ≥ 0: β of the stable load term (0 = off). `balance_abs_threshold`,
    `balance_rel_threshold`: the imbalance guard. `temperature` ≥ 0: 0 is deterministic (Dynamo's
    default), higher spreads more. `seed` makes the sampling repeatable. `tier_weights`: what a cached
    block in each tier counts (module docstring; default: every tier 1, the pool-only cost)."""

    name = "kv"

    def __init__(
        self,
        overlap_score_weight: float = 1.0,
        temperature: float = 0.0,
        seed: int | None = None,
        active_prefill_weight: float = 1.0,
        balance_weight: float = 0.0,
        balance_abs_threshold: int = 64,
        balance_rel_threshold: float = 1.5,
        tier_weights: Mapping[str, float] | None = None,
    ) -> None:
        if min(overlap_score_weight, temperature, active_prefill_weight, balance_weight) < 0:
            raise ValueError("weights and temperature must be ≥ 0")
        self.tier_weights = dict(tier_weights or {})
        self.overlap_score_weight = overlap_score_weight
        self.temperature = temperature
        self.active_prefill_weight = active_prefill_weight
        self.balance_weight = balance_weight
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self._rng = random.Random(seed)

    def scores(self, candidates: Sequence[Candidate]) -> list[float]:
        w, q, beta = self.overlap_score_weight, self.active_prefill_weight, self.balance_weight
        mean_r = sum(c.recent_requests for c in candidates) / len(candidates)
        norm = max(1.0, mean_r)
        return [
            w * (max(c.prompt_blocks - self._cached(c), 0.0) + q * c.active_prefill_blocks)
            + c.active_decode_blocks
            + beta * c.prompt_blocks * (c.recent_requests - mean_r) / norm
            for c in candidates
        ]

    def _cached(self, c: Candidate) -> float:
        weights = self.tier_weights
        cached = c.weighted_cached_blocks(weights) if weights else float(c.cached_blocks)
        # A hybrid's prefill resumes from its checkpoint: no more of the hit than that saves compute
        return cached if c.checkpoint_blocks is None else min(cached, float(c.checkpoint_blocks))

    def imbalanced(self, candidates: Sequence[Candidate]) -> bool:
        """SGLang's test: max − min active requests > abs threshold and max > rel threshold · min."""
        active = [c.active_requests for c in candidates]
        hi, lo = max(active), min(active)
        return hi - lo > self.balance_abs_threshold and hi > self.balance_rel_threshold * lo

    def select(self, candidates: Sequence[Candidate]) -> int:
        """Imbalanced: the fewest active requests (ties to the most cached). Otherwise the lowest cost;
        ties to the most cached blocks (equal cost, so take the hit and leave the other workers' caches
        to other prefixes), then the fewest active requests, then the smallest stable load. With a
        temperature, sampled."""
        n = len(candidates)
        if self.imbalanced(candidates):
            return min(range(n), key=lambda i: (candidates[i].active_requests, -candidates[i].cached_blocks))
        scores = self.scores(candidates)
        if self.temperature > 0:
            return softmax_sample(scores, self.temperature, self._rng)
        return min(
            range(n),
            key=lambda i: (
                scores[i],
                -candidates[i].cached_blocks,
                candidates[i].active_requests,
                candidates[i].recent_requests,
            ),
        )


def tier_weights(settings: RouterSettings) -> dict[str, float]:
    """What a cached block counts in each tier: 1 in the pool, max(0, 1 − copy_s_per_token /
    prefill_s_per_token) below it (module docstring; `RouterSettings` gives the costs)."""
    p = settings.prefill_s_per_token
    copy = {"offload": settings.offload_copy_s_per_token, "disk": settings.disk_copy_s_per_token,
            "store": settings.store_copy_s_per_token}
    return {"pool": 1.0} | {t: max(0.0, 1.0 - c / p) for t, c in copy.items()}


def softmax_sample(costs: Sequence[float], temperature: float, rng: random.Random) -> int:
    """Sample an index with probability ∝ exp(−c̃/temperature), c̃ the costs min-max normalised to [0, 1]
    (all equal → uniform), as Dynamo's router samples with `--router-temperature`. temperature > 0."""
    lo, hi = min(costs), max(costs)
    if hi == lo:
        return rng.randrange(len(costs))
    logits = [-(c - lo) / (hi - lo) / temperature for c in costs]
    top = max(logits)
    weights = [math.exp(x - top) for x in logits]
    return rng.choices(range(len(costs)), weights=weights)[0]


class RoundRobin(RoutingPolicy):
    """Each request to the next worker in id order, whatever is cached (the no-intelligence baseline).
    Score: how many turns until the candidate's turn."""

    name = "round_robin"

    def __init__(self) -> None:
        self._turn = 0

    def scores(self, candidates: Sequence[Candidate]) -> list[float]:
        n = len(candidates)
        return [float((i - self._turn) % n) for i in range(n)]

    def select(self, candidates: Sequence[Candidate]) -> int:
        i = self._turn % len(candidates)
        self._turn += 1
        return i


class LeastLoaded(RoutingPolicy):
    """Fewest active requests, KV usage breaking ties (ignores what is cached)."""

    name = "least_loaded"

    def scores(self, candidates: Sequence[Candidate]) -> list[float]:
        return [c.active_requests + c.kv_usage for c in candidates]


class Random(RoutingPolicy):
    """Uniformly at random (Dynamo's `--router-mode random`). Score 0 for all."""

    name = "random"

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def scores(self, candidates: Sequence[Candidate]) -> list[float]:
        return [0.0] * len(candidates)

    def select(self, candidates: Sequence[Candidate]) -> int:
        return self._rng.randrange(len(candidates))


POLICY_NAMES = tuple(PolicyName)


def make_policy(name: str, settings: RouterSettings | None = None) -> RoutingPolicy:
    """The policy called `name` (one of `POLICY_NAMES`), its knobs from `settings` (default
    `RouterSettings()`'s). Raises ValueError for another name."""
    st = settings or RouterSettings()
    if name == "kv":
        return KVCost(
            st.overlap_score_weight,
            st.temperature,
            st.seed,
            active_prefill_weight=st.active_prefill_weight,
            balance_weight=st.balance_weight,
            balance_abs_threshold=st.balance_abs_threshold,
            balance_rel_threshold=st.balance_rel_threshold,
            tier_weights=tier_weights(st),
        )
    if name == "round_robin":
        return RoundRobin()
    if name == "least_loaded":
        return LeastLoaded()
    if name == "random":
        return Random(st.seed)
    raise ValueError(f"unknown routing policy {name!r}; choose one of {', '.join(POLICY_NAMES)}")
