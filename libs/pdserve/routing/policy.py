"""Routing policies: which of a set of candidate workers runs a request's prefill.

A policy sees one `Candidate` per compatible worker — its cached blocks for this prompt (from the KV
index) and its load (from the router's bookings and the worker's heartbeat) — and picks one. Every
policy also reports each candidate's score, so the decision is auditable from `RequestRouted`.

`kv` is Dynamo's KV router cost (docs.nvidia.com/dynamo, Router → Routing Concepts, "Cost
Calculation" and "Worker Selection"):

    cost = overlap_score_weight · prefill_blocks + decode_blocks
    prefill_blocks = uncached prompt blocks + active prefill blocks
    decode_blocks  = active decode blocks (+ the request's own blocks where it will decode)

lowest cost wins; with `temperature` > 0 the worker is sampled by softmax over the costs normalised to
[0, 1] (min-max), logits −cost/temperature, as Dynamo's `--router-temperature` does. `round_robin`,
`least_loaded` and `random` are the comparison baselines (Dynamo's `--router-mode round-robin|random`).
"""

from __future__ import annotations

import math
import random
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from pdserve.messages import CandidateCost, Role


@dataclass(frozen=True)
class Candidate:
    """One worker as a place for this request's prefill. Block counts are in the worker's block size.

    `prompt_blocks`: blocks of the whole prompt (ceil); `cached_blocks`: its leading blocks the worker's
    prefix cache holds (per the KV index); `active_prefill_blocks`: uncached blocks of prefills already
    placed there and not finished; `active_decode_blocks`: KV blocks held there by requests decoding
    there (Dynamo's "active blocks"; 0 on a prefill worker), plus this request's own when it would decode
    there; `active_requests`: requests there now;
    `kv_usage`: fraction of its KV capacity in use (heartbeat), 0..1."""

    worker_id: str
    role: Role
    prompt_blocks: int
    cached_blocks: int
    active_prefill_blocks: int
    active_decode_blocks: int
    active_requests: int
    kv_usage: float

    @property
    def uncached_blocks(self) -> int:
        return max(self.prompt_blocks - self.cached_blocks, 0)

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
        return self._argmin(candidates, self.scores(candidates), prefer_cached=False)

    def _argmin(self, candidates: Sequence[Candidate], scores: Sequence[float], prefer_cached: bool) -> int:
        n, turn = len(candidates), self._tie_turn
        self._tie_turn += 1
        return min(
            range(n),
            key=lambda i: (
                scores[i],
                -candidates[i].cached_blocks if prefer_cached else 0,
                candidates[i].active_requests,
                (i - turn) % n,
            ),
        )


class KVCost(RoutingPolicy):
    """Dynamo's KV-aware cost (module docstring). `overlap_score_weight` ≥ 0: higher favours cache
    reuse (TTFT), lower favours spreading load (ITL); Dynamo's default is 1.0. `temperature` ≥ 0:
    0 is deterministic (Dynamo's default), higher spreads more. `seed` makes the sampling repeatable."""

    name = "kv"

    def __init__(
        self, overlap_score_weight: float = 1.0, temperature: float = 0.0, seed: int | None = None
    ) -> None:
        if overlap_score_weight < 0 or temperature < 0:
            raise ValueError("overlap_score_weight and temperature must be ≥ 0")
        self.overlap_score_weight = overlap_score_weight
        self.temperature = temperature
        self._rng = random.Random(seed)

    def scores(self, candidates: Sequence[Candidate]) -> list[float]:
        w = self.overlap_score_weight
        return [
            w * (c.uncached_blocks + c.active_prefill_blocks) + c.active_decode_blocks for c in candidates
        ]

    def select(self, candidates: Sequence[Candidate]) -> int:
        """Lowest cost; ties to the most cached blocks (equal cost, so take the hit and leave the other
        workers' caches to other prefixes), then as `RoutingPolicy.select`. With a temperature, sampled."""
        if self.temperature == 0:
            return self._argmin(candidates, self.scores(candidates), prefer_cached=True)
        return softmax_sample(self.scores(candidates), self.temperature, self._rng)


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


POLICY_NAMES = ("kv", "round_robin", "least_loaded", "random")


def make_policy(
    name: str, overlap_score_weight: float = 1.0, temperature: float = 0.0, seed: int | None = None
) -> RoutingPolicy:
    """The policy called `name` (one of `POLICY_NAMES`). Raises ValueError for another name."""
    if name == "kv":
        return KVCost(overlap_score_weight, temperature, seed)
    if name == "round_robin":
        return RoundRobin()
    if name == "least_loaded":
        return LeastLoaded()
    if name == "random":
        return Random(seed)
    raise ValueError(f"unknown routing policy {name!r}; choose one of {', '.join(POLICY_NAMES)}")
