"""The disk tier: KV blocks as files under a directory, below the offload tier, LRU, checksummed (issue 16).

One file per block, `<block hash as 16 hex digits>.kv` (a state checkpoint, `space="checkpoint"`:
`.checkpoint`, one slot's packed state; the capacity counts both), the block's raw bytes (its dtype and
shape are the pool's, the same for every block of a worker); the xxh3-64 digest of each file's bytes is
kept in memory and verified on every read, so a file changed, truncated or removed behind the tier's
back reads as a miss. The directory is the tier's own: files left by an earlier process are removed at
start (their digests are gone with it).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from pdserve.engine.kv_tiers.checksum import block_digest
from pdserve.engine.kv_tiers.tier import KeySpace, TierChange, WriteOn, leading_run

log = logging.getLogger(__name__)

_SUFFIX: dict[KeySpace, str] = {"kv": ".kv", "checkpoint": ".checkpoint"}


class DiskTier:
    """Up to `capacity_blocks` blocks in files under `directory` (created), least recently used evicted
    (its file deleted). Thread-safe. A failed write (disk full, permissions) drops the block and is
    logged; a failed read is a miss. Raises ValueError for a negative capacity."""

    write_on: WriteOn = "evict"
    holds_checkpoints = True

    def __init__(self, directory: Path, capacity_blocks: int, name: str = "disk") -> None:
        if capacity_blocks < 0:
            raise ValueError(f"capacity_blocks must be >= 0, got {capacity_blocks}")
        self.name = name
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        for suffix in _SUFFIX.values():
            for stale in self.directory.glob(f"*{suffix}"):
                stale.unlink(missing_ok=True)
        self.capacity_blocks = capacity_blocks
        # (space, hash) → digest; first = least recently used
        self._digests: OrderedDict[tuple[KeySpace, int], int] = OrderedDict()
        self._lock = threading.Lock()
        self._changes: list[TierChange] = []
        self.num_corrupt = 0

    @property
    def num_blocks(self) -> int:
        return len(self._digests)

    def path(self, block_hash: int, space: KeySpace = "kv") -> Path:
        return self.directory / f"{block_hash:016x}{_SUFFIX[space]}"

    def lookup(self, block_hashes: Sequence[int], space: KeySpace = "kv") -> int:
        with self._lock:
            return leading_run(block_hashes, self._digests, space)

    def put(self, block_hash: int, block: torch.Tensor, space: KeySpace = "kv") -> None:
        if self.capacity_blocks == 0:
            return
        key = (space, block_hash)
        with self._lock:
            if key in self._digests:
                self._digests.move_to_end(key)
                return
            evicted = []
            while len(self._digests) >= self.capacity_blocks:
                (s, h), _ = self._digests.popitem(last=False)
                evicted.append((s, h))
                self._changes.append(TierChange(False, h, s))
        for s, h in evicted:
            self.path(h, s).unlink(missing_ok=True)
        data = block.contiguous()
        path = self.path(block_hash, space)
        try:
            data.reshape(-1).view(torch.uint8).numpy().tofile(path)
        except OSError:
            log.exception("disk tier: writing %s %016x failed", space, block_hash)
            path.unlink(missing_ok=True)
            return
        digest = block_digest(data)
        with self._lock:
            self._digests[key] = digest
            self._changes.append(TierChange(True, block_hash, space))

    def get_into(self, block_hash: int, out: torch.Tensor, space: KeySpace = "kv") -> bool:
        key = (space, block_hash)
        with self._lock:
            digest = self._digests.get(key)
            if digest is None:
                return False
            self._digests.move_to_end(key)
        try:
            raw = np.fromfile(self.path(block_hash, space), dtype=np.uint8)
            view = out.reshape(-1).view(torch.uint8)
            if raw.size != view.numel():
                raise ValueError(f"{raw.size} bytes on disk, {view.numel()} expected")
            view.copy_(torch.from_numpy(raw))
            ok = block_digest(out) == digest
        except (OSError, RuntimeError, ValueError):
            ok = False
        if not ok:
            with self._lock:
                if self._digests.pop(key, None) is not None:
                    self._changes.append(TierChange(False, block_hash, space))
                self.num_corrupt += 1
            self.path(block_hash, space).unlink(missing_ok=True)
        return ok

    def take_changes(self) -> list[TierChange]:
        """Blocks stored and removed since the last call, oldest first (`tier.ReportsChanges`)."""
        with self._lock:
            changes, self._changes = self._changes, []
        return changes
