"""The per-request recurrent state of a hybrid model's linear-attention layers, in a pool of slots, with
state checkpoints for prefix caching.

A KDA layer (kernels/gated_delta_rule.py, kernels/short_conv.py) carries, per request, a recurrent state and
a conv state that every token overwrites: no position structure, so no pages. Each such tensor lives in one
preallocated pool per layer, `[num_slots, *shape]`; a request holds one *slot* — the same index in every
layer's pools — from admission until it finishes, aborts or is preempted (zeroed when taken: the state
before the first token). The pool's capacity is its own, beside the KV blocks': admission needs a free block
budget *and* a slot (`can_allocate`).

Prefix caching for such a model (the KV of MLA layers is paged and shared as for Llama, `block_manager`): the
state after token p exists only if it was saved then. Every `checkpoint_interval` tokens (a multiple of the
block size; 0 = never) the engine copies a computing sequence's slot into a free slot and registers that
copy under the chained hash of the block ending at p (`block_hash`: equal hashes, equal prefixes, same
`cache_salt`). A sequence admitted with a KV prefix hit of L tokens resumes from the longest checkpoint
C <= L (C a multiple of the interval): its state is copied from the checkpoint, and it computes tokens
C.. (the KV of C..L is already held and is not written again). The hit is the pair (L, C), on the sequence
as `num_cached_tokens` and `num_checkpoint_tokens`.

Slots are live (held by a sequence), checkpoints (evictable, least recently used first) or free. A live
allocation takes a free slot, else evicts the oldest checkpoint; a checkpoint is saved only into a free or
evicted-checkpoint slot, never a live one (when every slot is live, the checkpoint is skipped).

With KV tiers below the pools (`engine/kv_tiers`), a checkpoint the pool evicts is handed, packed
(`pack_slot`), to `on_checkpoint_evicted` before its slot is reused, and one just saved to
`on_checkpoint_saved`; at admission a longer checkpoint read back from a tier can be restored into the new
slot instead (`allocate(restored=...)`, the candidates from `checkpoint_candidates`).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from typing import NamedTuple

import torch

from pdserve.engine.kv_events import CheckpointRemoved, CheckpointStored
from pdserve.engine.sequence import Sequence

# name -> [num_layers, *shape]: every state layer's tensor of that name for one sequence (see `read`)
SequenceState = dict[str, torch.Tensor]


class NoFreeStateSlots(Exception):
    """Every state slot is held by a live sequence right now."""


class StateTensor(NamedTuple):
    """One per-request tensor of a state layer: its name, per-slot shape, and dtype (None: the model's)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype | None = None


class StateLayout(NamedTuple):
    """What a model's state layers hold per request: `num_layers` layers, each with these tensors."""

    num_layers: int
    tensors: tuple[StateTensor, ...]

    def bytes_per_slot(self, dtype: torch.dtype) -> int:
        """Bytes of one request's state over all layers (tensors without a dtype of their own in `dtype`)."""
        total = 0
        for t in self.tensors:
            numel = 1
            for size in t.shape:
                numel *= size
            total += numel * (t.dtype or dtype).itemsize
        return total * self.num_layers


class CheckpointSave(NamedTuple):
    """A checkpoint planned for one step: after `num_tokens` tokens of its sequence (`offset` of them new
    in this step) copy the sequence's slot into `slot`; registered under `block_hash` once computed."""

    offset: int
    slot: int
    num_tokens: int
    block_hash: int


class StatePool:
    """`num_slots` slots of every state layer's tensors, on `device`; checkpoints every
    `checkpoint_interval` tokens. Not thread-safe: one caller at a time (as the block manager).

    `tensors[name][layer]`: [num_slots, *shape] — e.g. for KDA `recurrent`: [num_slots, heads, d_k, d_v]
    fp32 and `conv`: [num_slots, K - 1, conv_dim].
    """

    def __init__(
        self, layout: StateLayout, num_slots: int, *, block_size: int, checkpoint_interval: int = 0,
        device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
    ) -> None:
        if num_slots < 1:
            raise ValueError(f"a state pool needs at least one slot, got {num_slots}")
        if checkpoint_interval < 0 or checkpoint_interval % block_size:
            raise ValueError(
                f"checkpoint_interval {checkpoint_interval} must be a non-negative multiple of the "
                f"block size {block_size}"
            )
        self.layout = layout
        self.num_slots = num_slots
        self.block_size = block_size
        self.checkpoint_interval = checkpoint_interval
        self.tensors: dict[str, list[torch.Tensor]] = {
            t.name: [
                torch.zeros(num_slots, *t.shape, dtype=t.dtype or dtype, device=device)
                for _ in range(layout.num_layers)
            ]
            for t in layout.tensors
        }
        self.free_slots: deque[int] = deque(range(num_slots))
        self.live: dict[int, str] = {}  # slot -> request id
        # block hash -> (slot, tokens), least recently used first
        self.checkpoints: OrderedDict[int, tuple[int, int]] = OrderedDict()
        self.events: list[CheckpointStored | CheckpointRemoved] = []
        self.num_checkpoint_hits = 0  # admissions that resumed from a checkpoint
        self.num_checkpoint_tokens = 0  # tokens those checkpoints covered
        # (block_hash, num_tokens, slot): a checkpoint leaving / entering the pool, its state still in `slot`
        self.on_checkpoint_evicted: Callable[[int, int, int], None] | None = None
        self.on_checkpoint_saved: Callable[[int, int, int], None] | None = None

    # ------------------------------------------------------------ capacity

    @property
    def num_live(self) -> int:
        return len(self.live)

    @property
    def num_free_slots(self) -> int:
        """Slots a live allocation could take now: free ones and checkpoints (evictable)."""
        return len(self.free_slots) + len(self.checkpoints)

    def can_allocate(self) -> bool:
        return self.num_free_slots > 0

    def usage(self) -> float:
        """Fraction of slots held by live sequences, 0..1."""
        return self.num_live / self.num_slots

    # ------------------------------------------------------------ allocate / free

    def allocate(
        self, seq: Sequence, resume: bool = True, restored: tuple[int, torch.Tensor] | None = None
    ) -> None:
        """Give `seq` (holding no slot) a zeroed slot. With `resume`, restore the longest checkpoint within
        its KV prefix hit (`seq.num_cached_tokens`, chained hashes in `seq.block_hashes`, as
        `BlockManager.allocate` leaves them) and set `num_checkpoint_tokens` = `num_computed_tokens` = its
        length (0 without one). Without `resume` (the state will be installed: `install`), neither changes
        but `num_checkpoint_tokens` = 0. `restored` (with `resume`): (num_tokens, packed state as
        `pack_slot` gives it), a checkpoint read back from a tier, used instead of the pool's.
        Raises NoFreeStateSlots (nothing changed), ValueError when `seq` holds a slot."""
        if seq.state_slot is not None:
            raise ValueError(f"{seq.request_id} already holds state slot {seq.state_slot}")
        found = self.find_checkpoint(seq) if resume and restored is None else None
        if found is not None:
            self.checkpoints.move_to_end(found[0])  # most recently used: evicted last
        slot = self._take_slot(evict=True)
        if slot is None:
            raise NoFreeStateSlots(f"{seq.request_id}: all {self.num_slots} state slots are live")
        self.live[slot] = seq.request_id
        seq.state_slot = slot
        seq.num_checkpoint_tokens = 0
        if resume and restored is not None:
            self.unpack_slot(slot, restored[1])
            seq.num_checkpoint_tokens = restored[0]
            self.num_checkpoint_hits += 1
            self.num_checkpoint_tokens += restored[0]
        elif found is None:
            self._zero(slot)
        else:
            _, (source, num_tokens) = found
            if source != slot:  # else the checkpoint itself was the slot left to take: adopted as it is
                self._copy(source, slot)
            seq.num_checkpoint_tokens = num_tokens
            self.num_checkpoint_hits += 1
            self.num_checkpoint_tokens += num_tokens
        if resume:
            seq.num_computed_tokens = seq.num_checkpoint_tokens

    def free(self, seq: Sequence) -> None:
        """Return `seq`'s slot (if it holds one) to the free list; idempotent."""
        if seq.state_slot is None:
            return
        del self.live[seq.state_slot]
        self.free_slots.append(seq.state_slot)
        seq.state_slot = None

    # ------------------------------------------------------------ a sequence's whole state

    def read(self, seq: Sequence) -> SequenceState:
        """A copy of `seq`'s state in every layer: name -> [num_layers, *shape] (e.g. for KDA
        `recurrent` [layers, heads, d_k, d_v] fp32, `conv` [layers, K - 1, conv_dim]), the sender's own.
        Raises ValueError when `seq` holds no slot."""
        slot = self._slot_of(seq)
        return {name: torch.stack([pool[slot] for pool in pools]) for name, pools in self.tensors.items()}

    def install(self, seq: Sequence, state: SequenceState) -> None:
        """Overwrite `seq`'s slot with `state` (as `read` returns it; e.g. received from a prefill worker).
        Raises ValueError (nothing written) when `seq` holds no slot, or a tensor is missing, extra, or of
        another shape or dtype."""
        slot = self._slot_of(seq)
        if set(state) != set(self.tensors):
            raise ValueError(f"state tensors {sorted(state)} are not {sorted(self.tensors)}")
        for name, pools in self.tensors.items():
            want = (len(pools), *pools[0].shape[1:])
            if tuple(state[name].shape) != want or state[name].dtype != pools[0].dtype:
                raise ValueError(f"state {name!r}: {tuple(state[name].shape)} {state[name].dtype}, "
                                 f"expected {want} {pools[0].dtype}")
        for name, pools in self.tensors.items():
            for layer, pool in enumerate(pools):
                pool[slot].copy_(state[name][layer])

    # ------------------------------------------------------------ checkpoints

    def find_checkpoint(self, seq: Sequence) -> tuple[int, tuple[int, int]] | None:
        """The longest checkpoint within `seq`'s KV prefix hit: (block hash, (slot, num_tokens)), or None."""
        interval = self.checkpoint_interval
        if not interval:
            return None
        for num_tokens in range(seq.num_cached_tokens // interval * interval, 0, -interval):
            block_hash = seq.block_hashes[num_tokens // self.block_size - 1]
            if block_hash in self.checkpoints:
                return block_hash, self.checkpoints[block_hash]
        return None

    def checkpoint_candidates(self, seq: Sequence, longer_than: int = 0) -> list[tuple[int, int]]:
        """Every checkpoint position within `seq`'s KV prefix hit longer than `longer_than` tokens, as
        (block hash, num_tokens), longest first: where a tier may hold one to resume from."""
        interval = self.checkpoint_interval
        if not interval:
            return []
        return [(seq.block_hashes[n // self.block_size - 1], n)
                for n in range(seq.num_cached_tokens // interval * interval, longer_than, -interval)]

    @property
    def packed_bytes(self) -> int:
        """Bytes of one slot's state packed (`pack_slot`): `layout.bytes_per_slot` of the pool's dtypes."""
        return sum(pool[0].numel() * pool[0].element_size() for pools in self.tensors.values()
                   for pool in pools[:1]) * self.layout.num_layers

    def pack_slot(self, slot: int) -> torch.Tensor:
        """A copy of slot `slot`'s whole state as one uint8 CPU tensor [packed_bytes]: each state tensor
        (layout order) of each layer, its bytes concatenated — what a KV tier stores as a checkpoint."""
        parts = [pool[slot].contiguous().reshape(-1).view(torch.uint8)
                 for pools in self.tensors.values() for pool in pools]
        return torch.cat(parts).cpu()

    def unpack_slot(self, slot: int, packed: torch.Tensor) -> None:
        """Overwrite slot `slot` with a state packed by `pack_slot`. Raises ValueError for another size."""
        if packed.dtype != torch.uint8 or packed.numel() != self.packed_bytes:
            raise ValueError(
                f"{packed.numel()} packed {packed.dtype} bytes, expected {self.packed_bytes} uint8")
        offset = 0
        for pools in self.tensors.values():
            for pool in pools:
                target = pool[slot]
                n = target.numel() * target.element_size()
                src = packed[offset:offset + n].to(target.device).view(target.dtype).view(target.shape)
                target.copy_(src)
                offset += n

    def plan_checkpoints(
        self, batch: Iterable[tuple[Sequence, int]], hashes: Callable[[Sequence, int], list[int]]
    ) -> list[tuple[CheckpointSave, ...]]:
        """For each scheduled (sequence, new tokens): the checkpoints its new tokens cross (positions p,
        a multiple of the interval, within them) that are not stored yet, each with a slot taken for it
        — the latest first, so when slots run short the longest prefixes are the ones saved — in position
        order. `hashes(seq, num_blocks)`: the chained hashes of its first blocks.
        Hand the plan to the forward, then to `commit_checkpoints` (or `cancel_checkpoints`)."""
        plan: list[tuple[CheckpointSave, ...]] = []
        interval = self.checkpoint_interval
        for seq, num_new in batch:
            saves: list[CheckpointSave] = []
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + num_new
            last = end // interval * interval if interval else 0
            for num_tokens in range(last, start, -interval or -1):  # latest first: the most useful
                block_hash = hashes(seq, num_tokens // self.block_size)[-1]
                if block_hash in self.checkpoints:
                    continue
                slot = self._take_slot(evict=True)
                if slot is None:
                    break
                saves.append(CheckpointSave(num_tokens - start, slot, num_tokens, block_hash))
            plan.append(tuple(reversed(saves)))
        return plan

    def commit_checkpoints(self, plan: list[tuple[CheckpointSave, ...]]) -> None:
        """Register the planned checkpoints (now written by the forward): CheckpointStored events."""
        for saves in plan:
            for save in saves:
                if save.block_hash in self.checkpoints:  # two sequences of one step saved the same prefix
                    self.free_slots.append(save.slot)
                    continue
                self.checkpoints[save.block_hash] = (save.slot, save.num_tokens)
                self.events.append(CheckpointStored(block_hash=save.block_hash, num_tokens=save.num_tokens))
                if self.on_checkpoint_saved is not None:
                    self.on_checkpoint_saved(save.block_hash, save.num_tokens, save.slot)

    def cancel_checkpoints(self, plan: list[tuple[CheckpointSave, ...]]) -> None:
        """Return a plan's slots unregistered (its forward did not run)."""
        self.free_slots.extend(save.slot for saves in plan for save in saves)

    def copy_slot(self, source: int, target: int, layer: int | None = None) -> None:
        """Copy every tensor of slot `source` into slot `target`, in one layer or (None) all."""
        for pools in self.tensors.values():
            for pool in pools if layer is None else (pools[layer],):
                pool[target].copy_(pool[source])

    def take_events(self) -> list[CheckpointStored | CheckpointRemoved]:
        """Checkpoint events since the last call, oldest first."""
        events, self.events = self.events, []
        return events

    # ------------------------------------------------------------ internals

    def _slot_of(self, seq: Sequence) -> int:
        if seq.state_slot is None:
            raise ValueError(f"{seq.request_id} holds no state slot")
        return seq.state_slot

    def _take_slot(self, evict: bool) -> int | None:
        if self.free_slots:
            return self.free_slots.popleft()
        if evict and self.checkpoints:
            block_hash, (slot, num_tokens) = self.checkpoints.popitem(last=False)
            self.events.append(CheckpointRemoved(block_hashes=(block_hash,)))
            if self.on_checkpoint_evicted is not None:  # its state is still in the slot: snapshot now
                self.on_checkpoint_evicted(block_hash, num_tokens, slot)
            return slot
        return None

    def _zero(self, slot: int) -> None:
        for pools in self.tensors.values():
            for pool in pools:
                pool[slot].zero_()

    def _copy(self, source: int, target: int) -> None:
        self.copy_slot(source, target)
