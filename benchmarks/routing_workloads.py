"""The routing benchmark's workloads, as token ids with arrival times (seconds from the start).

- prefix repetition, vLLM's `prefix_repetition` dataset (vllm/benchmarks/datasets.py,
  `--prefix-repetition-prefix-len 256 --prefix-repetition-suffix-len 256
  --prefix-repetition-num-prefixes 10`): each prompt is one of 10 random 256-token prefixes (chosen
  uniformly) + a random 256-token suffix; Poisson arrivals.
- multi-turn chat: conversations sharing one system prompt; each turn's prompt is the whole history
  (system, earlier user and assistant messages) + a new user message; conversations overlap in time.

Token ids are random over SmolLM2's 49,152-token vocabulary: hit rates depend on token ids and block
hashes only, not on what the tokens say.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

VOCAB = 49152


@dataclass(frozen=True)
class Prompt:
    request_id: str
    arrival_s: float
    token_ids: list[int]


def random_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


def prefix_repetition(
    rng: random.Random,
    num_prompts: int = 600,
    rate_per_s: float = 12.0,
    prefix_len: int = 256,
    suffix_len: int = 256,
    num_prefixes: int = 10,
) -> list[Prompt]:
    """vLLM's prefix-repetition workload with Poisson arrivals at `rate_per_s`."""
    prefixes = [random_tokens(rng, prefix_len) for _ in range(num_prefixes)]
    out, t = [], 0.0
    for i in range(num_prompts):
        t += rng.expovariate(rate_per_s)
        out.append(Prompt(f"pr-{i}", t, rng.choice(prefixes) + random_tokens(rng, suffix_len)))
    return out


def multi_turn_chat(
    rng: random.Random,
    num_conversations: int = 48,
    turns: int = 6,
    system_len: int = 128,
    start_spread_s: float = 30.0,
    think_s: float = 4.0,
) -> list[Prompt]:
    """Conversations starting uniformly over `start_spread_s`, one turn every ~`think_s` seconds; user
    messages 32–160 tokens, assistant replies 64–256 tokens, one shared system prompt."""
    system = random_tokens(rng, system_len)
    out = []
    for c in range(num_conversations):
        history, t = list(system), rng.uniform(0, start_spread_s)
        for k in range(turns):
            history += random_tokens(rng, rng.randint(32, 160))
            out.append(Prompt(f"chat-{c}-{k}", t, list(history)))
            history += random_tokens(rng, rng.randint(64, 256))
            t += rng.expovariate(1 / think_s) + 0.5
    return sorted(out, key=lambda p: p.arrival_s)
