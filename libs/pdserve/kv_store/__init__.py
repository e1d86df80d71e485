"""The cross-instance KV store: Mooncake Store as the tier below every worker's pool and offload tier
(docs/architecture.md §16). `MooncakeClient` bounds every call into the store; `MooncakeStoreTier` is the
`KVTier` the engine reads and writes; the store's own processes are started by
`pdserve.embedded.start_mooncake` (or compose's `mooncake-master` / `mooncake-store`)."""

from pdserve.kv_store.client import MooncakeClient, StoreFailed, StoreTimeouts, master_address
from pdserve.kv_store.tier import MooncakeStoreTier, descriptor_namespace, store_key

__all__ = ["MooncakeClient", "MooncakeStoreTier", "StoreFailed", "StoreTimeouts", "descriptor_namespace",
           "master_address", "store_key"]
