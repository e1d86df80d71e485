"""Fitting the serving stack's costs beyond the engine to a measured TPOT.

`pdserve profile` times the engine alone; a served stack also spends CPU per emitted token outside the
forward (the commit's publish, detokenization, the gateway's SSE, the recorder and NATS on the same cores),
which grows a decode step with its batch, and on one host a decode step slows while another replica
prefills beside it. `Overheads.decode_token_s` and `Overheads.prefill_interference` charge them; these fit
them so that a simulation of measured traffic reproduces the TPOT the stack measured (the way Vidur and
DistServe fit their latency models to profiled runs before predicting with them).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

DECODE_TOKEN_MAX_S = 0.05  # 50 ms per token: above any CPU control plane measured here (~1-5 ms)
DECODE_TOKEN_TOL_S = 1e-4
INTERFERENCE_MAX = 3.0  # a step 4x as long beside a prefill: above the 118% fitted here (docs/simulator.md)
INTERFERENCE_TOL = 1e-3


def fit_to_tpot(tpot_at: Callable[[float], float], target_s: float, hi: float, tol: float) -> float:
    """The value x in [0, `hi`] at which `tpot_at(x)` (a simulated TPOT p50, seconds, non-decreasing in x)
    reaches `target_s` (the measured TPOT p50, seconds), by bisection to `tol` (the last bracket's
    midpoint). 0 when x = 0 already reaches the target; within `tol` of `hi` when even that falls short.
    Raises ValueError when `target_s` is not positive."""
    if target_s <= 0:
        raise ValueError(f"target TPOT must be positive, got {target_s}")
    if tpot_at(0.0) >= target_s:
        return 0.0
    lo, up = 0.0, hi
    while up - lo > tol:
        mid = (lo + up) / 2
        lo, up = (mid, up) if tpot_at(mid) < target_s else (lo, mid)
    return (lo + up) / 2


# `Overheads.decode_token_s` (seconds per emitted token) and `Overheads.prefill_interference` (a fraction)
fit_decode_token_s = partial(fit_to_tpot, hi=DECODE_TOKEN_MAX_S, tol=DECODE_TOKEN_TOL_S)
fit_prefill_interference = partial(fit_to_tpot, hi=INTERFERENCE_MAX, tol=INTERFERENCE_TOL)
