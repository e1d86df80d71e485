"""A whole pdserve stack as real processes, for end-to-end and fault tests.

The processes are exactly `service_plan(mode)`'s, started with `python -m <module>` against the test
run's NATS and Postgres, with this run's subject prefix and events stream so runs never mix.
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from pdserve.cli.readiness import heartbeating
from pdserve.config import CommonSettings
from pdserve.embedded import free_port
from pdserve.messages import Subjects
from pdserve.service_plan import ServiceSpec, service_plan


class Stack:
    def __init__(self, settings: CommonSettings, var_dir: Path, model: str = "tiny",
                 mode: str = "disaggregated", n_prefill: int = 1, n_decode: int = 1, n_coordinators: int = 1,
                 n_routers: int = 0) -> None:
        self.settings = settings
        self.var_dir = var_dir
        self.model = model
        self.plan = service_plan(mode, n_prefill, n_decode, n_coordinators, n_routers)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.procs: dict[str, subprocess.Popen] = {}
        self.nats_credentials: dict[str, str] = {}  # user / password, when the server requires them

    def env(self, spec: ServiceSpec) -> dict[str, str]:
        env = dict(os.environ)
        env.update(spec.environment(nats_url=self.settings.nats_url, database_url=self.settings.database_url,
                                    model=self.model, var_dir=self.var_dir, gateway_port=self.port))
        env.update(PDS_SUBJECT_PREFIX=self.settings.subject_prefix,
                   PDS_EVENTS_STREAM=self.settings.events_stream, OTEL_BSP_SCHEDULE_DELAY="200")
        env.pop("OTEL_EXPORTER_OTLP_ENDPOINT", None)
        return env

    def module(self, spec: ServiceSpec) -> str:
        """What `python -m` runs for `spec`: its module (a fault stack swaps in a test entry module)."""
        return spec.module

    def start_service(self, spec: ServiceSpec) -> None:
        log = open(self.var_dir / f"{spec.name}.log", "ab")
        self.procs[spec.name] = subprocess.Popen([sys.executable, "-m", self.module(spec)],
                                                 env=self.env(spec), stdout=log, stderr=subprocess.STDOUT)

    def start(self, timeout_s: float = 180.0) -> Stack:
        self.var_dir.mkdir(parents=True, exist_ok=True)
        for spec in self.plan:
            self.start_service(spec)
        self.wait_ready(timeout_s)
        return self

    def wait_ready(self, timeout_s: float) -> None:
        """Until every worker of the plan heartbeats (as `make up` waits: a completion alone can succeed
        through the router's local-prefill fallback while the prefill worker still loads, and a test then
        sees no transfer) and a one-token completion succeeds."""
        deadline = time.monotonic() + timeout_s
        workers = {spec.name for spec in self.plan if spec.is_worker}
        subjects = Subjects(self.settings.subject_prefix)
        heard: set[str] = set()
        body = {"model": self.served_model, "prompt": "hi", "max_tokens": 1}
        last = ""
        while time.monotonic() < deadline:
            for name, p in self.procs.items():
                if p.poll() is not None:
                    raise RuntimeError(f"{name} exited with {p.returncode}:\n{self.log_tail(name)}")
            if heard < workers:  # asked once all are heard; then only the completion is retried
                # In a thread of its own: `heartbeating` runs its own event loop, and async tests call this
                # with theirs running.
                with concurrent.futures.ThreadPoolExecutor(1) as pool:
                    heard = pool.submit(heartbeating, self.settings.nats_url, subjects, workers,
                                        credentials=self.nats_credentials).result()
                if heard < workers:
                    last = f"no heartbeat yet from {sorted(workers - heard)}"
                    continue
            try:
                r = httpx.post(f"{self.url}/v1/completions", json=body, timeout=30)
                if r.status_code == 200:
                    return
                last = r.text
            except httpx.HTTPError as e:
                last = repr(e)
            time.sleep(0.5)
        raise TimeoutError(f"stack not ready in {timeout_s} s: {last}")

    @property
    def served_model(self) -> str:
        return "SmolLM2-135M-Instruct"

    def log_tail(self, name: str, lines: int = 40) -> str:
        path = self.var_dir / f"{name}.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        self.procs[name].send_signal(sig)
        self.procs[name].wait(10)

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs.values():
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
