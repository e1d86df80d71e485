"""`pdserve up | down | status | logs | migrate`: run the whole stack on this machine
(docs/architecture.md §9).

`up` starts `python -m pdserve.supervisor` detached (its own session, so it outlives the shell) and returns
once the gateway's GET /health answers 200 and every worker heartbeats (so the first request is placed at
once, not after the workers finish loading the model); the supervisor records the stack in
var/run/stack.json, which the other commands read.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
from rich.table import Table

from pdserve.cli.output import make_console
from pdserve.cli.readiness import heartbeating
from pdserve.config import CommonSettings
from pdserve.embedded import port_is_free
from pdserve.messages import Subjects
from pdserve.process import is_alive, stop_process
from pdserve.service_plan import KV_STORES, MODELS, MODES, model_arg
from pdserve.stack_state import StackState, read_state, remove_state

console = make_console(soft_wrap=True)  # long URLs and paths stay on one line
_TAIL_LINES = 25
WORKER_ROLES = ("prefill", "decode", "unified")


def _var_dir(args: argparse.Namespace) -> Path:
    return Path(args.var_dir or os.environ.get("PDS_VAR_DIR") or "var").resolve()


def _tail(path: Path, lines: int = _TAIL_LINES) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) or "(empty)"
    except OSError:
        return "(no log yet)"


def gateway_healthy(gateway_url: str, timeout_s: float = 1.0) -> bool:
    """True when GET <gateway_url>/health answers 200 within `timeout_s` seconds."""
    try:
        return httpx.get(f"{gateway_url}/health", timeout=timeout_s).status_code == 200
    except httpx.HTTPError:
        return False


def cli_command() -> str:
    """How the user runs this CLI again from where they are, for the hints it prints: `pdserve` when that
    is on PATH, else the path it was started by, relative to the working directory when inside it (`make
    up` runs `.venv/bin/pdserve`, which nothing puts on PATH unless the virtualenv is activated)."""
    prog = Path(sys.argv[0])
    if shutil.which("pdserve") or prog.name != "pdserve":
        return "pdserve"
    try:
        return str(prog.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(prog)


def _failing_services(state: StackState) -> list[str]:
    """The processes to blame when the gateway never became healthy: the ones that died or restarted,
    else the gateway itself."""
    bad = [n for n, s in state.services.items() if s.restarts or s.status != "running" or not is_alive(s.ref)]
    return bad or (["gateway"] if "gateway" in state.services else [])


def up(args: argparse.Namespace) -> int:
    var_dir = _var_dir(args)
    if (state := read_state(var_dir)) is not None:
        if is_alive(state.supervisor):
            console.print(
                f"pdserve is already running (supervisor pid {state.supervisor_pid}), "
                f"gateway {state.gateway_url}. `{cli_command()} down` stops it."
            )
            return 0
        remove_state(var_dir)  # left by a supervisor that was killed
    if not port_is_free(args.port):
        console.print(
            f"[red]port {args.port} is in use[/]: pass --port (make up PORT=...) or stop what uses it."
        )
        return 1
    (var_dir / "log").mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "pdserve.supervisor",
        "--mode",
        args.mode,
        "--model",
        args.model,
        "--prefill",
        str(args.prefill),
        "--decode",
        str(args.decode),
        "--coordinators",
        str(args.coordinators),
        "--routers",
        str(args.routers),
        "--port",
        str(args.port),
        "--var-dir",
        str(var_dir),
        "--kv-store",
        args.kv_store,
    ]
    supervisor_log = var_dir / "log" / "supervisor.log"
    with open(supervisor_log, "ab") as out:
        proc = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    return _wait_until_serving(proc, var_dir, supervisor_log, args.timeout)


def _wait_until_serving(proc: subprocess.Popen, var_dir: Path, supervisor_log: Path, timeout_s: float) -> int:
    started = time.monotonic()
    state: StackState | None = None
    with console.status("starting pdserve…") as spinner:
        while time.monotonic() - started < timeout_s:
            state = read_state(var_dir) or state
            if proc.poll() is not None:
                error = state.error if state else ""
                console.print(
                    f"[red]the supervisor exited ({proc.returncode})[/] {error}\n"
                    f"{supervisor_log}:\n{_tail(supervisor_log)}"
                )
                remove_state(var_dir)
                return 1
            if state is not None:
                alive = sum(is_alive(s.ref) for s in state.services.values())
                detail = f"{alive}/{len(state.services)} processes up" if state.services else ""
                spinner.update(f"{state.phase} {detail} ({time.monotonic() - started:.0f} s)")
                if state.phase == "running" and gateway_healthy(state.gateway_url):
                    workers = {n for n, s in state.services.items() if s.role in WORKER_ROLES}
                    spinner.update(f"waiting for {len(workers)} workers' heartbeats "
                                   f"({time.monotonic() - started:.0f} s)")
                    subjects = Subjects(CommonSettings().subject_prefix)
                    credentials = state.nats_admin_credentials()
                    if heartbeating(state.nats_url, subjects, workers, credentials=credentials) >= workers:
                        break
            time.sleep(0.5)
        else:
            _report_timeout(state, var_dir, supervisor_log, timeout_s)
            return 1
    assert state is not None
    for note in state.notes:
        console.print(f"[yellow]note:[/] {note}")
    for name, svc in state.services.items():
        if svc.restarts:
            console.print(f"[yellow]warning:[/] {name} was restarted {svc.restarts}× "
                          f"(`{cli_command()} logs {name}`)")
    console.print(
        f"[green]pdserve is up[/] ({state.mode}, model {state.model}, {len(state.services)} processes) "
        f"in {time.monotonic() - started:.0f} s"
    )
    console.print(f"  gateway   {state.gateway_url}  (OpenAI API: {state.gateway_url}/v1)")
    console.print(f"  nats      {state.nats_url}\n  database  {state.database_url}")
    cli = cli_command()
    console.print(f"  logs      {var_dir / 'log'}   "
                  f"(`{cli} status`, `{cli} logs \\[service] -f`, `{cli} down`)")
    return 0


def _report_timeout(state: StackState | None, var_dir: Path, supervisor_log: Path, timeout_s: float) -> None:
    phase = state.phase if state else "launching the supervisor"
    console.print(f"[red]pdserve did not become healthy within {timeout_s:.0f} s[/] (stuck at: {phase}).")
    blamed = _failing_services(state) if state and state.phase == "running" else []
    for name in blamed[:3]:
        svc = state.services[name]  # type: ignore[union-attr]
        console.print(f"\n[bold]{name}[/] (restarts {svc.restarts}, last exit {svc.last_exit}) {svc.log}:")
        console.print(_tail(Path(svc.log)), markup=False)
    if not blamed:
        console.print(f"\n{supervisor_log}:")
        console.print(_tail(supervisor_log), markup=False)
    cli = cli_command()
    console.print(f"\nThe stack is left running for inspection: `{cli} status`, `{cli} logs <service>`, "
                  f"`{cli} down`.")


def down(args: argparse.Namespace) -> int:
    var_dir = _var_dir(args)
    state = read_state(var_dir)
    if state is None:
        console.print("pdserve is not running (no var/run/stack.json).")
        return 0
    was_running = is_alive(state.supervisor)
    clean = stop_process(state.supervisor, timeout_s=args.timeout)
    # After a clean stop these are all gone; after a SIGKILL of the supervisor, stop what it left.
    leftovers = [s.ref for s in state.services.values() if is_alive(s.ref)]
    for ref in leftovers:
        stop_process(ref, timeout_s=5.0)
    if (nats := state.servers.get("nats")) is not None:
        stop_process(nats.ref, timeout_s=5.0)
    if (pg := state.servers.get("postgres")) is not None:
        stop_process(pg.ref, timeout_s=10.0, sig=signal.SIGINT)  # SIGINT = Postgres "fast" shutdown
    remove_state(var_dir)
    if not was_running:
        how = "was not running (its supervisor had died); cleaned up what it left"
    elif clean:
        how = "stopped"
    else:
        how = f"killed after {args.timeout:.0f} s (see var/log/supervisor.log)"
    console.print(f"pdserve {how}; {len(state.services)} processes, supervisor pid {state.supervisor_pid}.")
    return 0


def status(args: argparse.Namespace) -> int:
    var_dir = _var_dir(args)
    state = read_state(var_dir)
    if state is None:
        console.print("pdserve is not running (no var/run/stack.json).")
        return 1
    healthy = gateway_healthy(state.gateway_url)
    console.print(
        f"mode {state.mode}, model {state.model}, phase {state.phase}"
        + (f" [red]{state.error}[/]" if state.error else "")
    )
    console.print(
        f"gateway   {state.gateway_url}  " + ("[green]healthy[/]" if healthy else "[red]not answering[/]")
    )
    console.print(f"nats      {state.nats_url}\ndatabase  {state.database_url}")
    for note in state.notes:
        console.print(f"[yellow]note:[/] {note}")
    table = Table("process", "role", "pid", "alive", "status", "restarts", "log")
    mark = {True: "[green]yes[/]", False: "[red]no[/]"}
    table.add_row(
        "supervisor",
        "",
        str(state.supervisor_pid),
        mark[is_alive(state.supervisor)],
        state.phase,
        "",
        str(var_dir / "log" / "supervisor.log"),
    )
    for name, srv in state.servers.items():
        table.add_row(name, "embedded", str(srv.pid), mark[is_alive(srv.ref)], "", "", srv.log)
    for name, svc in state.services.items():
        table.add_row(
            name,
            svc.role,
            str(svc.pid or ""),
            mark[is_alive(svc.ref)],
            svc.status,
            str(svc.restarts),
            svc.log,
        )
    console.print(table)
    return 0 if is_alive(state.supervisor) else 1


def _log_files(var_dir: Path, state: StackState | None) -> dict[str, Path]:
    files = {p.stem: p for p in sorted((var_dir / "log").glob("*.log"))}
    if (pg_log := var_dir / "pg" / "log").exists():  # pgserver writes the server log into its data dir
        files["postgres"] = pg_log
    if state is not None:
        files.update({n: Path(s.log) for n, s in state.servers.items()})
        files.update({n: Path(s.log) for n, s in state.services.items()})
    return files


def logs(args: argparse.Namespace) -> int:
    var_dir = _var_dir(args)
    files = _log_files(var_dir, read_state(var_dir))
    if args.service:
        if args.service not in files:
            known = ", ".join(sorted(files)) or "none"
            console.print(f"no log for {args.service!r}; known: {known}", markup=False)  # a name is no markup
            return 1
        paths = [files[args.service]]
    else:
        paths = list(files.values())
    if not paths:
        console.print(f"no logs under {var_dir / 'log'}")
        return 1
    # tail is on every POSIX machine and follows rotation with -F; no need to reimplement it.
    cmd = ["tail", "-n", str(args.lines), *(["-F"] if args.follow else []), *map(str, paths)]
    try:
        return subprocess.call(cmd)
    except KeyboardInterrupt:
        return 0


def migrate(args: argparse.Namespace) -> int:
    """`pdserve migrate`: create and migrate the database (as its owner). With `--wait`, change nothing:
    wait until another process (compose's or Kubernetes' one-shot `migrate`) has brought it to head, as
    any service role may read; exit 1 if that has not happened within `--timeout` seconds."""
    from pdserve.config import CommonSettings
    from pdserve.supervisor import prepare_database

    url = args.database_url or CommonSettings().database_url
    if args.wait:
        return _wait_for_migrations(url, args.timeout)
    prepare_database(url)
    console.print(f"database ready at head: {url}")
    return 0


def _wait_for_migrations(url: str, timeout_s: float) -> int:
    from sqlalchemy.exc import DBAPIError

    from pdserve.store.migrate import current_revision, head_revision

    head = head_revision()
    deadline = time.monotonic() + timeout_s
    seen: str | None = "unreachable"
    while True:
        try:
            seen = current_revision(url)
        except (DBAPIError, OSError) as e:  # not up yet, or the role not made yet (migration 0004)
            seen = f"unreachable ({type(e).__name__})"
        if seen == head:
            console.print(f"database at head {head}: {url}")
            return 0
        if time.monotonic() >= deadline:
            console.print(f"[red]database not at head {head} after {timeout_s:.0f} s (at {seen}): "
                          f"{url}[/red]")
            return 1
        time.sleep(1.0)


def add_parsers(sub: argparse._SubParsersAction) -> None:
    """Register up, down, status, logs and migrate on the `pdserve` command line."""

    def common(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
        p.add_argument("--var-dir", help="state, logs and embedded data (default $PDS_VAR_DIR or ./var)")
        return p

    p = common(sub.add_parser("up", help="start the whole stack in the background"))
    p.add_argument(
        "--mode",
        choices=MODES,
        default="disaggregated",
        help="disaggregated: prefill + decode pools; colocated: unified workers (as many processes)",
    )
    p.add_argument("--model", type=model_arg, default="smollm2", metavar="MODEL",
                   help=f"{', '.join(MODELS)} (tiny, kimi-tiny: seeded random Llama / Kimi Linear hybrid for "
                   "tests) or a local HF-layout model directory of either family")
    p.add_argument("--prefill", type=int, default=1, help="prefill workers (default 1)")
    p.add_argument("--decode", type=int, default=1, help="decode workers (default 1)")
    p.add_argument("--coordinators", type=int, default=1,
                   help="coordinators at once (default 1; 2+: a request's owner dying is taken over)")
    p.add_argument("--routers", type=int, default=0,
                   help="router services at once (default 0: each coordinator places its requests "
                   "in-process; 1+: placement is the routers' service, asked over NATS, and they share "
                   "bookings)")
    p.add_argument("--port", type=int, default=8000, help="gateway HTTP port (default 8000)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for /health (default 300)")
    p.add_argument("--kv-store", choices=KV_STORES, default="none",
                   help="mooncake: a Mooncake Store shared by the workers' KV caches (embedded on loopback "
                   "unless PDS_KV_STORE_URL names one; PDS_KV_STORE_SEGMENT_MB its memory, default 1024)")
    p.set_defaults(func=up)

    p = common(sub.add_parser("down", help="stop the stack started by `pdserve up`"))
    p.add_argument("--timeout", type=float, default=60.0, help="seconds before SIGKILL (default 60)")
    p.set_defaults(func=down)

    common(sub.add_parser("status", help="what runs where")).set_defaults(func=status)

    p = common(sub.add_parser("logs", help="tail var/log (one service or all)"))
    p.add_argument("service", nargs="?",
                   help="gateway, router, prefill-0, …, nats, postgres, mooncake, supervisor")
    p.add_argument("-f", "--follow", action="store_true")
    p.add_argument("-n", "--lines", type=int, default=50)
    p.set_defaults(func=logs)

    p = sub.add_parser("migrate", help="create the event-store database if absent and migrate it to head")
    p.add_argument("--database-url", help="SQLAlchemy asyncpg URL (default $PDS_DATABASE_URL)")
    p.add_argument("--wait", action="store_true",
                   help="change nothing: wait until the database is at head (a pod's init container)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds --wait waits (default 600)")
    p.set_defaults(func=migrate)
