"""BlockManager: allocation and freeing, prefix-cache hits by chained hash, LRU eviction, cache_salt
isolation, KV cache events and the digest they add up to."""

from __future__ import annotations

import pytest

from pdserve.engine.block_hash import hash_blocks
from pdserve.engine.block_manager import BlockManager, NoFreeBlocks
from pdserve.engine.sequence import Sequence
from pdserve.messages import BlockRemoved, BlockStored

BS = 4


def seq(tokens: list[int], salt: str | None = None, name: str = "r") -> Sequence:
    return Sequence(name, tokens, cache_salt=salt)


def computed(bm: BlockManager, tokens: list[int], salt: str | None = None) -> Sequence:
    """A sequence allocated and fully computed (its full blocks registered)."""
    s = seq(tokens, salt)
    bm.allocate(s)
    s.num_computed_tokens = len(s)
    bm.cache_full_blocks(s)
    return s


@pytest.mark.parametrize("num_tokens", range(1, 3 * BS + 2))
def test_allocate_takes_ceil_tokens_over_block_size_and_free_returns_them(num_tokens):
    bm = BlockManager(8, BS)
    s = seq(list(range(num_tokens)))
    bm.allocate(s)
    assert len(s.block_table) == -(-num_tokens // BS) == len(set(s.block_table))
    assert bm.num_free_blocks == 8 - len(s.block_table)
    bm.free(s)
    assert bm.num_free_blocks == 8 and s.block_table == []


@pytest.mark.parametrize("num_tokens", range(1, 3 * BS + 2))
def test_a_repeated_prompt_hits_every_full_block_but_the_one_holding_its_last_token(num_tokens):
    bm = BlockManager(16, BS)
    tokens = list(range(100, 100 + num_tokens))
    first = computed(bm, tokens)
    bm.free(first)
    again = seq(tokens, name="again")
    bm.allocate(again)
    expected = (num_tokens - 1) // BS * BS
    assert again.num_cached_tokens == again.num_computed_tokens == expected
    assert again.num_computed_tokens < num_tokens  # the last prompt token is always computed
    bm.free(again)
    assert bm.num_free_blocks == 16


def test_shared_blocks_are_ref_counted_and_freed_only_by_their_last_holder():
    bm = BlockManager(8, BS)
    a = computed(bm, list(range(9)))
    b = seq(list(range(9)), name="b")
    bm.allocate(b)
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    assert bm.num_free_blocks == 8 - 4
    bm.free(a)
    assert bm.num_free_blocks == 8 - 3  # a's own last block only
    bm.free(b)
    assert bm.num_free_blocks == 8


def test_different_cache_salts_never_share_blocks():
    bm = BlockManager(16, BS)
    tokens = list(range(13))
    bm.free(computed(bm, tokens, salt="alice"))
    for salt in ("bob", None, ""):
        other = seq(tokens, salt)
        bm.allocate(other)
        assert other.num_cached_tokens == 0, salt
        bm.free(other)
    same = seq(tokens, "alice")
    bm.allocate(same)
    assert same.num_cached_tokens == 12


def test_free_cached_blocks_are_evicted_least_recently_freed_first_after_uncached_ones():
    bm = BlockManager(4, BS)
    old = computed(bm, [1] * BS + [9])  # 2 blocks: one full (cached), one partial
    bm.free(old)
    new = computed(bm, [2] * BS + [9])
    bm.free(new)
    events = bm.take_events()
    assert [type(e) for e in events] == [BlockStored, BlockStored]
    # 4 blocks: 2 cached free, 2 uncached free. Taking 3 uses both uncached, then evicts the older entry.
    taker = seq(list(range(50, 50 + 3 * BS)))
    bm.allocate(taker)
    (removed,) = bm.take_events()
    assert isinstance(removed, BlockRemoved) and removed.block_hashes == tuple(hash_blocks([1] * BS, BS))
    probe = seq([2] * BS + [9])
    assert bm.find_prefix(probe).block_ids  # the newer entry survived
    bm.free(taker)


def test_stored_events_chain_their_parents_and_the_digest_matches_the_held_hashes():
    bm = BlockManager(16, BS)
    tokens = list(range(3 * BS + 1))
    s = seq(tokens)
    bm.allocate(s)
    s.num_computed_tokens = BS + 1
    bm.cache_full_blocks(s)
    s.num_computed_tokens = len(s)
    bm.cache_full_blocks(s)
    first, second = bm.take_events()
    hashes = hash_blocks(tokens, BS)
    assert first == BlockStored(block_hashes=(hashes[0],), parent_block_hash=None)
    assert second == BlockStored(block_hashes=tuple(hashes[1:]), parent_block_hash=hashes[0])
    xor = 0
    for h in hashes:
        xor ^= h
    assert bm.xor_hashes == xor and len(bm.hash_to_block) == 3


def test_allocation_beyond_the_free_blocks_raises_and_changes_nothing():
    bm = BlockManager(3, BS)
    a = seq(list(range(2 * BS)))
    bm.allocate(a)
    with pytest.raises(NoFreeBlocks):
        bm.allocate(seq(list(range(BS + 1)), name="b"))
    assert bm.num_free_blocks == 1
    assert not bm.can_append_slots(a, 4 * BS) and bm.can_append_slots(a, 3 * BS)
    with pytest.raises(NoFreeBlocks):
        bm.append_slots(a, 4 * BS)
    assert len(a.block_table) == 2
    bm.free(a)
    assert bm.num_free_blocks == 3


def test_a_block_computed_twice_at_once_is_registered_once():
    bm = BlockManager(8, BS)
    tokens = list(range(2 * BS + 1))
    a, b = seq(tokens, name="a"), seq(tokens, name="b")
    bm.allocate(a)
    bm.allocate(b)  # nothing cached yet: b gets its own blocks
    for s in (a, b):
        s.num_computed_tokens = len(s)
        bm.cache_full_blocks(s)
    assert len(bm.hash_to_block) == 2 and len(bm.take_events()) == 1
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == 8
