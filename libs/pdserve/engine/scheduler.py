"""Continuous batching: which sequences run in the next forward, and how many tokens each.

vLLM's v1 scheduler policy, in nano-vllm's size: a step has a token budget (`max_num_batched_tokens`);
running sequences go first, decodes (one token each) before prefill chunks, then waiting sequences are
admitted first come first served while budget, sequence slots and blocks last. A prefill longer than the
remaining budget is cut into chunks (chunked prefill). When a running sequence needs a block and none is
free, the newest running sequence is preempted by recompute: its blocks are freed and it goes back to the
front of the queue, to be prefilled again (prompt + output so far) when blocks free up.

A model with recurrent state (a hybrid) also needs a state slot per sequence (`state_pool.StatePool`):
admission takes one beside the blocks (and resumes from the longest state checkpoint within the KV prefix
hit); preemption and `release` give both back.

With KV tiers below the pool (`kv_tiers.KVTierSet`), admission continues a pool prefix hit into the tiers:
the blocks the allocation evicted are written down first (their KV still in place), then the leading
blocks after the pool hit that a tier holds are copied back into the sequence's new blocks and registered
as cached, so its prefill starts after them. For a hybrid the hit is the pair (KV hit L, checkpoint C <= L):
when the state pool's own checkpoint is missing or shorter than the longest checkpoint position within L, the
tiers are asked for the longest one longer than the pool's (`KVTierSet.load_checkpoint`, falling back to
shorter ones on a failed read); one found is restored into the new slot and the prefill resumes from it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import NamedTuple

import torch

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.kv_tiers.tier_set import KVTierSet
from pdserve.engine.sequence import Sequence, SequenceStatus
from pdserve.engine.state_pool import NoFreeStateSlots, StatePool


class CannotFit(ValueError):
    """A request that could never run on this engine, whatever else is running (the reason says why)."""


@dataclass(frozen=True)
class SchedulerConfig:
    """`max_num_batched_tokens`: tokens per forward (prefill chunks + decodes); `max_num_seqs`: sequences
    in the running batch; `max_model_len`: prompt + output tokens of one sequence."""

    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    max_model_len: int = 8192


class ScheduledSeq(NamedTuple):
    """`seq` computes tokens `seq.num_computed_tokens .. + num_new_tokens - 1` in this step."""

    seq: Sequence
    num_new_tokens: int


class SchedulerOutput(NamedTuple):
    scheduled: list[ScheduledSeq]
    preempted: list[Sequence]


class Scheduler:
    """Owns the waiting queue and the running batch; draws blocks from `block_manager` and, for a model
    with recurrent state, state slots from `state_pool`."""

    def __init__(
        self, block_manager: BlockManager, config: SchedulerConfig, state_pool: StatePool | None = None,
        tiers: KVTierSet | None = None,
    ) -> None:
        if config.max_num_batched_tokens < 1 or config.max_num_seqs < 1:
            raise ValueError(f"budgets must be positive: {config}")
        self.block_manager = block_manager
        self.state_pool = state_pool
        self.tiers = tiers
        self.config = config
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def check_fits(self, num_tokens: int) -> None:
        """Raises CannotFit when a sequence of `num_tokens` tokens (prompt + max output) can never be held."""
        bm = self.block_manager
        if num_tokens > self.config.max_model_len:
            raise CannotFit(
                f"{num_tokens} tokens (prompt + max_tokens) exceed max_model_len {self.config.max_model_len}"
            )
        if bm.blocks_for(num_tokens) > bm.num_blocks:
            raise CannotFit(
                f"{num_tokens} tokens (prompt + max_tokens) need {bm.blocks_for(num_tokens)} blocks "
                f"of {bm.block_size}; the KV cache has {bm.num_blocks}"
            )

    def can_allocate(self, seq: Sequence) -> bool:
        """Whether `allocate(seq)` would succeed now: blocks for its tokens and, with state, a slot."""
        has_slot = self.state_pool is None or self.state_pool.can_allocate()
        return has_slot and self.block_manager.can_allocate(seq)

    def allocate(self, seq: Sequence, use_prefix_cache: bool = True, resume_state: bool = True) -> None:
        """Give `seq` blocks for its tokens (its cached prefix shared unless not `use_prefix_cache`) and,
        with state, a slot: resumed from the longest checkpoint within the hit when `resume_state` (compute
        restarts there: `num_computed_tokens` = `num_checkpoint_tokens`), else left for `install` (the
        state arrives whole: `num_computed_tokens` = `num_cached_tokens`).
        Raises NoFreeBlocks or NoFreeStateSlots, with nothing held."""
        if self.state_pool is not None and not self.state_pool.can_allocate():
            raise NoFreeStateSlots(f"{seq.request_id}: no free state slot")
        self.block_manager.allocate(seq, use_prefix_cache=use_prefix_cache)
        if self.tiers is not None:
            self.write_down_evicted()
            if use_prefix_cache:
                self._load_from_tiers(seq)
        if self.state_pool is not None:
            resume = resume_state and use_prefix_cache
            seq.checkpoint_tier = "pool"
            restored = self._checkpoint_from_tiers(seq) if resume else None
            self.state_pool.allocate(seq, resume=resume, restored=restored)

    def _checkpoint_from_tiers(self, seq: Sequence) -> tuple[int, torch.Tensor] | None:
        """A checkpoint within `seq`'s KV hit longer than the state pool's own, read back from the tiers
        (num_tokens, packed state), or None; sets `seq.checkpoint_tier` to where the resumed one is."""
        pool = self.state_pool
        assert pool is not None
        if self.tiers is None:
            return None
        found = pool.find_checkpoint(seq)
        candidates = pool.checkpoint_candidates(seq, longer_than=found[1][1] if found else 0)
        if not candidates:
            return None
        packed = torch.empty(pool.packed_bytes, dtype=torch.uint8)
        got = self.tiers.load_checkpoint(candidates, packed)
        if got is None:
            return None
        seq.checkpoint_tier = got[1]
        return got[0], packed

    def write_down_evicted(self) -> None:
        """Hand the blocks evicted since the last call to the tiers (snapshotted now, before anything
        writes into them); called after every allocation, before the forward or a transfer."""
        if self.tiers is not None:
            self.tiers.write_down(self.block_manager.take_evicted())

    def _load_from_tiers(self, seq: Sequence) -> None:
        assert self.tiers is not None
        bm = self.block_manager
        start, limit = len(seq.block_hashes), bm.hit_limit(seq)
        if start >= limit:
            return
        hashes = bm.chain_hashes(seq, limit)[start:]
        loaded = self.tiers.load(hashes, seq.block_table[start:limit])
        bm.register_loaded(seq, loaded)

    def release(self, seq: Sequence) -> None:
        """Free what `seq` holds: its blocks and its state slot (idempotent)."""
        if seq.block_table:
            self.block_manager.free(seq)
        if self.state_pool is not None:
            self.state_pool.free(seq)

    def max_tokens_of(self, seq: Sequence) -> int:
        """Most tokens `seq` can reach: its tokens now plus the output it may still generate."""
        remaining = seq.sampling.max_tokens - seq.output_start_index - seq.num_output_tokens
        return len(seq) + max(remaining, 0)

    def add(self, seq: Sequence) -> None:
        """Queue a sequence holding no blocks. Raises CannotFit."""
        self.check_fits(self.max_tokens_of(seq))
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """Put a sequence that already holds its blocks (reserved or parked) into the running batch."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Take `seq` out of the queue or batch (it keeps its blocks)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        """The next step's batch. Every scheduled sequence holds blocks for the tokens it computes."""
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        preempted: list[Sequence] = []
        bm = self.block_manager
        # decodes first (arrival order), then running prefill chunks
        for seq in sorted(self.running, key=lambda s: (s.is_prefill, s.arrival)):
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted while making room for an earlier one
            n = min(seq.num_uncomputed_tokens, budget)
            end = seq.num_computed_tokens + n
            while not bm.can_append_slots(seq, end):
                victim = max(self.running, key=lambda s: s.arrival)
                self._preempt(victim)
                preempted.append(victim)
                for i, (s, k) in enumerate(scheduled):
                    if s is victim:
                        del scheduled[i]
                        budget += k
                        break
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                continue
            bm.append_slots(seq, end)
            scheduled.append(ScheduledSeq(seq, n))
            budget -= n
        if preempted:
            return SchedulerOutput(scheduled, preempted)
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if not self.can_allocate(seq):
                break
            self.allocate(seq)
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            n = min(seq.num_uncomputed_tokens, budget)
            scheduled.append(ScheduledSeq(seq, n))
            budget -= n
        return SchedulerOutput(scheduled, preempted)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.release(seq)
        seq.num_computed_tokens = 0
        seq.num_cached_tokens = 0
        seq.cached_tokens_by_tier = {}
        seq.num_checkpoint_tokens = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
