"""Fitting the step cost model (`cost.py`) to measured samples: ordinary least squares (numpy.linalg.lstsq)
with the coefficients clamped at 0 (a negative seconds-per-token is noise, not physics), relative error
reported per sample set.

Prefill samples fit prefill_fixed_s, prefill_token_s, prefill_pair_s (features 1, tokens, pairs summed over
the prompt's chunks — one step per chunk, so the fixed part counts once per chunk); decode samples fit
decode_fixed_s, decode_seq_s, decode_ctx_s (features 1, batch, batch·context).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from pdserve.sim.cost import StepCost, attention_pairs
from pdserve.sim.profile import DecodeSample, FitError, PrefillSample


def prefill_features(prompt_tokens: int, chunk_tokens: int) -> tuple[float, float, float]:
    """(steps, tokens, attention pairs) of one prompt prefilled in chunks of `chunk_tokens`."""
    steps, pairs, done = 0, 0, 0
    while done < prompt_tokens:
        n = min(chunk_tokens, prompt_tokens - done)
        pairs += attention_pairs(done, n)
        done += n
        steps += 1
    return float(steps), float(prompt_tokens), float(pairs)


def _lstsq_nonneg(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares on relative error (rows scaled by 1/y), then any negative coefficient dropped and the
    rest refitted (a two-pass active set, enough for 3 features)."""
    w = 1.0 / y
    active = list(range(x.shape[1]))
    coef = np.zeros(x.shape[1])
    for _ in range(x.shape[1]):
        sol, *_ = np.linalg.lstsq(x[:, active] * w[:, None], y * w, rcond=None)
        if (sol >= 0).all():
            coef[:] = 0
            coef[active] = sol
            return coef
        active = [a for a, s in zip(active, sol, strict=True) if s > 0]
        if not active:
            break
    return coef


def _error(pred: np.ndarray, y: np.ndarray) -> FitError:
    rel = np.abs(pred - y) / y
    return FitError(samples=len(y), mean_abs_rel=float(rel.mean()), max_abs_rel=float(rel.max()))


class Fit(NamedTuple):
    cost: StepCost
    prefill: FitError
    decode: FitError


def fit_cost(prefill: Sequence[PrefillSample], decode: Sequence[DecodeSample]) -> Fit:
    """The step cost model fitted to both sample sets, and each set's fit error. Raises ValueError with
    fewer than 3 samples in either set."""
    if len(prefill) < 3 or len(decode) < 3:
        raise ValueError(f"need ≥ 3 prefill and ≥ 3 decode samples, got {len(prefill)} and {len(decode)}")
    xp = np.array([prefill_features(s.prompt_tokens, s.chunk_tokens) for s in prefill])
    yp = np.array([s.seconds for s in prefill])
    cp = _lstsq_nonneg(xp, yp)
    xd = np.array([(1.0, s.batch, s.batch * s.context) for s in decode], dtype=np.float64)
    yd = np.array([s.seconds for s in decode])
    cd = _lstsq_nonneg(xd, yd)
    cost = StepCost(
        prefill_fixed_s=cp[0],
        prefill_token_s=cp[1],
        prefill_pair_s=cp[2],
        decode_fixed_s=cd[0],
        decode_seq_s=cd[1],
        decode_ctx_s=cd[2],
    )
    return Fit(cost, _error(xp @ cp, yp), _error(xd @ cd, yd))
