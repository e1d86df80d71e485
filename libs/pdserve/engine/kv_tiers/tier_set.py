"""A worker's KV tiers below its paged pool, as the engine uses them: write evicted or computed blocks down
(snapshotted at once, stored by a writer thread so the copy into the tier overlaps the next forward), and
copy a prefix hit back into pool blocks at admission.

Correctness rests on one ordering: a pool block's KV is snapshotted (`write_down`) before anything can
write into that block again — the engine calls it right after every allocation, before a forward or a KV
transfer touches the blocks — and a block written down but not yet stored by the writer is served from its
snapshot (`pending`), so a block evicted and asked for again a moment later is still a hit.

A hybrid model's state checkpoints (`engine/state_pool.py`) take the same path in the "checkpoint" key
space of the tiers that hold them (`KVTier.holds_checkpoints`): snapshotted when the state pool evicts
(or, for the compute tiers, saves) one, stored by the writer, and read back at admission by
`load_checkpoint`, longest first, a failed or corrupt read falling back to the next shorter one.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Sequence

import torch

from pdserve.engine.kv_events import BlockRemoved, BlockStored, CheckpointRemoved, CheckpointStored
from pdserve.engine.kv_tiers.tier import KeySpace, KVTier, ReportsChanges
from pdserve.engine.threads import one_thread

log = logging.getLogger(__name__)

POOL = "pool"  # the tier label of blocks hit in the paged pool itself


class KVTierSet:
    """`tiers` in lookup order (offload, disk, store) over the pool `kv_cache` (the runner's list of
    [num_blocks, block_size, *paged_row_shape] tensors, one per paged layer). `background`: store blocks
    in a writer thread (False: inline, for tests that count exactly). Raises ValueError for two tiers of
    one name or an empty list."""

    def __init__(
        self, tiers: Sequence[KVTier], kv_cache: list[torch.Tensor], background: bool = True
    ) -> None:
        if not tiers:
            raise ValueError("a tier set needs at least one tier")
        names = [t.name for t in tiers]
        if len(set(names)) != len(names) or POOL in names:
            raise ValueError(f"tier names must be distinct and not {POOL!r}: {names}")
        self.tiers = list(tiers)
        self.evict_tiers = [t for t in tiers if t.write_on == "evict"]
        self.compute_tiers = [t for t in tiers if t.write_on == "compute"]
        self.kv_cache = kv_cache
        # snapshots not yet stored by the writer, by (key space, hash)
        self._pending: dict[tuple[KeySpace, int], torch.Tensor] = {}
        self._checkpoint_tokens: dict[int, int] = {}  # checkpoint hash -> its length, for events
        self.num_checkpoint_loads = 0  # checkpoints read back from a tier
        self.num_checkpoint_misses = 0  # reads of a checkpoint a tier listed that failed (corrupt, gone)
        self._lock = threading.Lock()
        self._queue: queue.Queue[tuple[KeySpace, int, torch.Tensor, list[KVTier]] | None] | None = None
        self._writer: threading.Thread | None = None
        if background:
            self._queue = queue.Queue()
            self._writer = threading.Thread(target=self._write_loop, name="kv-tier-writer", daemon=True)
            self._writer.start()

    # ------------------------------------------------------------ writing down

    def read_block(self, block_id: int) -> torch.Tensor:
        """A copy of pool block `block_id` in host memory (a pool on a GPU is copied down):
        [num_paged_layers, block_size, *paged_row_shape], the pool's dtype, contiguous."""
        return torch.stack([layer[block_id] for layer in self.kv_cache]).cpu()

    def _staging(self) -> torch.Tensor:
        first = self.kv_cache[0]
        return torch.empty((len(self.kv_cache), *first.shape[1:]), dtype=first.dtype, device="cpu")

    def write_down(self, evicted: Sequence[tuple[int, int]]) -> None:
        """Blocks the pool just evicted, as (block_hash, block_id) whose KV is still in place: snapshot each
        now, store it in every write_on="evict" tier (in the writer thread)."""
        self._submit(evicted, self.evict_tiers)

    def write_computed(self, computed: Sequence[tuple[int, int]]) -> None:
        """Blocks just computed and registered in the pool, as (block_hash, block_id): snapshot each now,
        store it in every write_on="compute" tier."""
        self._submit(computed, self.compute_tiers)

    def _submit(self, blocks: Sequence[tuple[int, int]], tiers: list[KVTier]) -> None:
        if not tiers:
            return
        for block_hash, block_id in blocks:
            self._enqueue("kv", block_hash, self.read_block(block_id), tiers)

    def _enqueue(self, space: KeySpace, block_hash: int, snapshot: torch.Tensor, tiers: list[KVTier]) -> None:
        if self._queue is None:
            self._store(space, block_hash, snapshot, tiers)
            return
        with self._lock:
            self._pending[space, block_hash] = snapshot
        self._queue.put((space, block_hash, snapshot, tiers))

    def write_down_checkpoint(self, block_hash: int, num_tokens: int, state: torch.Tensor) -> None:
        """A state checkpoint the state pool just evicted: `state` its slot packed (uint8, CPU, a private
        copy: `StatePool.pack_slot`), after `num_tokens` tokens, under `block_hash`; stored in every
        write_on="evict" tier that holds checkpoints (in the writer thread)."""
        self._submit_checkpoint(block_hash, num_tokens, state, self.evict_tiers)

    def write_computed_checkpoint(self, block_hash: int, num_tokens: int, state: torch.Tensor) -> None:
        """A state checkpoint just saved in the pool (as `write_down_checkpoint`): stored in every
        write_on="compute" tier that holds checkpoints."""
        self._submit_checkpoint(block_hash, num_tokens, state, self.compute_tiers)

    def wants_checkpoints(self, write_on: str) -> bool:
        """Whether a tier written on `write_on` ("evict" | "compute") holds checkpoints: else the state
        pool need not pack them."""
        tiers = self.evict_tiers if write_on == "evict" else self.compute_tiers
        return any(t.holds_checkpoints for t in tiers)

    def _submit_checkpoint(self, block_hash: int, num_tokens: int, state: torch.Tensor,
                           tiers: list[KVTier]) -> None:
        tiers = [t for t in tiers if t.holds_checkpoints]
        if not tiers:
            return
        with self._lock:
            self._checkpoint_tokens[block_hash] = num_tokens
        self._enqueue("checkpoint", block_hash, state, tiers)

    def _store(self, space: KeySpace, block_hash: int, snapshot: torch.Tensor, tiers: list[KVTier]) -> None:
        for tier in tiers:
            try:
                tier.put(block_hash, snapshot, space=space)
            except Exception:  # a failing tier drops the block; serving goes on from the pool
                log.exception("KV tier %s: put failed", tier.name)

    def _write_loop(self) -> None:
        assert self._queue is not None
        one_thread()  # the step thread's team is the worker's only one (engine/threads.py)
        while (job := self._queue.get()) is not None:
            space, block_hash, snapshot, tiers = job
            try:
                self._store(space, block_hash, snapshot, tiers)
            finally:
                with self._lock:
                    if self._pending.get((space, block_hash)) is snapshot:
                        del self._pending[space, block_hash]
                self._queue.task_done()
        self._queue.task_done()

    def flush(self) -> None:
        """Wait until every block written down so far is stored."""
        if self._queue is not None:
            self._queue.join()

    def close(self) -> None:
        """Store what is pending, then stop the writer thread (idempotent)."""
        if self._writer is not None and self._queue is not None:
            self._queue.put(None)
            self._writer.join()
            self._writer = None

    # ------------------------------------------------------------ reading back

    def load(self, block_hashes: Sequence[int], block_ids: Sequence[int]) -> list[str]:
        """Copy the leading run of `block_hashes` found in the tiers into pool blocks `block_ids` (same
        length, freshly allocated, nothing else writes them) and return the name of the tier each copied
        block came from, in order; the run stops at the first block no tier holds or whose read fails
        (`get_into` False): from there on the caller recomputes. A block written down but not yet stored
        is copied from its snapshot and counted for the first evict tier."""
        if len(block_hashes) != len(block_ids):
            raise ValueError(f"{len(block_hashes)} hashes for {len(block_ids)} blocks")
        names: list[str] = []
        staging: torch.Tensor | None = None
        pos, n = 0, len(block_hashes)
        while pos < n:
            with self._lock:
                snapshot = self._pending.get(("kv", block_hashes[pos]))
            if snapshot is not None and self.evict_tiers:
                self._scatter(snapshot, block_ids[pos])
                names.append(self.evict_tiers[0].name)
                pos += 1
                continue
            for tier in self.tiers:
                run = tier.lookup(block_hashes[pos:])
                if run > 0:
                    break
            else:
                return names
            if staging is None:
                staging = self._staging()
            for i in range(pos, pos + run):
                if not tier.get_into(block_hashes[i], staging):
                    return names
                self._scatter(staging, block_ids[i])
                names.append(tier.name)
            pos += run
        return names

    def load_checkpoint(
        self, candidates: Sequence[tuple[int, int]], out: torch.Tensor
    ) -> tuple[int, str] | None:
        """Read the first of `candidates`, (block_hash, num_tokens) longest first, that a checkpoint tier
        holds into `out` (uint8, CPU, the packed slot's size: `StatePool.pack_slot`) and return
        (num_tokens, tier name); a failed or corrupt read (`get_into` False, the bad copy dropped by the
        tier) falls through to the next tier, then the next shorter candidate. None: none held, `out`'s
        contents unspecified. A checkpoint written down but not yet stored is copied from its snapshot."""
        tiers = [t for t in self.tiers if t.holds_checkpoints]
        for block_hash, num_tokens in candidates:
            with self._lock:
                snapshot = self._pending.get(("checkpoint", block_hash))
            if snapshot is not None and snapshot.shape == out.shape:
                out.copy_(snapshot)
                self.num_checkpoint_loads += 1
                return num_tokens, next((t.name for t in tiers if t.write_on == "evict"), tiers[0].name)
            for tier in tiers:
                if not tier.lookup([block_hash], space="checkpoint"):
                    continue
                if tier.get_into(block_hash, out, space="checkpoint"):
                    self.num_checkpoint_loads += 1
                    return num_tokens, tier.name
                self.num_checkpoint_misses += 1
        return None

    def _scatter(self, block: torch.Tensor, block_id: int) -> None:
        for layer, rows in zip(self.kv_cache, block, strict=True):
            layer[block_id].copy_(rows)

    # ------------------------------------------------------------ events

    def take_events(self) -> list[BlockStored | BlockRemoved | CheckpointStored | CheckpointRemoved]:
        """What the per-worker tiers (those that report changes) gained and lost since the last call, as KV
        events labelled with the tier's name, oldest first per tier: blocks as BlockStored / BlockRemoved,
        state checkpoints as CheckpointStored / CheckpointRemoved."""
        events: list[BlockStored | BlockRemoved | CheckpointStored | CheckpointRemoved] = []
        for tier in self.tiers:
            if not isinstance(tier, ReportsChanges):
                continue
            stored: list[int] = []
            for change in tier.take_changes():
                if change.space == "checkpoint":
                    if stored:
                        events.append(BlockStored(block_hashes=tuple(stored), tier=tier.name))
                        stored = []
                    events.append(self._checkpoint_event(change.stored, change.block_hash, tier.name))
                    continue
                if change.stored:
                    stored.append(change.block_hash)
                    continue
                if stored:
                    events.append(BlockStored(block_hashes=tuple(stored), tier=tier.name))
                    stored = []
                events.append(BlockRemoved(block_hashes=(change.block_hash,), tier=tier.name))
            if stored:
                events.append(BlockStored(block_hashes=tuple(stored), tier=tier.name))
        return events

    def _checkpoint_event(
        self, stored: bool, block_hash: int, tier: str
    ) -> CheckpointStored | CheckpointRemoved:
        if not stored:
            if not any(t.lookup([block_hash], space="checkpoint") for t in self.tiers if t.holds_checkpoints):
                with self._lock:  # no tier holds it any more: forget its length
                    self._checkpoint_tokens.pop(block_hash, None)
            return CheckpointRemoved(block_hashes=(block_hash,), tier=tier)
        with self._lock:
            num_tokens = self._checkpoint_tokens.get(block_hash, 0)
        return CheckpointStored(block_hash=block_hash, num_tokens=num_tokens, tier=tier)
