"""Request arrival times: a gamma renewal process, as `vllm bench serve --request-rate --burstiness`.

Source: vllm/benchmarks/serve.py `get_request`. Each gap is Gamma(shape=burstiness,
scale=1/(rate·burstiness)), so the mean gap is 1/rate whatever the burstiness; burstiness 1 is a Poisson
process, < 1 burstier, > 1 more even, inf a constant gap. The cumulative times are then rescaled so the
last arrival lands at exactly n/rate (vLLM does this to make throughput stable across seeds).
"""

from __future__ import annotations

import math

import numpy as np


def arrival_times(n: int, request_rate: float, burstiness: float = 1.0,
                  rng: np.random.Generator | None = None) -> list[float]:
    """Send times of `n` requests in seconds from the benchmark start, non-decreasing.

    `request_rate` in requests/s (`inf` = all at t=0). Raises ValueError when `n` < 1, the rate is not
    positive or the burstiness is not positive.
    """
    if n < 1:
        raise ValueError(f"n must be at least 1, got {n}")
    if not request_rate > 0:
        raise ValueError(f"request_rate must be positive, got {request_rate}")
    if not burstiness > 0:
        raise ValueError(f"burstiness must be positive, got {burstiness}")
    if math.isinf(request_rate):
        return [0.0] * n
    if math.isinf(burstiness):
        gaps = np.full(n, 1.0 / request_rate)
    else:
        rng = rng if rng is not None else np.random.default_rng()
        gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=n)
    times = np.cumsum(gaps)
    if times[-1] > 0:
        times *= (n / request_rate) / times[-1]
    return [float(t) for t in times]
