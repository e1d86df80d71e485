"""The KV tiers below a worker's paged pool, built from its settings, in lookup order (issue 16): the
offload tier (host memory, `PDS_KV_OFFLOAD_BLOCKS`), the disk tier (`PDS_KV_DISK_BLOCKS`, files under
`PDS_KV_DISK_DIR/<worker_id>`), then the shared store (`PDS_KV_STORE=mooncake`: Mooncake Store,
`pdserve.kv_store`). A tier added later appends itself here."""

from __future__ import annotations

import logging

from pdserve.config import KVStoreKind, WorkerSettings
from pdserve.engine.kv_tiers.disk_tier import DiskTier
from pdserve.engine.kv_tiers.host_tier import HostOffloadTier
from pdserve.engine.kv_tiers.tier import KVTier
from pdserve.engine.loader import LoadedModel
from pdserve.engine.model_family import EngineModel

log = logging.getLogger(__name__)


def build_tiers(settings: WorkerSettings, loaded: LoadedModel | None = None,
                model: EngineModel | None = None) -> list[KVTier]:
    """The worker's tiers in lookup order; empty when none is configured. The store needs the worker's
    `loaded` model and engine `model` (its blocks' shape and dtype, and the compatibility descriptor that
    namespaces its keys); for a model with recurrent state the store holds its state checkpoints too.
    A store whose client cannot load (its wheel links Debian's libibverbs1: `make kv-store-tools`) is left
    out with an error in the log: the worker serves without it. Raises ValueError for a store without
    `loaded` and `model`."""
    tiers: list[KVTier] = []
    if settings.kv_offload_blocks > 0:
        tiers.append(HostOffloadTier(settings.kv_offload_blocks))
    if settings.kv_disk_blocks > 0:
        root = settings.kv_disk_dir or settings.var_dir / "kv-disk"
        tiers.append(DiskTier(root / settings.worker_id, settings.kv_disk_blocks))
    if settings.kv_store == KVStoreKind.MOONCAKE:
        if loaded is None or model is None:
            raise ValueError("the shared KV store needs the worker's loaded and engine model")
        if (store := _mooncake_tier(settings, loaded, model)) is not None:
            tiers.append(store)
    return tiers


def _mooncake_tier(settings: WorkerSettings, loaded: LoadedModel, model: EngineModel) -> KVTier | None:
    try:
        import mooncake.store  # noqa: F401  (fails here, not at the first call, without libibverbs1)

        from pdserve.kv_store import MooncakeClient, MooncakeStoreTier, StoreTimeouts, descriptor_namespace
    except ImportError as e:
        log.error("kv store: mooncake does not load (%s): serving without the shared store "
                  "(`make kv-store-tools` installs libibverbs1)", e)
        return None
    # heartbeat imports core, which imports this module: import the descriptor at call time.
    from pdserve.workers.heartbeat import compatibility_descriptor

    spec = model.cache_spec()
    descriptor = compatibility_descriptor(loaded, settings, model)
    client = MooncakeClient(settings.kv_store_url, StoreTimeouts(
        lookup_s=settings.kv_store_lookup_timeout_s, get_s=settings.kv_store_get_timeout_s,
        put_s=settings.kv_store_put_timeout_s, retry_after_s=settings.kv_store_retry_after_s),
        local_host=settings.kv_store_local_host)
    tier = MooncakeStoreTier(
        client, descriptor_namespace(descriptor.model_dump_json()),
        (spec.num_paged_layers, settings.block_size, *spec.paged_row_shape), model.dtype,
        worker_id=settings.worker_id,
        checkpoint_bytes=spec.state.bytes_per_slot(model.dtype) if spec.state is not None else 0)
    client.connect()
    return tier
