"""Paged KV cache bookkeeping: a pool of fixed-size blocks, ref-counted, with a prefix cache.

As vLLM's automatic prefix caching (vLLM docs, "Automatic Prefix Caching"; nano-vllm's block manager):
a full block whose KV is computed is registered under its chained hash (`block_hash.hash_blocks`, with the
sequence's `cache_salt` as extra key); a later sequence whose leading full blocks hash the same shares
those blocks (ref count + 1) instead of recomputing them. A block whose ref count drops to 0 stays in the
cache, free; free cached blocks are evicted least recently freed first, and only when no never-cached free
block is left. Every registration and eviction is recorded as a KV cache event for the router.

With KV tiers below the pool (`engine/kv_tiers`), the manager also records each evicted cached block with
the block id still holding its KV (`take_evicted`, for the write-down) and each newly computed block
(`take_computed`, for a write_on="compute" tier), and registers blocks copied back from a tier
(`register_loaded`) as if they were hits.
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from typing import NamedTuple

from pdserve.engine.block_hash import block_hash, root_hash
from pdserve.engine.kv_events import BlockRemoved, BlockStored
from pdserve.engine.sequence import Sequence


class NoFreeBlocks(Exception):
    """Not enough free blocks for the allocation right now."""


class PrefixHit(NamedTuple):
    """Leading full blocks of a sequence found in the prefix cache: their ids and chained hashes."""

    block_ids: list[int]
    block_hashes: list[int]


class BlockManager:
    """`num_blocks` blocks of `block_size` tokens; block ids index the KV pool's first dimension.

    Paired verbs: `allocate` / `free` a sequence's blocks; `append_slots` grows a running sequence;
    `cache_full_blocks` registers newly computed full blocks. Not thread-safe: one caller at a time.
    """

    def __init__(self, num_blocks: int, block_size: int = 16, hash_seed: int = 0) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"need positive num_blocks and block_size, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.hash_seed = hash_seed
        self.ref_counts = [0] * num_blocks
        self.hash_of: list[int | None] = [None] * num_blocks  # the hash a block is registered under
        self.free_uncached: deque[int] = deque(range(num_blocks))
        self.free_cached: OrderedDict[int, None] = OrderedDict()  # LRU order: first = evicted first
        self.hash_to_block: dict[int, int] = {}
        self.xor_hashes = 0
        self.events: list[BlockStored | BlockRemoved] = []
        self.num_queried_tokens = 0  # prompt tokens looked up at allocation (prefix_cache_queries)
        self.num_hit_tokens = 0  # of which found cached (prefix_cache_hits)
        self.num_hit_tokens_by_tier: Counter[str] = Counter()  # the same, by tier ("pool", "offload", ...)
        self.record_evictions = False  # keep (hash, block id) of every evicted cached block: take_evicted
        self.record_computed = False  # keep (hash, block id) of every newly registered block: take_computed
        self._evicted: list[tuple[int, int]] = []
        self._computed: list[tuple[int, int]] = []

    # ------------------------------------------------------------ capacity

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_uncached) + len(self.free_cached)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks that hold `num_tokens` tokens: ceil(num_tokens / block_size)."""
        return -(-num_tokens // self.block_size)

    def usage(self) -> float:
        """Fraction of blocks held by sequences (free cached blocks count as free), 0..1."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    # ------------------------------------------------------------ prefix cache

    def hit_limit(self, seq: Sequence) -> int:
        """Most leading full blocks of `seq` a prefix hit may cover: (len - 1) // block_size (the last
        token's block is always computed)."""
        return (len(seq) - 1) // self.block_size

    def find_prefix(self, seq: Sequence) -> PrefixHit:
        """The sequence's leading full blocks held in the cache, stopping at the first miss. The block of
        the last token is never a hit, so there is always a token to compute and logits to sample from."""
        ids: list[int] = []
        hashes: list[int] = []
        parent = root_hash(self.hash_seed)
        bs = self.block_size
        for start in range(0, (len(seq) - 1) // bs * bs, bs):
            parent = block_hash(parent, seq.token_ids[start : start + bs], seq.cache_salt)
            block_id = self.hash_to_block.get(parent)
            if block_id is None:
                break
            ids.append(block_id)
            hashes.append(parent)
        return PrefixHit(ids, hashes)

    def chain_hashes(self, seq: Sequence, num_blocks: int) -> list[int]:
        """The chained hashes of `seq`'s first `num_blocks` full blocks (those it registered, then hashed
        from its token ids), without registering anything. Raises ValueError past its full blocks."""
        bs = self.block_size
        if num_blocks * bs > len(seq):
            raise ValueError(f"{seq.request_id} has {len(seq)} tokens, not {num_blocks} full blocks")
        hashes = seq.block_hashes[:num_blocks]
        parent = hashes[-1] if hashes else root_hash(self.hash_seed)
        for index in range(len(hashes), num_blocks):
            parent = block_hash(parent, seq.token_ids[index * bs : (index + 1) * bs], seq.cache_salt)
            hashes.append(parent)
        return hashes

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register every full block of `seq` whose KV is computed and not yet registered (BlockStored).

        A block whose hash another block already holds (the same prefix computed twice at once) stays
        unregistered and is freed as a plain block; the chain of hashes continues either way.
        """
        bs = self.block_size
        num_full = min(seq.num_computed_tokens, len(seq)) // bs
        prev: int | None = seq.block_hashes[-1] if seq.block_hashes else None  # None = the root
        run_parent: int | None = None
        stored: list[int] = []
        for index in range(len(seq.block_hashes), num_full):
            parent = prev if prev is not None else root_hash(self.hash_seed)
            h = block_hash(parent, seq.token_ids[index * bs : (index + 1) * bs], seq.cache_salt)
            seq.block_hashes.append(h)
            block_id = seq.block_table[index]
            if h not in self.hash_to_block and self.hash_of[block_id] is None:
                self.hash_to_block[h] = block_id
                self.hash_of[block_id] = h
                self.xor_hashes ^= h
                if not stored:
                    run_parent = prev
                stored.append(h)
                if self.record_computed:
                    self._computed.append((h, block_id))
            elif stored:  # the run of newly stored hashes is broken: report it
                self.events.append(BlockStored(block_hashes=tuple(stored), parent_block_hash=run_parent))
                stored = []
            prev = h
        if stored:
            self.events.append(BlockStored(block_hashes=tuple(stored), parent_block_hash=run_parent))

    def register_loaded(self, seq: Sequence, tiers: list[str]) -> None:
        """`seq`'s blocks right after its registered ones (indexes len(seq.block_hashes) ..) now hold KV
        copied back from the tiers named in `tiers`, one per block: register them (BlockStored) and count
        them as cached, as prefix hits are. Only right after `allocate`, before anything is computed."""
        if not tiers:
            return
        if seq.num_computed_tokens != len(seq.block_hashes) * self.block_size:
            raise ValueError(f"{seq.request_id}: loaded blocks must follow its cached ones")
        start = len(seq.block_hashes)
        hashes = self.chain_hashes(seq, start + len(tiers))[start:]
        prev = seq.block_hashes[-1] if seq.block_hashes else None
        stored: list[int] = []
        for h, block_id in zip(hashes, seq.block_table[start:], strict=False):
            seq.block_hashes.append(h)
            if h not in self.hash_to_block and self.hash_of[block_id] is None:
                self.hash_to_block[h] = block_id
                self.hash_of[block_id] = h
                self.xor_hashes ^= h
                stored.append(h)
        if stored:
            self.events.append(BlockStored(block_hashes=tuple(stored), parent_block_hash=prev))
        n = len(tiers) * self.block_size
        seq.num_cached_tokens += n
        seq.num_computed_tokens += n
        self.num_hit_tokens += n
        for name in tiers:
            seq.cached_tokens_by_tier[name] = seq.cached_tokens_by_tier.get(name, 0) + self.block_size
            self.num_hit_tokens_by_tier[name] += self.block_size

    def take_evicted(self) -> list[tuple[int, int]]:
        """(block hash, block id) of every cached block evicted since the last call (with
        `record_evictions`): the block id still holds its KV until the caller lets anything write it."""
        evicted, self._evicted = self._evicted, []
        return evicted

    def take_computed(self) -> list[tuple[int, int]]:
        """(block hash, block id) of every block registered by `cache_full_blocks` since the last call
        (with `record_computed`)."""
        computed, self._computed = self._computed, []
        return computed

    def take_events(self) -> list[BlockStored | BlockRemoved]:
        """KV cache events since the last call, oldest first."""
        events, self.events = self.events, []
        return events

    # ------------------------------------------------------------ allocate / free

    def can_allocate(self, seq: Sequence, num_tokens: int | None = None) -> bool:
        """Whether `allocate(seq, num_tokens)` would succeed now."""
        hit = self.find_prefix(seq)
        return self._free_blocks_needed(hit, num_tokens or len(seq)) <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_tokens: int | None = None, use_prefix_cache: bool = True) -> None:
        """Give `seq` (holding no blocks) blocks for its first `num_tokens` tokens (default: all), sharing
        its cached prefix unless `use_prefix_cache` is False (token ids not known yet). Sets
        `num_computed_tokens = num_cached_tokens` = the prefix hit's tokens.
        Raises NoFreeBlocks (nothing changed) when the pool is short, ValueError when `seq` holds blocks.
        """
        if seq.block_table:
            raise ValueError(f"{seq.request_id} already holds blocks")
        num_tokens = num_tokens or len(seq)
        hit = self.find_prefix(seq) if use_prefix_cache else PrefixHit([], [])
        needed = self._free_blocks_needed(hit, num_tokens)
        if needed > self.num_free_blocks:
            raise NoFreeBlocks(f"{seq.request_id}: {needed} free blocks needed, {self.num_free_blocks} free")
        for block_id in hit.block_ids:
            if self.ref_counts[block_id] == 0:
                del self.free_cached[block_id]
            self.ref_counts[block_id] += 1
        seq.block_table = list(hit.block_ids)
        seq.block_hashes = list(hit.block_hashes)
        for _ in range(self.blocks_for(num_tokens) - len(hit.block_ids)):
            seq.block_table.append(self._take_free_block())
        seq.num_cached_tokens = seq.num_computed_tokens = len(hit.block_ids) * self.block_size
        seq.cached_tokens_by_tier = {"pool": seq.num_cached_tokens} if hit.block_ids else {}
        self.num_queried_tokens += len(seq)
        self.num_hit_tokens += seq.num_cached_tokens
        self.num_hit_tokens_by_tier["pool"] += seq.num_cached_tokens

    def append_slots(self, seq: Sequence, num_tokens: int) -> None:
        """Grow `seq`'s block table to hold `num_tokens` tokens. Raises NoFreeBlocks (nothing changed)."""
        needed = self.blocks_for(num_tokens) - len(seq.block_table)
        if needed > self.num_free_blocks:
            raise NoFreeBlocks(f"{seq.request_id}: {needed} free blocks needed, {self.num_free_blocks} free")
        for _ in range(needed):
            seq.block_table.append(self._take_free_block())

    def can_append_slots(self, seq: Sequence, num_tokens: int) -> bool:
        return self.blocks_for(num_tokens) - len(seq.block_table) <= self.num_free_blocks

    def free(self, seq: Sequence) -> None:
        """Drop `seq`'s references; a block no one references becomes free (and stays cached if it is
        registered). Last blocks first, so a sequence's tail is evicted before its shared head."""
        for block_id in reversed(seq.block_table):
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                if self.hash_of[block_id] is not None:
                    self.free_cached[block_id] = None
                else:
                    self.free_uncached.append(block_id)
        seq.block_table = []
        seq.block_hashes = []

    def _free_blocks_needed(self, hit: PrefixHit, num_tokens: int) -> int:
        reused_free = sum(self.ref_counts[b] == 0 for b in hit.block_ids)
        return self.blocks_for(num_tokens) - len(hit.block_ids) + reused_free

    def _take_free_block(self) -> int:
        if self.free_uncached:
            block_id = self.free_uncached.popleft()
        else:
            block_id, _ = self.free_cached.popitem(last=False)
            evicted = self.hash_of[block_id]
            assert evicted is not None
            del self.hash_to_block[evicted]
            self.hash_of[block_id] = None
            self.xor_hashes ^= evicted
            self.events.append(BlockRemoved(block_hashes=(evicted,)))
            if self.record_evictions:
                self._evicted.append((evicted, block_id))
        self.ref_counts[block_id] = 1
        return block_id
