"""The step cost model: how long one engine step takes, from what it computes.

One step runs a batch of decode tokens (one per decoding sequence) and prefill chunks (chunked prefill,
under a token budget), as `engine/scheduler.py` schedules it. Its time is a linear model, fitted to
measurements of this engine (`fit.py`) or derived from an accelerator's roofline (`roofline.py`):

    prefill-only step:  prefill_fixed_s + prefill_token_s · tokens + prefill_pair_s · pairs
    step with decodes:  decode_fixed_s + decode_seq_s · batch + decode_ctx_s · Σ context
                        + prefill_token_s · tokens + prefill_pair_s · pairs     (its prefill chunks, if any)

`pairs` is the attention work of the prefill chunks: a chunk of n tokens after p computed ones attends
n·p + n(n+1)/2 (query, key) pairs, so a whole prompt of t tokens in one chunk costs a + b·t + c·t(t+1)/2 —
the quadratic prefill model. `Σ context` is the decode batch's KV read: Σ over decoding sequences of the
tokens each attends over, so decode is a + b·batch + c·batch·context. Mixed steps add the two, sharing the
decode step's fixed part (one forward, one weight read).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


def attention_pairs(start: int, num_tokens: int) -> int:
    """(query, key) pairs of a causal chunk of `num_tokens` tokens after `start` computed ones."""
    return num_tokens * start + num_tokens * (num_tokens + 1) // 2


class StepCost(BaseModel):
    """Coefficients of the step model above, seconds (per token, per pair, per sequence, per context
    token)."""

    model_config = ConfigDict(frozen=True)

    prefill_fixed_s: float
    prefill_token_s: float
    prefill_pair_s: float
    decode_fixed_s: float
    decode_seq_s: float
    decode_ctx_s: float

    def step_s(self, prefill_tokens: int, prefill_pairs: int, decode_seqs: int, decode_ctx: int) -> float:
        """Seconds of one step computing `prefill_tokens` prefill tokens (`prefill_pairs` attention pairs)
        and `decode_seqs` decode tokens over `decode_ctx` context tokens in all."""
        prefill = self.prefill_token_s * prefill_tokens + self.prefill_pair_s * prefill_pairs
        if decode_seqs:
            return (
                self.decode_fixed_s
                + self.decode_seq_s * decode_seqs
                + self.decode_ctx_s * decode_ctx
                + prefill
            )
        return self.prefill_fixed_s + prefill

    def prefill_s(self, num_tokens: int) -> float:
        """One prompt of `num_tokens` in one chunk, nothing else in the step."""
        return self.step_s(num_tokens, attention_pairs(0, num_tokens), 0, 0)

    def decode_step_s(self, batch: int, context: int) -> float:
        """One decode step of `batch` sequences each attending over `context` tokens."""
        return self.step_s(0, 0, batch, batch * context)
