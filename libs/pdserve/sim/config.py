"""What `pdserve sim` simulates: pools, each configured on its own, the link between them, the workload's
requests, and the fixed overheads of pdserve's control plane. Typed (pydantic), so a sweep can be written
down as JSON."""

from __future__ import annotations

from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field, model_validator

from pdserve.sim.profile import HardwareProfile


class PoolRole(StrEnum):
    UNIFIED = "unified"  # colocated: prefill and decode in one engine (chunked prefill)
    PREFILL = "prefill"
    DECODE = "decode"


class PoolConfig(BaseModel):
    """`replicas` identical engines of one role. `max_num_seqs`, `max_num_batched_tokens` (the token budget
    of a step: decodes + prefill chunks) and `block_size` as `EngineConfig`; `kv_capacity_tokens` per
    replica (None: the hardware profile's)."""

    model_config = ConfigDict(frozen=True)

    role: PoolRole
    replicas: int = Field(1, ge=1)
    max_num_seqs: int = Field(64, ge=1)
    max_num_batched_tokens: int = Field(512, ge=1)
    block_size: int = Field(16, ge=1)
    kv_capacity_tokens: int | None = Field(None, ge=1)
    hardware: HardwareProfile

    @model_validator(mode="after")
    def _budget_holds_decodes(self) -> PoolConfig:
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError("max_num_batched_tokens must be ≥ max_num_seqs (every decode fits one step)")
        return self

    @property
    def capacity_blocks(self) -> int:
        tokens = self.kv_capacity_tokens or self.hardware.kv_capacity_tokens
        return tokens // self.block_size


class LinkConfig(BaseModel):
    """The KV transfer path from a prefill replica to a decode replica: each prefill replica's link
    carries one transfer at a time (FIFO), `latency_s` + bytes / `bandwidth_bytes_per_s`. `layerwise`:
    each layer is sent as soon as it is computed (pdserve's default, docs/architecture.md §6), else all
    after the prefill (naive)."""

    model_config = ConfigDict(frozen=True)

    name: str = "link"
    bandwidth_bytes_per_s: float = Field(gt=0)
    latency_s: float = Field(0.0, ge=0)
    layerwise: bool = True
    source: str = ""


class Overheads(BaseModel):
    """Fixed times of pdserve's control plane around the engine, seconds. `request_s`: client → gateway →
    coordinator → route → reserve → the worker's queue (paid once per request before it can be
    scheduled); `first_token_s`: a worker's first token → the client; `decode_start_s`: the transfer
    verified → the sequence in the decode batch (`start`); `decode_token_s`: added to a step's time per
    sequence it decodes, the serving loop's work per emitted token beyond the engine's forward (the
    commit's publish, detokenization, and the CPU the gateway's SSE, the recorder and NATS take from the
    workers' cores per token), which grows a step with its batch as the engine's own per-sequence cost
    does. `prefill_interference`: a step that starts while another replica runs a step with prefill
    tokens takes (1 + this) × its time — replicas on one host (this machine's cores) share its memory bus,
    and a disaggregated decode worker receives, verifies and scatters the prefill's KV on its own core as
    the prefill computes (benchmarks/itl_positions.py measures it); 0 for replicas on accelerators of
    their own. Defaults: 0 (an ideal control plane)."""

    model_config = ConfigDict(frozen=True)

    request_s: float = 0.0
    first_token_s: float = 0.0
    decode_start_s: float = 0.0
    decode_token_s: float = 0.0
    prefill_interference: float = Field(0.0, ge=0.0)


class ClusterConfig(BaseModel):
    """A deployment: either one `unified` pool (colocated) or a `prefill` and a `decode` pool
    (disaggregated) with the `link` between them. `policy`: the router's prefill placement
    (`routing/policy.py`: kv, round_robin, least_loaded, random); `prefix_caching`: each prefill (or
    unified) replica keeps an LRU prefix cache of its KV capacity, keyed by pdserve's block hashes;
    `first_token_from`: 'prefill' (pdserve: the prefill worker streams the first token, so the transfer is
    off the TTFT path) or 'decode' (the first token waits for the transfer and the decode start)."""

    model_config = ConfigDict(frozen=True)

    pools: list[PoolConfig]
    link: LinkConfig | None = None
    overheads: Overheads = Overheads()
    policy: str = "kv"
    prefix_caching: bool = True
    first_token_from: str = Field("prefill", pattern="^(prefill|decode)$")

    @model_validator(mode="after")
    def _shape(self) -> ClusterConfig:
        roles = sorted(p.role.value for p in self.pools)
        if roles not in (["unified"], ["decode", "prefill"]):
            raise ValueError(f"pools must be one unified pool or one prefill + one decode pool, got {roles}")
        if roles == ["decode", "prefill"] and self.link is None:
            raise ValueError("a disaggregated cluster needs a link")
        return self

    @property
    def mode(self) -> str:
        return "colocated" if len(self.pools) == 1 else "disaggregated"

    def pool(self, role: PoolRole) -> PoolConfig:
        return next(p for p in self.pools if p.role is role)
