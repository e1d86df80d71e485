"""var/run/stack.json: what a running `pdserve up` stack is, written by its supervisor, read by the CLI.

The supervisor rewrites the whole file (atomically: temp file + rename) whenever something changes, so a
reader never sees half a file. Every pid comes with its process creation time (`pdserve.process`).
"""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import BaseModel, Field

from pdserve.nats_auth import ADMIN, password_of
from pdserve.process import ProcessRef


class ServiceState(BaseModel):
    """One supervised process. `status`: starting | running | backoff | stopped."""

    module: str
    role: str
    pid: int | None = None
    create_time: float | None = None
    log: str
    status: str = "starting"
    restarts: int = Field(0, description="Times the supervisor restarted it after it died.")
    last_exit: int | None = Field(None, description="Exit status of the previous run; negative = signal.")

    @property
    def ref(self) -> ProcessRef | None:
        return ProcessRef(self.pid, self.create_time) if self.pid and self.create_time else None


class ServerState(BaseModel):
    """An embedded server the supervisor started (absent when PDS_NATS_URL / PDS_DATABASE_URL were given)."""

    url: str
    pid: int
    create_time: float
    log: str

    @property
    def ref(self) -> ProcessRef:
        return ProcessRef(self.pid, self.create_time)


class StackState(BaseModel):
    """The whole stack. `phase`: starting nats → starting postgres → migrating → starting services →
    running → stopping, or failed (with `error`)."""

    supervisor_pid: int
    supervisor_create_time: float
    mode: str
    model: str
    var_dir: str
    nats_url: str = ""
    nats_users_file: str = Field("", description="The per-service NATS users (pdserve.nats_auth), when the "
                                 "supervisor's embedded NATS requires them; empty otherwise.")
    database_url: str = ""
    gateway_url: str
    phase: str = "starting"
    error: str = ""
    notes: list[str] = Field(default_factory=list, description="Operator messages, e.g. a busy port.")
    services: dict[str, ServiceState] = Field(default_factory=dict)
    servers: dict[str, ServerState] = Field(default_factory=dict)

    @property
    def supervisor(self) -> ProcessRef:
        return ProcessRef(self.supervisor_pid, self.supervisor_create_time)

    def nats_admin_credentials(self) -> dict[str, str]:
        """`user` / `password` for `nats.connect` as the stack's admin (the CLI); none when NATS is open."""
        if not self.nats_users_file:
            return {}
        return {"user": ADMIN, "password": password_of(ADMIN, Path(self.nats_users_file))}


def state_path(var_dir: Path) -> Path:
    return Path(var_dir) / "run" / "stack.json"


def read_state(var_dir: Path) -> StackState | None:
    """The recorded stack, or None when there is none (or the file is unreadable)."""
    try:
        return StackState.model_validate_json(state_path(var_dir).read_text())
    except (OSError, ValueError):
        return None


def write_state(var_dir: Path, state: StackState) -> None:
    path = state_path(var_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(state.model_dump_json(indent=2))
    os.replace(tmp, path)


def remove_state(var_dir: Path) -> None:
    state_path(var_dir).unlink(missing_ok=True)
