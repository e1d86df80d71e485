"""The `pdserve up` supervisor: one detached process that owns a whole stack (docs/architecture.md §9).

    python -m pdserve.supervisor --mode disaggregated --model smollm2 --prefill 1 --decode 1 --port 8000

Order: NATS (PDS_NATS_URL, else embedded, with one user per process: pdserve.nats_auth) → Postgres
(PDS_DATABASE_URL, else embedded, database `pdserve`) → create the database if absent + Alembic upgrade
(which grants the services' database roles) → every process of `service_plan` as a child, each with its
NATS user and database role, output to var/log/<name>.log. A child that dies is restarted with
exponential backoff. SIGTERM/SIGINT stop the children (gateway first, recorder last so it drains the
events the others wrote), then the embedded servers. The state lives in var/run/stack.json for
`pdserve status|down|logs`.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import time
from pathlib import Path

import psutil
from sqlalchemy.engine import make_url

from pdserve.config import CommonSettings
from pdserve.embedded import EmbeddedServer, start_mooncake, start_nats, start_postgres
from pdserve.nats_auth import stack_users, write_server_config, write_users
from pdserve.process import ProcessRef, child_dies_with_parent
from pdserve.service_plan import KV_STORES, MODES, ServiceSpec, model_arg, service_plan, worker_threads
from pdserve.stack_state import ServerState, ServiceState, StackState, remove_state, write_state

log = logging.getLogger("pdserve.supervisor")

STACK_DATABASE = "pdserve"
_BACKOFF_FIRST_S = 0.5
_BACKOFF_MAX_S = 30.0
_HEALTHY_RUN_S = 30.0  # a child that lived this long is considered to have started fine: backoff resets
_STOP_TIMEOUT_S = 10.0


def prepare_database(database_url: str) -> str:
    """Create the database named in `database_url` if absent (connecting to the same server's `postgres`
    database to do it) and migrate it to head. Returns `database_url`. Raises what
    `pdserve.store.migrate` raises when the server refuses or is unreachable."""
    from pdserve.store.migrate import create_database, upgrade

    url = make_url(database_url)
    admin_url = url.set(database="postgres").render_as_string(hide_password=False)
    create_database(admin_url, url.database or STACK_DATABASE)
    upgrade(database_url)
    return database_url


class Supervisor:
    """Runs one stack until signalled. `run()` returns the process exit status."""

    def __init__(self, args: argparse.Namespace, plan: list[ServiceSpec] | None = None) -> None:
        """`args` as `parse_args` makes them; `plan`, when given, replaces `service_plan(mode, ...)`."""
        self.var_dir: Path = args.var_dir.resolve()
        self.model: str = args.model
        self.port: int = args.port
        self.kv_store: str = getattr(args, "kv_store", "none")
        self.kv_store_url: str | None = None
        self.plan: list[ServiceSpec] = plan or service_plan(
            args.mode, args.prefill, args.decode, args.coordinators, args.routers)
        # each worker's PDS_TORCH_THREADS: the host's cores shared among the workers, unless the caller chose
        self.torch_threads: int | None = None if "PDS_TORCH_THREADS" in os.environ \
            else worker_threads(self.plan, len(os.sched_getaffinity(0)))
        self.servers: list[EmbeddedServer] = []
        self.stopping = asyncio.Event()
        self.procs: dict[str, asyncio.subprocess.Process] = {}
        me = ProcessRef.of(os.getpid())
        self.state = StackState(
            supervisor_pid=me.pid,
            supervisor_create_time=me.create_time,
            mode=args.mode,
            model=args.model,
            var_dir=str(self.var_dir),
            gateway_url=f"http://127.0.0.1:{args.port}",
        )

    def save(self, **changes: object) -> None:
        for key, value in changes.items():
            setattr(self.state, key, value)
        write_state(self.var_dir, self.state)

    def stop(self) -> None:
        """Ask `run()` to stop the stack (what SIGTERM/SIGINT do)."""
        self.stopping.set()

    async def run(self) -> int:
        """Start the stack, supervise it until `stop()` or a signal, stop it. Returns 0, or 1 when the
        backing services or migrations failed (the reason is in stack.json's `error` and the log)."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stop)
        try:
            return await self._run()
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)

    async def _run(self) -> int:
        (self.var_dir / "log").mkdir(parents=True, exist_ok=True)
        try:
            await self.start_backing_services()
        except Exception as exc:
            log.exception("stack failed to start")
            self.save(phase="failed", error=f"{self.state.phase}: {type(exc).__name__}: {exc}")
            self.stop_servers()
            return 1
        tasks = []
        if not self.stopping.is_set():
            self.save(phase="starting services")
            tasks = [asyncio.create_task(self.keep_running(spec)) for spec in self.plan]
            self.save(phase="running")
            log.info("stack running: %d processes, gateway %s", len(self.plan), self.state.gateway_url)
            await self.stopping.wait()
        self.save(phase="stopping")
        await self.stop_children()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.stop_servers()
        remove_state(self.var_dir)
        log.info("stack stopped")
        return 0

    async def start_backing_services(self) -> None:
        nats_url = os.environ.get("PDS_NATS_URL")
        if not nats_url:
            self.save(phase="starting nats")
            config = self.write_nats_users()
            # Not in a thread: the kernel's parent-death signal (PR_SET_PDEATHSIG) follows the *thread*
            # that forked, and an executor thread may exit long before this process does.
            nats = start_nats(self.var_dir / "nats", log_path=self.var_dir / "log" / "nats.log",
                              config_path=config)
            self.adopt(nats)
            nats_url = nats.url
        self.save(nats_url=nats_url)
        database_url = os.environ.get("PDS_DATABASE_URL")
        if not database_url:
            self.save(phase="starting postgres")
            pg = await asyncio.to_thread(start_postgres, self.var_dir / "pg")
            self.adopt(pg)
            database_url = make_url(pg.url).set(database=STACK_DATABASE).render_as_string(hide_password=False)
        if self.kv_store == "mooncake":
            self.kv_store_url = os.environ.get("PDS_KV_STORE_URL")
            if not self.kv_store_url:
                self.save(phase="starting mooncake")
                store = start_mooncake(self.var_dir / "log", segment_bytes=_store_segment_bytes())
                self.adopt(store)
                self.kv_store_url = store.url
        self.save(phase="migrating")
        await asyncio.to_thread(prepare_database, database_url)
        self.save(database_url=database_url)

    def write_nats_users(self) -> Path:
        """Fresh per-service NATS users for the embedded server (pdserve.nats_auth): their passwords in
        var/run/nats-users.json, the server's authorization in var/run/nats-auth.conf (both 0600). Returns
        the configuration's path."""
        settings = CommonSettings()
        users = stack_users([(s.name, s.role) for s in self.plan], settings.subject_prefix,
                            settings.events_stream)
        users_file = self.var_dir / "run" / "nats-users.json"
        config = self.var_dir / "run" / "nats-auth.conf"
        write_users(users_file, users)
        write_server_config(config, users)
        self.save(nats_users_file=str(users_file))
        return config

    def adopt(self, server: EmbeddedServer) -> None:
        self.servers.append(server)
        ref = ProcessRef.of(server.pid)
        self.state.servers[server.name] = ServerState(
            url=server.url, pid=ref.pid, create_time=ref.create_time, log=str(server.log_path)
        )
        if server.note:
            self.state.notes.append(server.note)
        self.save()

    def stop_servers(self) -> None:
        for server in reversed(self.servers):
            log.info("stopping embedded %s", server.name)
            server.stop()
        self.servers.clear()

    async def keep_running(self, spec: ServiceSpec) -> None:
        """Start `spec`, and restart it whenever it exits until the stack stops (exponential backoff,
        reset after a run of 30 s)."""
        log_path = self.var_dir / "log" / f"{spec.name}.log"
        svc = ServiceState(module=spec.module, role=spec.role, log=str(log_path))
        self.state.services[spec.name] = svc
        env = {
            **os.environ,
            "PYTHONUNBUFFERED": "1",
            **spec.environment(
                nats_url=self.state.nats_url,
                database_url=self.state.database_url,
                model=self.model,
                var_dir=self.var_dir,
                gateway_port=self.port,
                kv_store_url=self.kv_store_url,
                torch_threads=self.torch_threads,
            ),
        }
        if self.state.nats_users_file:  # the service reads its own password from the file, not from env
            env |= {"PDS_NATS_USER": spec.name, "PDS_NATS_USERS_FILE": self.state.nats_users_file}
        failures = 0
        while not self.stopping.is_set():
            with open(log_path, "ab") as out:
                proc = await asyncio.create_subprocess_exec(
                    sys.executable,
                    "-m",
                    spec.module,
                    env=env,
                    stdin=asyncio.subprocess.DEVNULL,
                    stdout=out,
                    stderr=asyncio.subprocess.STDOUT,
                    preexec_fn=child_dies_with_parent,
                )
            self.procs[spec.name] = proc
            try:
                ref = ProcessRef.of(proc.pid)
                svc.pid, svc.create_time = ref.pid, ref.create_time
            except psutil.NoSuchProcess:  # it already exited and was reaped: its exit is handled below
                svc.pid, svc.create_time = proc.pid, None
            svc.status = "running"
            self.save()
            started = time.monotonic()
            code = await proc.wait()
            svc.last_exit, svc.status = code, "stopped"
            if self.stopping.is_set():
                self.save()
                return
            lived_s = time.monotonic() - started
            failures = 0 if lived_s >= _HEALTHY_RUN_S else failures + 1
            delay_s = min(_BACKOFF_MAX_S, _BACKOFF_FIRST_S * 2 ** max(failures - 1, 0))
            svc.restarts += 1
            svc.status = "backoff"
            self.save()
            log.warning(
                "%s exited with %s after %.1f s; restart #%d in %.1f s (log %s)",
                spec.name,
                code,
                lived_s,
                svc.restarts,
                delay_s,
                log_path,
            )
            try:
                await asyncio.wait_for(self.stopping.wait(), delay_s)
            except TimeoutError:
                pass

    async def stop_children(self) -> None:
        """SIGTERM in tiers: gateway (no new requests), then the rest, then the recorder (drains events).
        Each tier gets 10 s before SIGKILL."""
        tiers = [
            [s.name for s in self.plan if s.role == "gateway"],
            [s.name for s in self.plan if s.role not in ("gateway", "recorder")],
            [s.name for s in self.plan if s.role == "recorder"],
        ]
        for tier in tiers:
            live = {n: self.procs[n] for n in tier if n in self.procs and self.procs[n].returncode is None}
            if not live:
                continue
            started = time.monotonic()
            log.info("stopping %s", ", ".join(live))
            for proc in live.values():
                proc.send_signal(signal.SIGTERM)
            for name, proc in live.items():
                try:
                    await asyncio.wait_for(proc.wait(), _STOP_TIMEOUT_S)
                except TimeoutError:
                    log.warning("%s ignored SIGTERM for %.0f s: killing it", name, _STOP_TIMEOUT_S)
                    proc.kill()
                    await proc.wait()
            log.info("stopped %s in %.1f s", ", ".join(live), time.monotonic() - started)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m pdserve.supervisor", description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=MODES, default="disaggregated")
    p.add_argument("--model", type=model_arg, default="smollm2")
    p.add_argument("--prefill", type=int, default=1, help="prefill workers (colocated: counted as unified)")
    p.add_argument("--decode", type=int, default=1, help="decode workers (colocated: counted as unified)")
    p.add_argument("--coordinators", type=int, default=1, help="coordinators running at once")
    p.add_argument("--routers", type=int, default=0,
                   help="router services running at once (0: coordinators place in-process)")
    p.add_argument("--port", type=int, default=8000, help="gateway HTTP port")
    p.add_argument("--var-dir", type=Path, default=Path("var"))
    p.add_argument("--kv-store", choices=KV_STORES, default="none",
                   help="mooncake: start a Mooncake Store (unless PDS_KV_STORE_URL names one) for the "
                   "workers")
    return p.parse_args(argv)


def _store_segment_bytes() -> int:
    """The embedded store's memory: `PDS_KV_STORE_SEGMENT_MB` MiB (default 1024: ~1,400 SmolLM2 fp32
    blocks, 720 KiB each)."""
    return int(os.environ.get("PDS_KV_STORE_SEGMENT_MB", "1024")) << 20


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return asyncio.run(Supervisor(args).run())


if __name__ == "__main__":
    sys.exit(main())
