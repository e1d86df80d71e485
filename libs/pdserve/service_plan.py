"""Which processes make up a pdserve stack, and the environment each one gets (docs/architecture.md §2, §9).

One source of truth for `pdserve up` (the supervisor starts exactly this list) and for
docker-compose.yml (tests/unit/test_compose_matches_cli.py checks the compose file against it).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from sqlalchemy.engine import make_url

from pdserve.config import ModelName
from pdserve.engine.model_files import check_model_name, is_model_dir

MODES = ("disaggregated", "colocated")
KV_STORES = ("none", "mooncake")  # `pdserve up --kv-store`, `make up KV_STORE=`
MODELS = tuple(ModelName)


def model_arg(value: str) -> str:
    """`--model` of `pdserve up` and the supervisor: a built-in name (`MODELS`), or a local HF-layout
    model directory (either family), returned as an absolute path so that every child process, whatever
    its working directory, loads the same one. Raises argparse.ArgumentTypeError otherwise."""
    import argparse

    try:
        check_model_name(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return str(Path(value).expanduser().resolve()) if value not in MODELS and is_model_dir(value) else value


@dataclass(frozen=True)
class ServiceSpec:
    """One process of the stack.

    `name` is unique in the stack: log file stem (var/log/<name>.log), compose service name and
    `PDS_WORKER_ID`. `module` is what `python -m` runs. `role` is `PDS_ROLE`: the worker role
    ('prefill', 'decode', 'unified') or, for the other services, the service kind. `placement`: a
    coordinator's `PDS_PLACEMENT` ('router' where the stack runs the router service, else 'coordinator').
    """

    name: str
    module: str
    role: str
    placement: str | None = None

    @property
    def is_worker(self) -> bool:
        return self.role in ("prefill", "decode", "unified")

    @property
    def database_role(self) -> str:
        """The Postgres role this process connects as (migration 0004): only the recorder writes the
        event store; the gateway also writes its api_keys; every other process only reads."""
        return DATABASE_ROLES.get(self.role, "pdserve_reader")

    def environment(
        self, *, nats_url: str, database_url: str, model: str, var_dir: Path, gateway_port: int,
        kv_store_url: str | None = None, torch_threads: int | None = None,
    ) -> dict[str, str]:
        """The `PDS_*` variables this process starts with (on top of the caller's environment).

        `PDS_DATABASE_URL` is `database_url` as this process's role (`database_role`, no password: the
        stack's Postgres authenticates by connection). `PDS_PORT` goes to the gateway only: it is the HTTP
        port, and no other service has a fixed port (metrics and KV transfer listeners bind port 0 and
        publish the real one). `kv_store_url`: the stack's Mooncake master (`mooncake://host:port`); each
        worker then gets `PDS_KV_STORE=mooncake` and `PDS_KV_STORE_URL` (docs/architecture.md §16).
        `torch_threads`: a worker's `PDS_TORCH_THREADS` (None: not set here; `worker_threads`).
        """
        env = {
            "PDS_NATS_URL": nats_url,
            "PDS_DATABASE_URL": role_url(database_url, self.database_role),
            "PDS_WORKER_ID": self.name,
            "PDS_ROLE": self.role,
            "PDS_MODEL": model,
            "PDS_VAR_DIR": str(var_dir),
        }
        if self.role == "gateway":
            env["PDS_PORT"] = str(gateway_port)
        if self.placement is not None:
            env["PDS_PLACEMENT"] = self.placement
        if kv_store_url and self.is_worker:
            env |= {"PDS_KV_STORE": "mooncake", "PDS_KV_STORE_URL": kv_store_url}
        if torch_threads is not None and self.is_worker:
            env["PDS_TORCH_THREADS"] = str(torch_threads)
        return env


def worker_threads(plan: list[ServiceSpec], cores: int) -> int:
    """Each worker's torch threads when `plan`'s workers share a host of `cores` cores: the cores divided
    evenly among them, at least 1 (one unified worker on 2 cores: 2; a prefill and a decode worker: 1 each,
    as each owned a core before)."""
    return max(1, cores // max(1, sum(s.is_worker for s in plan)))


DATABASE_ROLES = {"recorder": "pdserve_recorder", "gateway": "pdserve_gateway"}


def role_url(database_url: str, role: str) -> str:
    """`database_url` (a SQLAlchemy URL) connecting as `role`, without the admin's password."""
    return make_url(database_url).set(username=role, password=None).render_as_string(hide_password=False)


def _service(kind: str) -> ServiceSpec:
    return ServiceSpec(kind, f"pdserve.services.{kind}", kind)


def _replicas(kind: str, n: int, placement: str | None = None) -> list[ServiceSpec]:
    """`n` processes of a control-plane service: `kind`, then `kind-1`, `kind-2`, … (the first keeps the
    service's own name, as compose's service does)."""
    names = [kind if i == 0 else f"{kind}-{i}" for i in range(n)]
    return [ServiceSpec(name, f"pdserve.services.{kind}", kind, placement) for name in names]


def service_plan(mode: str, n_prefill: int = 1, n_decode: int = 1, n_coordinators: int = 1,
                 n_routers: int = 0) -> list[ServiceSpec]:
    """The processes of a stack, in start order: recorder, routers, coordinators, workers, gateway.

    disaggregated: `n_prefill` prefill workers (prefill-0…) and `n_decode` decode workers (decode-0…).
    colocated: `n_prefill + n_decode` unified workers (unified-0…; module pdserve.services.decode with
    role 'unified'), so both modes compare on the same number of worker processes (cores).
    `n_coordinators` coordinators (coordinator, coordinator-1, …) run at once: the control plane without
    a single point of failure (docs/architecture.md §18). Each places its requests in-process
    (`PDS_PLACEMENT=coordinator`), unless `n_routers` routers (router, router-1, …) run: then the
    coordinators ask them (`PDS_PLACEMENT=router`).
    The gateway comes last so that its /health answering means every other process was started.
    Raises ValueError on an unknown mode, a worker count below 1 (disaggregated needs one of each),
    fewer than one coordinator or a negative number of routers.
    """
    if mode not in MODES:
        raise ValueError(f"mode {mode!r}: expected one of {', '.join(MODES)}")
    if n_prefill < 0 or n_decode < 0 or (mode == "disaggregated" and (n_prefill < 1 or n_decode < 1)):
        raise ValueError(
            f"{mode} needs at least one worker of each kind, got prefill={n_prefill} decode={n_decode}"
        )
    if mode == "colocated" and n_prefill + n_decode < 1:
        raise ValueError("colocated needs at least one unified worker")
    if n_coordinators < 1 or n_routers < 0:
        raise ValueError(f"a stack needs at least one coordinator and zero or more routers, got "
                         f"coordinators={n_coordinators} routers={n_routers}")
    placement = "router" if n_routers else "coordinator"
    plan = [_service("recorder"), *_replicas("router", n_routers),
            *_replicas("coordinator", n_coordinators, placement)]
    if mode == "disaggregated":
        plan += [ServiceSpec(f"prefill-{i}", "pdserve.services.prefill", "prefill") for i in range(n_prefill)]
        plan += [ServiceSpec(f"decode-{i}", "pdserve.services.decode", "decode") for i in range(n_decode)]
    else:
        plan += [
            ServiceSpec(f"unified-{i}", "pdserve.services.decode", "unified")
            for i in range(n_prefill + n_decode)
        ]
    plan.append(_service("gateway"))
    return plan
