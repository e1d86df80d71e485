"""The engine loop: schedule, run one forward over the batch, sample, append, finish — and the entry points
a worker uses in each role (queue a request, reserve blocks for KV arriving from elsewhere, admit it).

For a model with recurrent state (a hybrid: `model_family.CacheSpec.state`), the engine also holds a
`StatePool`: a slot per sequence from admission (or `reserve`) to its end, state checkpoints every
`checkpoint_interval` tokens for prefix caching, and the two calls a disaggregated handoff needs — the whole
state of a sequence after its last prefill chunk (`StepOutput.state` of its `prefill_done` output, or
`read_state` of a parked one) and `install_state` into a sequence reserved with `state_arrives=True`.

With KV tiers (`tiers`: `engine/kv_tiers`, in lookup order), a full cached block the pool evicts is written
down to the write_on="evict" tiers instead of dropped, each newly computed full block goes to the
write_on="compute" tiers, and admission copies a prefix hit found in a tier back into the pool
(`Scheduler`). The sequence's `cached_tokens_by_tier` says where its cached tokens came from. For a model
with recurrent state the state checkpoints follow the blocks: one the state pool evicts is written down to
the evict tiers that hold checkpoints, one saved goes to such compute tiers, and admission resumes from a
tiered checkpoint longer than the pool's (`seq.checkpoint_tier`).
"""

from __future__ import annotations

from collections.abc import Iterable
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass
from typing import NamedTuple

import torch

from pdserve.engine.block_manager import BlockManager, NoFreeBlocks
from pdserve.engine.kv_events import BlockRemoved, BlockStored, CheckpointRemoved, CheckpointStored
from pdserve.engine.kv_tiers.tier import KVTier
from pdserve.engine.kv_tiers.tier_set import KVTierSet
from pdserve.engine.model_family import EngineModel
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.outputs import FinishReason, TokenLogprobs
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import CannotFit, ScheduledSeq, Scheduler, SchedulerConfig
from pdserve.engine.sequence import Sequence, SequenceStatus
from pdserve.engine.state_pool import CheckpointSave, NoFreeStateSlots, SequenceState, StatePool
from pdserve.kernels.kv_pack import pack_kv, token_slots

__all__ = [
    "CannotFit", "EngineConfig", "EngineStats", "LLMEngine", "NoFreeBlocks", "NoFreeStateSlots", "StepOutput",
]


@dataclass(frozen=True)
class EngineConfig:
    """`num_blocks` × `block_size` tokens of KV; `hash_seed` is the cluster-wide prefix-cache hash seed.

    For a model with recurrent state only: `num_state_slots` per-request state slots, live sequences and
    checkpoints together (None: 2 × max_num_seqs); `checkpoint_interval` tokens between state checkpoints,
    a multiple of block_size (None: 4 blocks; 0: no checkpoints, so no prefix hit resumes).
    """

    num_blocks: int
    block_size: int = 16
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    max_model_len: int = 8192
    hash_seed: int = 0
    num_state_slots: int | None = None
    checkpoint_interval: int | None = None


class StepOutput(NamedTuple):
    """What one step did to one sequence that reached a sampled token.

    `new_token_ids`: the token appended to the output ((), when it was a stop token, or for a prefill-only
    sequence); `sampled_token_id`: the token drawn; `finish_reason` set when the sequence ended (its blocks
    are freed); `prefill_done`: a `stop_after_prefill` sequence finished its prompt (it is parked or freed);
    `logprobs`: the sampled token's logprobs when its SamplingParams ask for them (else None); `state`:
    with `prefill_done`, for a model with recurrent state, a copy of the sequence's whole state after its
    prompt (`StatePool.read`: name -> [state layers, ...]), taken before its slot is freed or parked.
    """

    seq: Sequence
    sampled_token_id: int
    new_token_ids: tuple[int, ...]
    finish_reason: FinishReason | None
    prefill_done: bool = False
    logprobs: TokenLogprobs | None = None
    state: SequenceState | None = None


@dataclass
class EngineStats:
    """Counters since start, in tokens (prompt = tokens prefilled; cached = prefix-cache hits)."""

    num_steps: int = 0
    num_prompt_tokens_computed: int = 0
    num_decode_tokens: int = 0
    num_preemptions: int = 0


class StepPlan(NamedTuple):
    """One step between `begin_step` and `finish_step`: the scheduled batch (sequence, new tokens), the
    KV sends of sequences streaming their prompt's KV (sequence, first position, slots), and a hybrid's
    state checkpoints to save (None without state)."""

    batch: list[ScheduledSeq]
    sends: list[tuple[Sequence, int, torch.Tensor]]
    checkpoints: list[tuple[CheckpointSave, ...]] | None


class LLMEngine:
    """Continuous batching over one model and one paged KV cache. Not thread-safe: one caller at a time
    (a worker serializes calls with its compute lock), except that `run_step`, the forward, may run in
    another thread beside the other calls (its docstring says why that is safe).

    `stop_token_ids`: the model's EOS/stop tokens (a sequence with `ignore_eos` runs past them).
    `tiers`: KV tiers below the pool, in lookup order (`kv_tiers.tier.KVTier`); for a model with recurrent
    state they hold its checkpoints too (those with `holds_checkpoints`). `tier_writer_thread`: store
    written-down blocks in a background thread (False: inline, deterministic for tests). Call `close` to
    stop that thread.
    """

    def __init__(
        self, model: EngineModel, config: EngineConfig, stop_token_ids: Iterable[int] = (),
        tiers: SequenceOf[KVTier] = (), tier_writer_thread: bool = True,
    ) -> None:
        self.config = config
        self.model = model
        self.block_manager = BlockManager(config.num_blocks, config.block_size, config.hash_seed)
        layout = model.cache_spec().state
        self.state_pool: StatePool | None = None
        if layout is not None:
            interval = config.checkpoint_interval
            self.state_pool = StatePool(
                layout, config.num_state_slots or 2 * config.max_num_seqs, block_size=config.block_size,
                checkpoint_interval=4 * config.block_size if interval is None else interval,
                device=model.device, dtype=model.dtype,
            )
        max_len = min(config.max_model_len, model.config.max_position_embeddings)
        self.runner = ModelRunner(model, config.num_blocks, config.block_size, self.state_pool)
        self.tiers: KVTierSet | None = None
        if tiers:
            self.tiers = KVTierSet(tiers, self.runner.kv_cache, background=tier_writer_thread)
            self.block_manager.record_evictions = bool(self.tiers.evict_tiers)
            self.block_manager.record_computed = bool(self.tiers.compute_tiers)
            if self.state_pool is not None:
                self._tier_checkpoints(self.state_pool, self.tiers)
        self.scheduler = Scheduler(
            self.block_manager, SchedulerConfig(config.max_num_batched_tokens, config.max_num_seqs, max_len),
            self.state_pool, self.tiers,
        )
        self.stop_token_ids = set(stop_token_ids)
        self.stats = EngineStats()
        self._in_flight: set[int] = set()  # id() of the sequences of the step between begin and finish
        self._freed_in_flight: list[Sequence] = []

    # ------------------------------------------------------------ entry points

    def add_request(self, seq: Sequence) -> None:
        """Queue `seq` to be prefilled (then decoded, unless `stop_after_prefill`). Raises CannotFit."""
        self.scheduler.add(seq)

    def reserve(
        self, seq: Sequence, max_tokens: int, use_prefix_cache: bool = True, state_arrives: bool = False
    ) -> None:
        """Hold blocks for `seq`'s prompt, its cached prefix shared (`seq.num_cached_tokens` leading tokens
        need not arrive), and for a model with state a slot; status RESERVED. `max_tokens`: the output it
        may generate (for the fit check). With state: `state_arrives` = the whole state after the prompt
        will be installed (`install_state`; the decode role), else the slot resumes from the longest
        checkpoint within the hit and `num_computed_tokens` is that checkpoint (a local prefill).
        Raises CannotFit (never), NoFreeBlocks or NoFreeStateSlots (not now)."""
        self.scheduler.check_fits(len(seq) + max_tokens)
        self.scheduler.allocate(seq, use_prefix_cache=use_prefix_cache, resume_state=not state_arrives)
        seq.status = SequenceStatus.RESERVED

    def read_state(self, seq: Sequence) -> SequenceState:
        """A copy of `seq`'s whole recurrent state (every state layer's tensors: name -> [layers, ...],
        `StatePool.read`), e.g. of a parked sequence after its prefill. Raises ValueError for a model
        without state or a sequence holding no slot."""
        return self._states().read(seq)

    def install_state(self, seq: Sequence, state: SequenceState) -> None:
        """Overwrite the state of `seq` (reserved with `state_arrives=True`) with `state` as `read_state`
        gives it — received and verified; with `mark_computed(seq, len(seq))` for its KV, `seq` can be
        admitted. Raises ValueError (nothing written) for a state of another layout."""
        self._states().install(seq, state)

    def mark_computed(self, seq: Sequence, num_tokens: int) -> None:
        """The KV of `seq`'s first `num_tokens` tokens is now in its blocks (received and verified):
        register its full blocks in the prefix cache."""
        seq.num_computed_tokens = num_tokens
        self.block_manager.cache_full_blocks(seq)
        self._write_computed()

    def prefill_held(self, seq: Sequence) -> None:
        """Prefill a RESERVED sequence in its own blocks (a local prefill), then park it."""
        seq.stop_after_prefill, seq.free_after_prefill = True, False
        self.scheduler.add_running(seq)

    def admit(self, seq: Sequence, first_token_id: int) -> FinishReason | None:
        """Append the prompt's sampled first token to a sequence whose prompt KV is complete (reserved and
        received, or parked) and start decoding it; returns the finish reason if that token ends it."""
        seq.stop_after_prefill = False
        reason = self._append(seq, first_token_id)
        if reason is None:
            self.scheduler.add_running(seq)
        return reason

    def free(self, seq: Sequence) -> None:
        """Drop `seq` wherever it is and free its blocks and state slot (finish or abort); idempotent. A
        sequence of the step in flight (between `begin_step` and `finish_step`) keeps its blocks and slot
        until that step's `finish_step`, which skips it: its forward is still writing into them."""
        self.scheduler.remove(seq)
        if id(seq) in self._in_flight:
            if seq.status is not SequenceStatus.FINISHED:
                self._freed_in_flight.append(seq)
        else:
            self.scheduler.release(seq)
        seq.status = SequenceStatus.FINISHED

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> list[list[int]]:
        """Run `prompts` (token ids) to completion together and return each one's output token ids, in
        order: offline batch inference, as vLLM's `LLM.generate`, through the same steps serving runs.
        Raises CannotFit for a prompt that can never run here."""
        seqs = [Sequence(f"generate-{i}", p, sampling) for i, p in enumerate(prompts)]
        for seq in seqs:
            self.add_request(seq)
        while any(s.status is not SequenceStatus.FINISHED for s in seqs):
            self.step()
        return [s.output_token_ids for s in seqs]

    # ------------------------------------------------------------ the loop

    def step(self) -> list[StepOutput]:
        """Schedule, run one forward, sample every sequence whose new tokens reach its end. Empty when
        nothing could be scheduled. `begin_step`, `run_step` and `finish_step` in one call."""
        plan = self.begin_step()
        return [] if plan is None else self.finish_step(plan, self.run_step(plan))

    def begin_step(self) -> StepPlan | None:
        """Schedule the next step (None: nothing could be scheduled). Until its `finish_step`, the batch's
        sequences are in flight: `free` of one of them waits for that `finish_step`."""
        out = self.scheduler.schedule()
        self.stats.num_preemptions += len(out.preempted)
        batch = out.scheduled
        self.scheduler.write_down_evicted()  # growing running sequences may have evicted blocks
        if not batch:
            return None
        checkpoints = None
        if self.state_pool is not None:
            checkpoints = self.state_pool.plan_checkpoints(batch, self.block_manager.chain_hashes)
        self._in_flight = {id(seq) for seq, _ in batch}
        return StepPlan(batch, self._planned_sends(batch), checkpoints)

    def run_step(self, plan: StepPlan) -> torch.Tensor:
        """The forward of a planned step: the logits of each sequence's last new token, [len(batch),
        vocab_size] fp32. It reads only the plan's sequences (their block tables and positions) and writes
        only their KV blocks and state slots, so the other entry points (`add_request`, `reserve`,
        `admit`, `free`, ...) may be called beside it from another thread, one at a time: a worker takes
        new requests and reservations while a step computes instead of after it."""
        hook = None
        if plan.sends:

            def hook(layer: int, kv_layer: torch.Tensor) -> None:
                for seq, start, slots in plan.sends:
                    assert seq.kv_sink is not None
                    seq.kv_sink(layer, start, pack_kv(kv_layer, slots))

        try:
            return self.runner.execute(plan.batch, hook, plan.checkpoints)
        except BaseException:
            if plan.checkpoints is not None:
                self.state_pool.cancel_checkpoints(plan.checkpoints)
            for seq in self._land():  # the step is over: nothing computed, nothing writes any more
                self.scheduler.release(seq)
            raise

    def finish_step(self, plan: StepPlan, logits: torch.Tensor) -> list[StepOutput]:
        """Advance, sample and append for every sequence of `plan` (`logits` from its `run_step`); a
        sequence freed while it was in flight is skipped, and freed now."""
        freed = self._land()
        skipped = {id(seq) for seq in freed}
        if plan.checkpoints is not None:
            self.state_pool.commit_checkpoints(plan.checkpoints)
        for seq, start, slots in plan.sends:
            seq.num_sent_tokens = start + len(slots)
            seq.num_chunks_sent += 1
        self.stats.num_steps += 1
        results: list[StepOutput] = []
        greedy = logits.argmax(-1).tolist()  # one argmax for the batch; sampled rows draw their own
        for (seq, n), row, argmax in zip(plan.batch, logits, greedy, strict=True):
            if id(seq) in skipped:
                continue
            start = seq.num_computed_tokens
            in_prompt = max(0, min(start + n, seq.num_prompt_tokens) - start)
            self.stats.num_prompt_tokens_computed += in_prompt
            self.stats.num_decode_tokens += n - in_prompt
            seq.num_computed_tokens += n
            self.block_manager.cache_full_blocks(seq)
            self._write_computed()
            if seq.num_computed_tokens < len(seq):
                continue  # a prefill chunk short of the prompt's end: nothing to sample
            token = argmax if seq.sampling.temperature == 0 else seq.sampler.sample(row)
            logprobs = seq.sampler.logprobs(row, token)
            if seq.stop_after_prefill:
                state = self.state_pool.read(seq) if self.state_pool is not None else None
                self.scheduler.remove(seq)
                if seq.free_after_prefill:
                    self.free(seq)
                else:
                    seq.status = SequenceStatus.PARKED
                results.append(
                    StepOutput(seq, token, (), None, prefill_done=True, logprobs=logprobs, state=state)
                )
                continue
            reason = self._append(seq, token)
            appended = () if reason is FinishReason.STOP else (token,)
            results.append(StepOutput(seq, token, appended, reason, logprobs=logprobs))
        for seq in freed:
            self.scheduler.release(seq)
        return results

    def _land(self) -> list[Sequence]:
        """End the step in flight: nothing is in flight any more; returns the sequences `free`d meanwhile,
        whose blocks and slot are still held (the forward was writing into them)."""
        freed, self._freed_in_flight = self._freed_in_flight, []
        self._in_flight = set()
        return freed

    @staticmethod
    def _tier_checkpoints(pool: StatePool, tiers: KVTierSet) -> None:
        """Wire the state pool's checkpoints to the tiers: evicted ones written down, saved ones stored."""
        if tiers.wants_checkpoints("evict"):
            pool.on_checkpoint_evicted = (
                lambda h, n, slot: tiers.write_down_checkpoint(h, n, pool.pack_slot(slot)))
        if tiers.wants_checkpoints("compute"):
            pool.on_checkpoint_saved = (
                lambda h, n, slot: tiers.write_computed_checkpoint(h, n, pool.pack_slot(slot)))

    def _write_computed(self) -> None:
        if self.tiers is not None:
            self.tiers.write_computed(self.block_manager.take_computed())

    def take_kv_events(self) -> list[BlockStored | BlockRemoved | CheckpointStored | CheckpointRemoved]:
        """KV cache events since the last call: the pool's (`BlockManager.take_events`), then the tiers'
        (`KVTierSet.take_events`, labelled by tier), then a hybrid's state checkpoints'
        (`StatePool.take_events`)."""
        events: list[BlockStored | BlockRemoved | CheckpointStored | CheckpointRemoved] = [
            *self.block_manager.take_events()]
        if self.tiers is not None:
            events += self.tiers.take_events()
        if self.state_pool is not None:
            events += self.state_pool.take_events()
        return events

    def flush_tiers(self) -> None:
        """Wait until every block written down so far is stored in its tiers (no-op without tiers)."""
        if self.tiers is not None:
            self.tiers.flush()

    def close(self) -> None:
        """Store pending tier writes and stop the tier writer thread (idempotent)."""
        if self.tiers is not None:
            self.tiers.close()

    def _planned_sends(self, batch: list[ScheduledSeq]) -> list[tuple[Sequence, int, torch.Tensor]]:
        """For sequences streaming KV: the positions each sends this step (`num_sent_tokens` up to the end
        of its new tokens, within the prompt) as slots in its blocks."""
        sends = []
        for seq, n in batch:
            if seq.kv_sink is None:
                continue
            start, end = seq.num_sent_tokens, min(seq.num_computed_tokens + n, seq.num_prompt_tokens)
            if end > start:
                slots = token_slots(seq.block_table, start, end, self.config.block_size, self.model.device)
                sends.append((seq, start, slots))
        return sends

    def _states(self) -> StatePool:
        if self.state_pool is None:
            raise ValueError("this model has no recurrent state")
        return self.state_pool

    def is_stop_token(self, token: int, sampling: SamplingParams) -> bool:
        """Whether `token` ends a sequence sampled under `sampling` (the model's stop tokens or the
        request's own, unless it ignores EOS); such a token is not part of the output."""
        return not sampling.ignore_eos and (token in self.stop_token_ids or token in sampling.stop_token_ids)

    def _append(self, seq: Sequence, token: int) -> FinishReason | None:
        """Append a sampled token and finish (free) the sequence if it ended; a stop token is not kept."""
        seq.token_ids.append(token)
        p = seq.sampling
        reason: FinishReason | None = None
        if self.is_stop_token(token, p):
            reason = FinishReason.STOP
            seq.token_ids.pop()  # a stop token ends the text; it is not part of it (as in vLLM)
        elif seq.output_start_index + seq.num_output_tokens >= p.max_tokens:
            reason = FinishReason.LENGTH
        elif len(seq) >= self.scheduler.config.max_model_len:
            reason = FinishReason.LENGTH
        if reason is not None:
            self.free(seq)
        return reason
