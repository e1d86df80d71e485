"""Synthetic request sets, prompts as token ids (the gateway takes `prompt: [ids]`, so lengths are exact
and no tokenizer is needed on the client).

- `random`: vLLM's RandomDataset (vllm/benchmarks/datasets/random.py): input and output lengths drawn
  uniformly from [⌊L·(1−r)⌋, ⌈L·(1+r)⌉] with r the range ratio (0 ≤ r < 1), an optional fixed prefix.
- `prefix_repetition`: vLLM's PrefixRepetitionRandomDataset (vllm/benchmarks/datasets/prefix_repetition.py):
  `num_prefixes` random prefixes, each followed by n/num_prefixes distinct random suffixes, shuffled.
- `shared_prefix`: multi-turn conversations over shared system prompts (SGLang's generated-shared-prefix
  set, extended to turns as vLLM's benchmarks/multi_turn does): conversation c uses system prompt
  c mod num_prefixes; turn t's prompt is the system prompt, then every earlier question and a stand-in
  answer of `output_len` tokens, then question t. Turn t of a conversation is sent only after turn t−1
  has finished (`SampleRequest.after`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

DATASETS = ("random", "prefix_repetition", "shared_prefix")
# SmolLM2's special tokens sit at the bottom of its 49,152-token vocabulary; ids from here up are text.
DEFAULT_TOKEN_RANGE = (1000, 40000)


@dataclass(frozen=True)
class SampleRequest:
    """One request to send. `prompt`: token ids; `output_len`: max_tokens (with ignore_eos, exactly the
    tokens produced). `after`: index of the request that must finish before this one is sent (the previous
    turn of a conversation), or None."""

    prompt: list[int]
    output_len: int
    conversation: int | None = None
    turn: int = 0
    after: int | None = None

    @property
    def prompt_len(self) -> int:
        return len(self.prompt)


def _tokens(rng: np.random.Generator, n: int, token_range: tuple[int, int]) -> list[int]:
    return rng.integers(token_range[0], token_range[1], size=n).tolist()


def random_dataset(num_requests: int, input_len: int, output_len: int, range_ratio: float = 0.0,
                   prefix_len: int = 0, seed: int = 0,
                   token_range: tuple[int, int] = DEFAULT_TOKEN_RANGE) -> list[SampleRequest]:
    """`num_requests` prompts of `prefix_len` shared tokens + a length drawn around `input_len`, outputs
    drawn around `output_len` (at least 1). Raises ValueError when `range_ratio` is outside [0, 1) or a
    prompt could be empty."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")
    in_lo, in_hi = math.floor(input_len * (1 - range_ratio)), math.ceil(input_len * (1 + range_ratio))
    out_lo = max(1, math.floor(output_len * (1 - range_ratio)))
    out_hi = max(1, math.ceil(output_len * (1 + range_ratio)))
    if prefix_len + in_lo < 1:
        raise ValueError("input_len/prefix_len/range_ratio allow an empty prompt")
    rng = np.random.default_rng(seed)
    prefix = _tokens(rng, prefix_len, token_range)
    in_lens = rng.integers(in_lo, in_hi + 1, size=num_requests)
    out_lens = rng.integers(out_lo, out_hi + 1, size=num_requests)
    return [SampleRequest(prefix + _tokens(rng, int(n_in), token_range), int(n_out))
            for n_in, n_out in zip(in_lens, out_lens, strict=True)]


def prefix_repetition_dataset(num_requests: int, prefix_len: int, suffix_len: int, num_prefixes: int,
                              output_len: int, seed: int = 0,
                              token_range: tuple[int, int] = DEFAULT_TOKEN_RANGE) -> list[SampleRequest]:
    """num_prefixes × (num_requests // num_prefixes) prompts of `prefix_len + suffix_len` tokens, shuffled.
    Raises ValueError when num_requests < num_prefixes (vLLM's check)."""
    per_prefix = num_requests // max(num_prefixes, 1)
    if num_prefixes < 1 or per_prefix == 0:
        raise ValueError(f"num_requests ({num_requests}) must be ≥ num_prefixes ({num_prefixes}) ≥ 1")
    rng = np.random.default_rng(seed)
    out: list[SampleRequest] = []
    for _ in range(num_prefixes):
        prefix = _tokens(rng, prefix_len, token_range)
        out += [SampleRequest(prefix + _tokens(rng, suffix_len, token_range), output_len)
                for _ in range(per_prefix)]
    order = rng.permutation(len(out))
    return [out[i] for i in order]


def shared_prefix_dataset(num_conversations: int, num_turns: int, system_prompt_len: int, question_len: int,
                          output_len: int, num_prefixes: int = 1, seed: int = 0,
                          token_range: tuple[int, int] = DEFAULT_TOKEN_RANGE) -> list[SampleRequest]:
    """`num_conversations × num_turns` requests ordered turn-major (every first turn, then every second…),
    each turn chained to the previous one of its conversation by `after`. Raises ValueError on a count
    below 1."""
    if min(num_conversations, num_turns, num_prefixes) < 1:
        raise ValueError("num_conversations, num_turns and num_prefixes must be at least 1")
    rng = np.random.default_rng(seed)
    systems = [_tokens(rng, system_prompt_len, token_range) for _ in range(num_prefixes)]
    histories = [list(systems[c % num_prefixes]) for c in range(num_conversations)]
    out: list[SampleRequest] = []
    last_index: list[int | None] = [None] * num_conversations
    for turn in range(num_turns):
        for c in range(num_conversations):
            histories[c] += _tokens(rng, question_len, token_range)
            out.append(SampleRequest(list(histories[c]), output_len, conversation=c, turn=turn,
                                     after=last_index[c]))
            last_index[c] = len(out) - 1
            # The model's real answer is not known up front; a fixed stand-in keeps prompts reproducible.
            histories[c] += _tokens(rng, output_len, token_range)
    return out
