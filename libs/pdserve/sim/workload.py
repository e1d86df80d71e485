"""The simulator's requests: from the bench datasets (`bench/datasets.py`, arrivals `bench/arrivals.py`),
hashed with pdserve's own block hashing (`engine/block_hash.py`) so prefix hits are the engine's, or drawn
as lengths only when the prompts share nothing (a 100k-request fleet need not materialise 10⁸ token ids).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from pdserve.bench.arrivals import arrival_times
from pdserve.bench.datasets import SampleRequest
from pdserve.engine.block_hash import hash_blocks


class SimRequest(NamedTuple):
    """One request: arrival (seconds from the start), prompt and output tokens (output exact, as
    `ignore_eos`), its prompt's full blocks' chained hashes (empty: nothing to share), and the index of
    the request that must finish before it is sent (a conversation's previous turn) or -1."""

    arrival_s: float
    prompt_len: int
    output_len: int
    block_hashes: tuple[int, ...] = ()
    after: int = -1


def from_samples(
    samples: Sequence[SampleRequest], arrivals_s: Sequence[float], block_size: int = 16, hash_seed: int = 0
) -> list[SimRequest]:
    """The bench requests `samples` sent at `arrivals_s`, their blocks hashed as a worker hashes them."""
    return [
        SimRequest(
            float(t),
            s.prompt_len,
            s.output_len,
            tuple(hash_blocks(s.prompt, block_size, hash_seed)),
            -1 if s.after is None else s.after,
        )
        for s, t in zip(samples, arrivals_s, strict=True)
    ]


def random_lengths(
    num_requests: int,
    input_len: int,
    output_len: int,
    request_rate: float,
    range_ratio: float = 0.0,
    burstiness: float = 1.0,
    seed: int = 0,
) -> list[SimRequest]:
    """Lengths as `random_dataset` draws them (uniform in [⌊L(1−r)⌋, ⌈L(1+r)⌉], same rng order for the
    same seed, prefix 0), arrivals as `vllm bench serve` (gamma renewal), no shared blocks."""
    rng = np.random.default_rng(seed)
    in_lo, in_hi = math.floor(input_len * (1 - range_ratio)), math.ceil(input_len * (1 + range_ratio))
    out_lo = max(1, math.floor(output_len * (1 - range_ratio)))
    out_hi = max(1, math.ceil(output_len * (1 + range_ratio)))
    in_lens = rng.integers(in_lo, in_hi + 1, size=num_requests)
    out_lens = rng.integers(out_lo, out_hi + 1, size=num_requests)
    times = arrival_times(num_requests, request_rate, burstiness, np.random.default_rng(seed))
    return [SimRequest(t, int(a), int(b)) for t, a, b in zip(times, in_lens, out_lens, strict=True)]
