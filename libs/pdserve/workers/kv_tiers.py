"""The KV tiers below a worker's paged pool, built from its settings, in lookup order (issue 16): the
offload tier (host memory, `PDS_KV_OFFLOAD_BLOCKS`), the disk tier (`PDS_KV_DISK_BLOCKS`, files under
`PDS_KV_DISK_DIR/<worker_id>`), then any shared store. A tier added later appends itself here."""

from __future__ import annotations

from pdserve.config import WorkerSettings
from pdserve.engine.kv_tiers.disk_tier import DiskTier
from pdserve.engine.kv_tiers.host_tier import HostOffloadTier
from pdserve.engine.kv_tiers.tier import KVTier


def build_tiers(settings: WorkerSettings) -> list[KVTier]:
    """The worker's tiers in lookup order; empty when none is configured."""
    tiers: list[KVTier] = []
    if settings.kv_offload_blocks > 0:
        tiers.append(HostOffloadTier(settings.kv_offload_blocks))
    if settings.kv_disk_blocks > 0:
        root = settings.kv_disk_dir or settings.var_dir / "kv-disk"
        tiers.append(DiskTier(root / settings.worker_id, settings.kv_disk_blocks))
    return tiers

