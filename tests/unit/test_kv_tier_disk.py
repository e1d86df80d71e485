"""The disk tier (`engine/kv_tiers/disk_tier.py`): one file per block, capacity never exceeded (files
deleted with their blocks), LRU, a changed or missing file detected (False, dropped), and the engine
recomputing past a corrupt block with the oracle's output."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.kv_tiers.disk_tier import DiskTier
from pdserve.engine.kv_tiers.host_tier import HostOffloadTier
from pdserve.engine.kv_tiers.tier import KVTier, ReportsChanges, TierChange
from pdserve.engine.llm_engine import EngineConfig, LLMEngine
from pdserve.engine.loader import load_model
from pdserve.engine.model import LlamaModel
from pdserve.engine.sequence import Sequence
from pdserve.messages import SamplingParams
from tests import oracle

SHAPE = (3, 4, 2, 1, 8)
BS = 16


def block(seed: int) -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed))


def test_capacity_lru_and_files_follow_the_blocks(tmp_path):
    tier = DiskTier(tmp_path, 2)
    assert isinstance(tier, KVTier) and isinstance(tier, ReportsChanges) and tier.name == "disk"
    for h in range(4):
        tier.put(h, block(h))
        assert tier.num_blocks <= 2 and len(list(tmp_path.glob("*.kv"))) <= 2
    out = torch.empty(SHAPE)
    assert tier.lookup([2, 3]) == 2 and tier.lookup([0, 3]) == 0
    assert tier.get_into(2, out) and torch.equal(out, block(2))  # 2 most recent now
    tier.put(4, block(4))
    assert tier.lookup([3]) == 0 and tier.lookup([2]) == 1
    assert sorted(p.name for p in tmp_path.glob("*.kv")) == sorted(tier.path(h).name for h in (2, 4))


def test_a_changed_truncated_or_missing_file_is_a_miss_and_dropped(tmp_path):
    tier = DiskTier(tmp_path, 8)
    for h in (1, 2, 3):
        tier.put(h, block(h))
    tier.take_changes()
    raw = bytearray(tier.path(1).read_bytes())
    raw[5] ^= 0xFF
    tier.path(1).write_bytes(bytes(raw))
    tier.path(2).write_bytes(b"short")
    tier.path(3).unlink()
    out = torch.empty(SHAPE)
    assert [tier.get_into(h, out) for h in (1, 2, 3)] == [False, False, False]
    assert tier.num_blocks == 0 and tier.num_corrupt == 3
    assert tier.take_changes() == [TierChange(False, 1), TierChange(False, 2), TierChange(False, 3)]


def test_files_of_an_earlier_process_are_not_trusted(tmp_path):
    DiskTier(tmp_path, 4).put(7, block(7))
    again = DiskTier(tmp_path, 4)
    assert again.lookup([7]) == 0 and not list(tmp_path.glob("*.kv"))


def test_negative_capacity_is_refused(tmp_path):
    with pytest.raises(ValueError, match="capacity"):
        DiskTier(tmp_path, -1)


def test_the_engine_reads_back_from_disk_below_a_small_offload_tier_and_recomputes_past_a_bad_file(tmp_path):
    tiny = load_model("tiny", tmp_path / "weights")
    model = LlamaModel(tiny.config, tiny.weights)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, tiny.config.vocab_size, (4 * BS + 3,), generator=g).tolist()
               for _ in range(4)]
    greedy = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    offload, disk = HostOffloadTier(2), DiskTier(tmp_path / "disk", 64)
    engine = LLMEngine(model, EngineConfig(num_blocks=6, block_size=BS, max_num_batched_tokens=256),
                       tiers=[offload, disk], tier_writer_thread=False)

    def run(p: list[int], rid: str) -> Sequence:
        seq = Sequence(rid, p, greedy)
        engine.add_request(seq)
        while engine.has_work:
            engine.step()
        return seq

    for i, p in enumerate(prompts):
        run(p, f"first-{i}")
    hashes = engine.block_manager.chain_hashes(Sequence("h", prompts[0]), 4)
    assert offload.lookup(hashes) == 0 and disk.lookup(hashes) == 4  # offload kept only the latest two
    again = run(prompts[0], "again")
    assert again.cached_tokens_by_tier == {"disk": 4 * BS}
    assert again.output_token_ids == oracle.greedy(model, prompts[0], 4)
    for i in (1, 2):
        run(prompts[i], f"evict-{i}")  # push prompt 0's blocks out of the pool again
    h1 = engine.block_manager.chain_hashes(Sequence("h", prompts[1]), 4)
    raw = bytearray(disk.path(h1[1]).read_bytes())
    raw[0] ^= 1
    disk.path(h1[1]).write_bytes(bytes(raw))
    for i in (2, 3, 0):
        run(prompts[i], f"more-{i}")
    third = run(prompts[1], "third")
    assert third.num_cached_tokens == BS and disk.num_corrupt == 1  # the hit stops before the bad file
    assert set(third.cached_tokens_by_tier) <= {"offload", "disk"}
    assert third.output_token_ids == oracle.greedy(model, prompts[1], 4)
