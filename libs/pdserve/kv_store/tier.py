"""The shared KV store tier: whole KV blocks in a Mooncake Store, read by every worker of the cluster
(the seed's stage 4; docs/architecture.md §16). Implements `engine.kv_tiers.tier.KVTier`.

Key: `pdserve/<namespace>/<chained block hash, 16 hex digits>`, where `namespace` is the digest of the
worker's compatibility descriptor (`descriptor_namespace`): two workers share a block only if their model,
weights, dtype, block size, hash seed and cache layout all match, exactly the rule that pairs a prefill
worker with a decode worker (§6); the chained hash already covers the whole prefix and the cache salt.

Value: a 16-byte header — magic `PDSB`, payload bytes (u32), xxh3-64 of the payload (u64) — then the block,
`[num_paged_layers, block_size, *paged_row_shape]` in the model's dtype, bytes as laid out in memory (a
hybrid's state checkpoint, key `pdserve/<namespace>/checkpoint/<hash>`: one slot's packed state, uint8). A
read is used only if its length and checksum match; a mismatch is dropped from the store (`remove`) and
the block recomputed.

Every call is bounded (`kv_store.client`): store down, slow or corrupt, a lookup says 0, a get says False,
a put drops the block — the engine recomputes, and no request fails for the store.
"""

from __future__ import annotations

import hashlib
import logging
import struct
import threading
import time
from collections.abc import Sequence

import torch
import xxhash

from pdserve.engine.kv_tiers.tier import KeySpace, TierChange
from pdserve.kv_store.client import OBJECT_NOT_FOUND, MooncakeClient, StoreFailed
from pdserve.telemetry import metrics

log = logging.getLogger(__name__)

HEADER = struct.Struct("<4sIQ")
MAGIC = b"PDSB"


def descriptor_namespace(descriptor_json: str) -> str:
    """The store namespace of a compatibility descriptor: sha256 of its canonical JSON, first 16 hex
    digits (64 bits: a collision between two incompatible descriptors is a 2^-64 event)."""
    return hashlib.sha256(descriptor_json.encode()).hexdigest()[:16]


def store_key(namespace: str, block_hash: int, space: KeySpace = "kv") -> str:
    """The Mooncake key of one block: `pdserve/<namespace>/<u64 hash as 16 hex digits>`; of a state
    checkpoint (`space="checkpoint"`): `pdserve/<namespace>/checkpoint/<hash>`."""
    infix = "checkpoint/" if space == "checkpoint" else ""
    return f"pdserve/{namespace}/{infix}{block_hash & 0xFFFF_FFFF_FFFF_FFFF:016x}"


class _Lane:
    """One key space's values: payload bytes, its staging buffers (header + payload, uint8, registered)."""

    def __init__(self, client: MooncakeClient, payload_bytes: int) -> None:
        self.payload_bytes = payload_bytes
        self.value_bytes = HEADER.size + payload_bytes
        self.put_buf = torch.empty(self.value_bytes, dtype=torch.uint8)
        self.get_buf = torch.empty(self.value_bytes, dtype=torch.uint8)
        client.register(self.put_buf)
        client.register(self.get_buf)


class MooncakeStoreTier:
    """KV blocks of one block shape in a Mooncake Store (`KVTier`, name "store", written on compute).

    `block_shape`: `(num_paged_layers, block_size, *paged_row_shape)`; `dtype` the model's. Each call moves
    one block through one of two registered staging buffers (`header + block bytes`, uint8, CPU): one for
    puts, one for gets, so a put on the engine's background thread never waits for a lookup.
    `checkpoint_bytes` > 0 (a hybrid model: `StatePool.packed_bytes`): the tier also holds state
    checkpoints of that size (`space="checkpoint"`, uint8), through two staging buffers of their own.
    `worker_id` labels the metrics: `pdserve:kv_store_bytes{op}`, `pdserve:kv_store_seconds{op}`,
    `pdserve:kv_store_failures{op,reason}` (op get | put | lookup; reason timeout | error | down | busy |
    checksum | full).

    What this worker published (and what it found corrupt and dropped) it reports as `take_changes`, so
    its KV events tell the router's index what the store holds (tier "store", shared by every worker:
    `routing/kv_index.py`).
    """

    name = "store"
    write_on = "compute"

    def __init__(self, client: MooncakeClient, namespace: str, block_shape: Sequence[int],
                 dtype: torch.dtype, *, worker_id: str = "", checkpoint_bytes: int = 0) -> None:
        self.client = client
        self.namespace = namespace
        self.block_shape = tuple(block_shape)
        self.dtype = dtype
        self.block_bytes = torch.Size(self.block_shape).numel() * torch.empty((), dtype=dtype).element_size()
        self._lanes: dict[KeySpace, _Lane] = {"kv": _Lane(client, self.block_bytes)}
        if checkpoint_bytes > 0:
            self._lanes["checkpoint"] = _Lane(client, checkpoint_bytes)
        self.holds_checkpoints = checkpoint_bytes > 0
        self.value_bytes = self._lanes["kv"].value_bytes
        self.worker_id = worker_id
        self._changes: list[TierChange] = []
        self._changes_lock = threading.Lock()  # puts run on the engine's tier writer thread
        for op in ("get", "put"):
            metrics.KV_STORE_BYTES.labels(worker_id=worker_id, op=op)
            metrics.KV_STORE_SECONDS.labels(worker_id=worker_id, op=op)

    def take_changes(self) -> list[TierChange]:
        """Blocks this worker published (stored) or dropped as corrupt since the last call, oldest first."""
        with self._changes_lock:
            changes, self._changes = self._changes, []
        return changes

    def _changed(self, stored: bool, block_hash: int, space: KeySpace = "kv") -> None:
        with self._changes_lock:
            self._changes.append(TierChange(stored, block_hash, space))

    def _failed(self, op: str, reason: str) -> None:
        metrics.KV_STORE_FAILURES.labels(worker_id=self.worker_id, op=op, reason=reason).inc()

    def _observe(self, op: str, nbytes: int, seconds: float) -> None:
        metrics.KV_STORE_BYTES.labels(worker_id=self.worker_id, op=op).inc(nbytes)
        metrics.KV_STORE_SECONDS.labels(worker_id=self.worker_id, op=op).observe(seconds)

    def lookup(self, block_hashes: Sequence[int], space: KeySpace = "kv") -> int:
        """How many leading blocks of the chain the store holds (one `batch_is_exist`); 0 when the store
        is down or slow (at most `timeouts.lookup_s`), or for a key space this tier does not hold."""
        if not block_hashes or space not in self._lanes:
            return 0
        try:
            held = self.client.exists([store_key(self.namespace, h, space) for h in block_hashes])
        except StoreFailed as e:
            self._failed("lookup", e.reason)
            return 0
        n = 0
        while n < len(held) and held[n]:
            n += 1
        return n

    def put(self, block_hash: int, block: torch.Tensor, space: KeySpace = "kv") -> None:
        """Publish `block` under `block_hash` with its checksum. Drops it (counted in
        `kv_store_failures{op="put"}`) when the shape or dtype is not this tier's (a checkpoint: not
        `checkpoint_bytes` uint8), or the store refuses, fails or is slow; never raises."""
        lane = self._lanes.get(space)
        if space == "kv":
            fits = tuple(block.shape) == self.block_shape and block.dtype == self.dtype
        else:
            fits = lane is not None and block.dtype == torch.uint8 and block.numel() == lane.payload_bytes
        if lane is None or not fits:
            log.error("kv store: %s %s %s is not this tier's", space, tuple(block.shape), block.dtype)
            self._failed("put", "error")
            return
        started = time.perf_counter()
        payload = lane.put_buf[HEADER.size:]
        payload.copy_(block.contiguous().reshape(-1).view(torch.uint8))
        digest = xxhash.xxh3_64_intdigest(payload.numpy())
        lane.put_buf[:HEADER.size].copy_(
            torch.frombuffer(bytearray(HEADER.pack(MAGIC, lane.payload_bytes, digest)), dtype=torch.uint8))
        try:
            rc = self.client.put_from(store_key(self.namespace, block_hash, space), lane.put_buf.data_ptr(),
                                      lane.value_bytes)
        except StoreFailed as e:
            self._failed("put", e.reason)
            return
        if rc != 0:
            self._failed("put", "full")
            return
        self._observe("put", lane.value_bytes, time.perf_counter() - started)
        self._changed(True, block_hash, space)

    def get_into(self, block_hash: int, out: torch.Tensor, space: KeySpace = "kv") -> bool:
        """Copy the block under `block_hash` into `out` (this tier's shape and dtype, contiguous CPU; a
        checkpoint: `checkpoint_bytes` uint8) if the store holds it whole and its checksum matches. False
        otherwise (a corrupt copy is also removed from the store and counted as `reason="checksum"`);
        never raises."""
        lane = self._lanes.get(space)
        if lane is None:
            return False
        started = time.perf_counter()
        key = store_key(self.namespace, block_hash, space)
        try:
            n = self.client.get_into(key, lane.get_buf.data_ptr(), lane.value_bytes)
        except StoreFailed as e:
            self._failed("get", e.reason)
            return False
        if n == OBJECT_NOT_FOUND:
            return False
        if n != lane.value_bytes:
            log.warning("kv store: %s holds %d bytes, expected %d: dropped", key, n, lane.value_bytes)
            self._failed("get", "checksum")
            self.client.remove(key)
            self._changed(False, block_hash, space)
            return False
        magic, length, digest = HEADER.unpack(lane.get_buf[:HEADER.size].numpy().tobytes())
        payload = lane.get_buf[HEADER.size:]
        intact = magic == MAGIC and length == lane.payload_bytes
        if not intact or xxhash.xxh3_64_intdigest(payload.numpy()) != digest:
            log.warning("kv store: checksum mismatch for %s: dropped, recomputing", key)
            self._failed("get", "checksum")
            self.client.remove(key)
            self._changed(False, block_hash, space)
            return False
        if space == "kv":
            out.copy_(payload.view(self.dtype).view(self.block_shape))
        else:
            out.reshape(-1).view(torch.uint8).copy_(payload)
        self._observe("get", lane.value_bytes, time.perf_counter() - started)
        return True

    def close(self) -> None:
        """Close the client (both lanes)."""
        self.client.close()
