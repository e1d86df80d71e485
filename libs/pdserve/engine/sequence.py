"""One request inside the engine: its tokens, how many have KV, its block table, its state."""

from __future__ import annotations

from collections.abc import Callable
from enum import StrEnum
from itertools import count

import torch

from pdserve.engine.sampler import Sampler
from pdserve.engine.sampling_params import SamplingParams

_arrival = count()

# (layer, first token position, rows [n, 2, num_kv_heads, head_dim]) — called in the forward's thread
KVSink = Callable[[int, int, torch.Tensor], None]


class SequenceStatus(StrEnum):
    RESERVED = "reserved"  # blocks held, KV arriving from elsewhere (decode role); not scheduled
    WAITING = "waiting"  # queued for (re)computation
    RUNNING = "running"  # in the continuous batch
    PARKED = "parked"  # prefilled, blocks held, waiting to be resumed into the decode batch
    FINISHED = "finished"  # blocks freed


class Sequence:
    """A request's token ids (prompt then output) and its KV bookkeeping.

    `num_computed_tokens`: leading tokens whose KV is in this worker's blocks (computed here, hit in the
    prefix cache, or received) and, for a model with recurrent state, folded into its state.
    `num_cached_tokens`: how many tokens' KV came from the prefix cache at the last allocation;
    `cached_tokens_by_tier`: the same split by where it came from ("pool", or a tier below it such as
    "offload": `engine/kv_tiers`), summing to num_cached_tokens.
    `num_checkpoint_tokens`: for a model with recurrent state (`state_pool`), the length of the state
    checkpoint it resumed from at that allocation (<= num_cached_tokens: compute restarts there, the KV of
    the tokens between being held already), else 0; `state_slot`: its slot in the state pool while it
    holds one. `block_table`: block ids in sequence order, `ceil(tokens / block_size)` of them while
    allocated. `cache_salt` is an extra hash key: sequences with different salts never share blocks.
    `stop_after_prefill`: when the prompt's last token is computed, the sampled token is returned (not
    appended) and the sequence leaves the batch: freed (`free_after_prefill`) or parked. `kv_sink`, when
    set, receives each layer's KV rows of positions `num_sent_tokens..` as they are computed (a prefill
    worker streaming to its decode worker); `num_sent_tokens` starts where the decode's own cache ends.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int] | tuple[int, ...],
        sampling: SamplingParams | None = None,
        cache_salt: str | None = None,
        output_start_index: int = 0,
    ) -> None:
        if not prompt_token_ids:
            raise ValueError(f"request {request_id}: empty prompt")
        self.request_id = request_id
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.sampling = sampling or SamplingParams()
        self.sampler = Sampler(self.sampling)
        self.cache_salt = cache_salt
        self.output_start_index = output_start_index
        self.status = SequenceStatus.WAITING
        self.arrival = next(_arrival)
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        self.cached_tokens_by_tier: dict[str, int] = {}  # num_cached_tokens by where they came from
        self.num_checkpoint_tokens = 0
        self.checkpoint_tier = "pool"  # where that checkpoint was: "pool" or a KV tier ("offload", "disk")
        self.state_slot: int | None = None
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []  # chained hashes of the full blocks registered so far
        self.stop_after_prefill = False
        self.free_after_prefill = False
        self.kv_sink: KVSink | None = None
        self.num_sent_tokens = 0
        self.num_chunks_sent = 0
        self.num_preemptions = 0

    def set_sampling(self, sampling: SamplingParams) -> None:
        """Replace the sampling parameters (and start a fresh sampler): a reservation knows the prompt
        before the sampling arrives with the prefill or start command."""
        self.sampling = sampling
        self.sampler = Sampler(sampling)

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_prefill(self) -> bool:
        """More than one token lacks KV: the next step is (a chunk of) a prefill, not a decode step."""
        return self.num_uncomputed_tokens > 1

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id!r}, {self.status}, tokens={len(self)}, "
            f"computed={self.num_computed_tokens}, blocks={self.block_table})"
        )
