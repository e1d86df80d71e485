"""The offload tier (`engine/kv_tiers/host_tier.py`) on its own: capacity never exceeded, LRU order, a
corrupt copy detected (False, dropped), and the changes it reports for the worker's KV events."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.kv_tiers.host_tier import HostOffloadTier
from pdserve.engine.kv_tiers.tier import KVTier, ReportsChanges, TierChange

SHAPE = (3, 4, 2, 1, 8)  # [num_paged_layers, block_size, 2, num_kv_heads, head_dim]


def block(seed: int) -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed))


def test_it_is_a_kv_tier_that_reports_changes():
    tier = HostOffloadTier(2)
    assert isinstance(tier, KVTier) and isinstance(tier, ReportsChanges)
    assert (tier.name, tier.write_on) == ("offload", "evict")


def test_capacity_is_never_exceeded_and_the_least_recently_used_block_goes_first():
    tier = HostOffloadTier(3)
    for h in range(10):
        tier.put(h, block(h))
        assert tier.num_blocks <= 3
    assert [h for h in range(10) if h in tier] == [7, 8, 9]
    out = torch.empty(SHAPE)
    assert tier.get_into(7, out)  # 7 becomes the most recent
    tier.put(10, block(10))
    assert [h for h in range(11) if h in tier] == [7, 9, 10]
    assert tier.num_evictions == 8


def test_a_repeated_put_refreshes_without_a_second_copy():
    tier = HostOffloadTier(2)
    tier.put(1, block(1))
    tier.put(2, block(2))
    tier.put(1, block(99))  # same hash = same KV: the held copy is kept, made most recent
    tier.put(3, block(3))
    assert 1 in tier and 2 not in tier
    out = torch.empty(SHAPE)
    assert tier.get_into(1, out) and torch.equal(out, block(1))


def test_put_copies_so_the_caller_may_reuse_its_tensor():
    tier = HostOffloadTier(1)
    b = block(5)
    tier.put(5, b)
    b.zero_()
    out = torch.empty(SHAPE)
    assert tier.get_into(5, out) and torch.equal(out, block(5))


def test_lookup_counts_the_leading_run_held():
    tier = HostOffloadTier(8)
    for h in (10, 11, 13):
        tier.put(h, block(h))
    assert tier.lookup([10, 11, 12, 13]) == 2
    assert tier.lookup([12, 13]) == 0
    assert tier.lookup([]) == 0


def test_a_corrupt_block_is_detected_dropped_and_reported():
    tier = HostOffloadTier(4)
    tier.put(1, block(1))
    tier.put(2, block(2))
    tier.take_changes()
    tier._blocks["kv", 1].block.view(-1)[17] += 1.0  # a changed value in the held copy
    out = torch.empty(SHAPE)
    assert tier.get_into(1, out) is False
    assert 1 not in tier and tier.num_corrupt == 1
    assert tier.get_into(1, out) is False  # gone: a miss now
    assert tier.get_into(2, out) and torch.equal(out, block(2))
    assert tier.take_changes() == [TierChange(False, 1)]


def test_a_read_into_a_wrong_shape_is_a_miss_not_an_error():
    tier = HostOffloadTier(1)
    tier.put(1, block(1))
    assert tier.get_into(1, torch.empty(2, 2)) is False


def test_changes_say_what_was_stored_and_evicted_in_order():
    tier = HostOffloadTier(1)
    tier.put(1, block(1))
    tier.put(2, block(2))
    assert tier.take_changes() == [TierChange(True, 1), TierChange(False, 1), TierChange(True, 2)]
    assert tier.take_changes() == []


def test_zero_capacity_holds_nothing_and_negative_is_refused():
    tier = HostOffloadTier(0)
    tier.put(1, block(1))
    assert tier.num_blocks == 0 and tier.lookup([1]) == 0
    with pytest.raises(ValueError, match="capacity"):
        HostOffloadTier(-1)
