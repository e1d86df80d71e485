"""A real Prometheus (Debian's `prometheus` package, `make observability-tools`) for tests, and the PromQL of
the Grafana dashboards that docker-compose.yml provisions (observability/grafana/)."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

from pdserve.embedded import free_port

ROOT = Path(__file__).resolve().parents[2]
GRAFANA = ROOT / "observability" / "grafana"
INSTALL_HINT = "`make observability-tools` installs it (Debian's prometheus package; .ci/run runs it)"


def prometheus_binary() -> str | None:
    return shutil.which("prometheus")


def dashboards_dir() -> Path:
    """The folder of dashboard JSON that docker-compose.yml mounts where the provisioning file points."""
    return GRAFANA / "dashboards"


@dataclass(frozen=True)
class PanelQuery:
    dashboard: str
    panel: str
    ref_id: str
    expr: str


def dashboard_queries(folder: Path | None = None) -> list[PanelQuery]:
    """Every PromQL target of every panel (rows' nested panels too) of every dashboard in `folder`."""
    out = []
    for path in sorted((folder or dashboards_dir()).glob("*.json")):
        dash = json.loads(path.read_text())
        stack = list(dash.get("panels", []))
        while stack:
            panel = stack.pop(0)
            stack.extend(panel.get("panels", []))
            for t in panel.get("targets", []):
                out.append(PanelQuery(dash["title"], panel["title"], t["refId"], t["expr"]))
    return out


def grafana_expr(expr: str, rate_interval: str) -> str:
    """`expr` with Grafana's interval variables replaced as Grafana would for a ~1 s scrape interval."""
    return expr.replace("$__rate_interval", rate_interval).replace("$__interval", "1s")


class Prometheus:
    """`Prometheus(tmp, targets).start()` scrapes `targets` ({job: ["host:port", ...]}) every
    `scrape_interval_s`, storing in `tmp`; `stop()`. `query_range` is the HTTP API's."""

    def __init__(self, tmp: Path, targets: dict[str, list[str]], scrape_interval_s: float = 1.0) -> None:
        binary = prometheus_binary()
        if binary is None:
            raise FileNotFoundError(f"prometheus not on PATH: {INSTALL_HINT}")
        self.binary = binary
        self.tmp = tmp
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        interval = f"{int(scrape_interval_s * 1000)}ms"
        config = {"global": {"scrape_interval": interval, "evaluation_interval": interval},
                  "scrape_configs": [{"job_name": job, "static_configs": [{"targets": ts}]}
                                     for job, ts in targets.items()]}
        (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 30.0) -> Prometheus:
        log = open(self.tmp / "prometheus.log", "ab")
        self.proc = subprocess.Popen(
            [self.binary, f"--config.file={self.tmp / 'prometheus.yml'}",
             f"--storage.tsdb.path={self.tmp / 'data'}", f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited {self.proc.returncode}: {self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/-/ready", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"prometheus not ready in {timeout_s} s: {self.log_tail()}")

    def log_tail(self) -> str:
        path = self.tmp / "prometheus.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-20:]) if path.exists() else ""

    def targets_up(self) -> dict[str, str]:
        """Scrape URL → health ("up", "down", "unknown") of every active target."""
        data = httpx.get(f"{self.url}/api/v1/targets", timeout=10).json()["data"]
        return {t["scrapeUrl"]: t["health"] for t in data["activeTargets"]}

    def query_range(self, expr: str, start: float, end: float, step_s: float = 1.0) -> list[dict[str, Any]]:
        """The matrix `expr` evaluates to over [start, end] (UNIX seconds). Raises on a PromQL error."""
        r = httpx.get(f"{self.url}/api/v1/query_range",
                      params={"query": expr, "start": start, "end": end, "step": step_s}, timeout=30)
        body = r.json()
        if body.get("status") != "success":
            raise ValueError(f"{expr}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]["result"]

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
