"""The router's KV index: which workers hold which prefix-cache blocks, from the workers' KV events.

Block hash → bitmask of worker slots, plus each worker's set of hashes (to wipe it at once). Fed by
`KVEvents` batches (vLLM's KV events: BlockStored, BlockRemoved, AllBlocksCleared) and checked against
`KVDigest`s. The index may *under*-state what a worker holds, never over-state it for long, so the
router never counts on blocks a worker no longer has:

- `AllBlocksCleared` (sent at every worker start) wipes the worker: a worker restarted in place is
  cold, whatever it held before.
- A `seq` gap (a lost batch), or a digest that disagrees with what the index has applied up to the
  digest's `seq` while the index was exact (drift), drops the worker's entries and marks it *partial*:
  later events still apply, so the index holds a subset of the worker's blocks (unknown removals are
  ignored). A partial worker's digests disagree as a matter of course (it holds blocks the index never
  heard of), so they drop nothing: what the index holds of it was stored and not removed since the gap.
  A later digest that matches (the unknown blocks have been evicted since) makes it exact again. A
  router that starts while workers hold blocks begins with every worker partial this way.
- Digests and events travel on different subjects and are handled by different subscriptions, so a
  digest can arrive before the batches it covers. A digest ahead of the applied `seq` is therefore not
  a gap at once; if the next digest finds the index still short of that `seq`, the batches were lost.
- A worker heard from by neither events, digests nor `touch` (heartbeats) for `ttl_s` seconds is
  dropped by `expire`.

Lookups (`overlaps`) count, per worker, the blocks of a request's leading run that the worker holds —
the "overlap score" of Dynamo's KV router (docs.nvidia.com/dynamo, Router → Routing Concepts).

A hybrid model's workers also publish their recurrent-state checkpoints (`CheckpointStored` /
`CheckpointRemoved`, under the chained hash of the block ending at the checkpoint): the index keeps each
worker's set of them, wiped with its blocks, and `checkpoint_blocks` finds the longest one within a KV
hit — where that worker's prefill would resume (`engine/state_pool.py: StatePool.find_checkpoint`); a
checkpoint event's `tier` keeps the state pool's apart from those written down to a tier below it, and
both count (a worker reads a tiered checkpoint back at admission).
Tiers below the pool (issue 16, `engine/kv_tiers`): events labelled with another `tier` than "pool" (a
worker's "offload" tier) are kept per worker and tier beside the pool's hashes, outside the digest (which
covers the pool only), and wiped with the worker on a gap or a restart. `overlaps_by_tier` walks the
leading run through every tier, each block counted once at the best tier holding it (`TIER_RANK`).

The shared store (tier "store", `pdserve.kv_store`) is one for the whole cluster: what any worker published
there counts for every worker, and a worker's restart does not wipe it (the blocks live in the store).
The store evicts without telling anyone, so the index keeps at most `store_max_blocks` hashes, least
recently published dropped first; a stale entry costs no placement quality, since it credits every
candidate alike, and the worker's own `lookup` is what decides a hit.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from pdserve.messages import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    CheckpointRemoved,
    CheckpointStored,
    KVDigest,
    KVEvents,
)

SHARED_TIERS = ("store",)  # tiers every worker reads: indexed once for the cluster, not per worker

POOL = "pool"
# A block is counted at the first of these that holds it: cheapest to use first (the pool: nothing to copy;
# a worker's own offload tier: a host copy; its disk tier; the shared store: a network read).
TIER_RANK = (POOL, "offload", "disk", "store")


@dataclass
class WorkerBlocks:
    """What the index knows of one worker. `partial`: entries were dropped after a gap or a digest
    mismatch, so `hashes` may be a strict subset of what the worker holds."""

    slot: int
    hashes: set[int] = field(default_factory=set)
    xor_hashes: int = 0
    last_seq: int | None = None
    partial: bool = True  # until the worker's start (AllBlocksCleared) or a matching digest is seen
    last_heard: float = 0.0
    digest_ahead: int | None = None  # seq of a digest that arrived before its batches
    checkpoints: set[int] = field(default_factory=set)  # block hashes a state checkpoint is stored under
    tier_checkpoints: dict[str, set[int]] = field(default_factory=dict)  # tier below the pool → those
    tiers: dict[str, set[int]] = field(default_factory=dict)  # tier below the pool → hashes it holds


class KVIndex:
    """Block hash → workers holding it. Not thread-safe; every method is O(events) or O(blocks asked)."""

    def __init__(self, ttl_s: float = 10.0, clock: Callable[[], float] = time.monotonic,
                 store_max_blocks: int = 1 << 20) -> None:
        self.ttl_s = ttl_s
        self.store_max_blocks = store_max_blocks
        self._shared: dict[str, OrderedDict[int, None]] = {t: OrderedDict() for t in SHARED_TIERS}
        self.clock = clock
        self._holders: dict[int, int] = {}  # block hash → bitmask of worker slots
        self._workers: dict[str, WorkerBlocks] = {}
        self._slot_owner: dict[int, str] = {}
        self.gaps = 0  # batches lost (seq gaps) since start, all workers
        self.digest_mismatches = 0

    # ------------------------------------------------------------ updates

    def _worker(self, worker_id: str) -> WorkerBlocks:
        w = self._workers.get(worker_id)
        if w is None:
            slot = next(i for i in range(len(self._slot_owner) + 1) if i not in self._slot_owner)
            w = self._workers[worker_id] = WorkerBlocks(slot=slot)
            self._slot_owner[slot] = worker_id
        w.last_heard = self.clock()
        return w

    def _clear(self, w: WorkerBlocks) -> None:
        bit = 1 << w.slot
        for h in w.hashes:
            mask = self._holders[h] & ~bit
            if mask:
                self._holders[h] = mask
            else:
                del self._holders[h]
        w.hashes = set()
        w.xor_hashes = 0
        w.checkpoints = set()
        w.tier_checkpoints = {}
        w.tiers = {}

    def _store(self, w: WorkerBlocks, hashes: Iterable[int]) -> None:
        bit = 1 << w.slot
        for h in hashes:
            if h not in w.hashes:
                w.hashes.add(h)
                w.xor_hashes ^= h
                self._holders[h] = self._holders.get(h, 0) | bit

    def _remove(self, w: WorkerBlocks, hashes: Iterable[int]) -> None:
        bit = 1 << w.slot
        for h in hashes:
            if h in w.hashes:
                w.hashes.discard(h)
                w.xor_hashes ^= h
                mask = self._holders[h] & ~bit
                if mask:
                    self._holders[h] = mask
                else:
                    del self._holders[h]

    def apply(self, batch: KVEvents) -> None:
        """Apply one batch of a worker's KV events. A batch whose `seq` is not the previous one + 1 means
        batches were lost: the worker's entries are dropped first (it is treated as partial), unless the
        batch itself starts with `AllBlocksCleared`. A batch with `seq` at or below the last one applied
        is a repeat and is ignored, unless it starts with `AllBlocksCleared` (a restarted worker counts
        from 0 again)."""
        w = self._worker(batch.worker_id)
        starts_clean = bool(batch.events) and isinstance(batch.events[0], AllBlocksCleared)
        if w.last_seq is not None and batch.seq <= w.last_seq and not starts_clean:
            return
        if w.last_seq is not None and batch.seq != w.last_seq + 1 and not starts_clean:
            self.gaps += 1
            self._clear(w)
            w.partial = True
        w.last_seq = batch.seq
        for ev in batch.events:
            if isinstance(ev, BlockStored | BlockRemoved) and ev.tier in self._shared:
                self._shared_update(ev.tier, ev.block_hashes, stored=isinstance(ev, BlockStored))
            elif isinstance(ev, BlockStored | BlockRemoved) and ev.tier != POOL:
                held = w.tiers.setdefault(ev.tier, set())
                if isinstance(ev, BlockStored):
                    held.update(ev.block_hashes)
                else:
                    held.difference_update(ev.block_hashes)
            elif isinstance(ev, BlockStored):
                self._store(w, ev.block_hashes)
            elif isinstance(ev, BlockRemoved):
                self._remove(w, ev.block_hashes)
            elif isinstance(ev, CheckpointStored):
                held = w.checkpoints if ev.tier == POOL else w.tier_checkpoints.setdefault(ev.tier, set())
                held.add(ev.block_hash)
            elif isinstance(ev, CheckpointRemoved):
                held = w.checkpoints if ev.tier == POOL else w.tier_checkpoints.setdefault(ev.tier, set())
                held.difference_update(ev.block_hashes)
            elif isinstance(ev, AllBlocksCleared):
                self._clear(w)
                w.partial = False

    def check_digest(self, digest: KVDigest) -> bool:
        """Compare a worker's digest with the index. Returns True when they agree (a partial worker becomes
        exact again) or cannot be compared: a digest older than the last applied batch, or the first one
        ahead of it (its batches may still be on their way). False when they disagree: an exact worker's
        entries are dropped (drift: it becomes partial); a partial worker's are kept (a subset); and a
        second digest that finds the index still short of the first one's `seq` means batches were lost:
        the worker's entries are dropped and the index continues from the digest's `seq`."""
        w = self._worker(digest.worker_id)
        if w.last_seq is not None and digest.seq < w.last_seq:
            return True
        if w.last_seq == digest.seq:
            w.digest_ahead = None
            if len(w.hashes) == digest.num_blocks and w.xor_hashes == digest.xor_hashes:
                w.partial = False
                return True
            if not w.partial:
                self.digest_mismatches += 1
                self._clear(w)
                w.partial = True
            return False
        if w.last_seq is not None and (w.digest_ahead is None or w.digest_ahead <= w.last_seq):
            w.digest_ahead = digest.seq  # ahead: wait one digest period for its batches
            return True
        self.gaps += 1  # batches never arrived (or nothing was ever heard from this worker)
        self._clear(w)
        w.partial = True
        w.last_seq = digest.seq
        w.digest_ahead = None
        return False

    def touch(self, worker_id: str) -> None:
        """The worker is alive (a heartbeat): keep its entries from expiring."""
        if worker_id in self._workers:
            self._workers[worker_id].last_heard = self.clock()

    def remove_worker(self, worker_id: str) -> None:
        """Forget a worker and every block it held."""
        w = self._workers.pop(worker_id, None)
        if w is not None:
            self._clear(w)
            del self._slot_owner[w.slot]

    def expire(self) -> list[str]:
        """Drop every worker not heard from for `ttl_s` seconds; returns their ids."""
        now = self.clock()
        silent = [wid for wid, w in self._workers.items() if now - w.last_heard > self.ttl_s]
        for wid in silent:
            self.remove_worker(wid)
        return silent

    # ------------------------------------------------------------ lookups

    def overlaps(self, block_hashes: Sequence[int], worker_ids: Iterable[str]) -> dict[str, int]:
        """For each of `worker_ids`, how many of `block_hashes` (a prompt's chained hashes, in order) it
        holds as a leading run — the blocks its prefix cache would hit. Unknown workers get 0."""
        slots = {self._workers[wid].slot: wid for wid in worker_ids if wid in self._workers}
        out = dict.fromkeys(worker_ids, 0)
        alive = sum(1 << s for s in slots)
        for depth, h in enumerate(block_hashes):
            still = alive & self._holders.get(h, 0)
            if still != alive:
                gone = alive & ~still
                for s, wid in slots.items():
                    if gone >> s & 1:
                        out[wid] = depth
                alive = still
                if not alive:
                    return out
        for s, wid in slots.items():
            if alive >> s & 1:
                out[wid] = len(block_hashes)
        return out

    def _shared_update(self, tier: str, hashes: Iterable[int], *, stored: bool) -> None:
        held = self._shared[tier]
        for h in hashes:
            if stored:
                held[h] = None
                held.move_to_end(h)
            else:
                held.pop(h, None)
        while len(held) > self.store_max_blocks:
            held.popitem(last=False)

    def checkpoint_blocks(self, block_hashes: Sequence[int], worker_id: str, max_blocks: int) -> int:
        """The longest state checkpoint `worker_id` holds within the first `max_blocks` of `block_hashes`
        (a prompt's chained hashes; `max_blocks` its KV hit there), in blocks: the largest i <= max_blocks
        whose block i - 1 has a checkpoint stored under its hash, in its state pool or a tier below it
        (the worker reads a tiered one back: `engine/scheduler.py`), 0 when none (or the worker is
        unknown)."""
        w = self._workers.get(worker_id)
        if w is None:
            return 0
        sets = [w.checkpoints, *w.tier_checkpoints.values()]
        if not any(sets):
            return 0
        for i in range(min(max_blocks, len(block_hashes)), 0, -1):
            if any(block_hashes[i - 1] in held for held in sets):
                return i
        return 0

    def num_checkpoints(self, worker_id: str, tier: str = POOL) -> int:
        """State checkpoints indexed for one worker in `tier` ("pool": its state pool, or a tier below)."""
        w = self._workers.get(worker_id)
        if w is None:
            return 0
        return len(w.checkpoints if tier == POOL else w.tier_checkpoints.get(tier, ()))

    def overlaps_by_tier(self, block_hashes: Sequence[int], worker_id: str) -> dict[str, int]:
        """How many of `block_hashes`' leading run `worker_id` holds, split by tier: each block counted at
        the best tier holding it (`TIER_RANK`: its pool, then the tiers below), the run ending at the first
        block no tier holds. {} for an unknown worker or no hit; the values sum to the run's length."""
        w = self._workers.get(worker_id)
        out: dict[str, int] = {}
        if w is None:
            return out
        ranked = [(POOL, w.hashes)] + sorted(
            [*w.tiers.items(), *self._shared.items()],
            key=lambda kv: TIER_RANK.index(kv[0]) if kv[0] in TIER_RANK else len(TIER_RANK))
        for h in block_hashes:
            tier = next((name for name, held in ranked if h in held), None)
            if tier is None:
                break
            out[tier] = out.get(tier, 0) + 1
        return out

    def num_tier_blocks(self, worker_id: str, tier: str) -> int:
        """Blocks indexed for one worker's tier below the pool ("offload", ...); for the shared store,
        the cluster's (whatever `worker_id`)."""
        if tier in self._shared:
            return len(self._shared[tier])
        w = self._workers.get(worker_id)
        return len(w.tiers.get(tier, ())) if w else 0

    def num_blocks(self, worker_id: str | None = None) -> int:
        """Blocks indexed for one worker, or distinct hashes over all workers."""
        if worker_id is None:
            return len(self._holders)
        w = self._workers.get(worker_id)
        return len(w.hashes) if w else 0

    def is_partial(self, worker_id: str) -> bool:
        """True when the index may know only part of the worker's blocks (or nothing of it)."""
        w = self._workers.get(worker_id)
        return w is None or w.partial

    def holds(self, worker_id: str, block_hash: int) -> bool:
        w = self._workers.get(worker_id)
        return w is not None and block_hash in w.hashes

    @property
    def worker_ids(self) -> list[str]:
        return sorted(self._workers)
