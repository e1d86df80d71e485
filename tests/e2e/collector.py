"""A real OTLP collector for tests: Rotel (PyPI `rotel`, a Rust binary in the wheel) receiving OTLP/HTTP and
storing every span through observability/rotel_file_processor.py as OTLP/JSON lines, which
`pdserve.telemetry.otlp_json` reads back (as `pdserve trace --otlp-file` does)."""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import time
from pathlib import Path

from pdserve.embedded import free_port
from pdserve.telemetry.otlp_json import load_otlp_json
from pdserve.telemetry.spans import SpanRecord

ROOT = Path(__file__).resolve().parents[2]
PROCESSOR = ROOT / "observability" / "rotel_file_processor.py"


def rotel_binary() -> Path | None:
    """The `rotel-agent` the rotel wheel ships inside its package, or None when rotel is not installed."""
    spec = importlib.util.find_spec("rotel")
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / "rotel-agent"
    return path if path.exists() else None


class Rotel:
    """`Rotel(tmp).start()` listens for OTLP/HTTP at `endpoint` and stores spans in `traces_file`."""

    def __init__(self, tmp: Path) -> None:
        binary = rotel_binary()
        if binary is None:
            raise FileNotFoundError("rotel is not installed (a dev dependency: make venv)")
        self.binary = binary
        self.tmp = tmp
        self.http_port, self.grpc_port = free_port(), free_port()
        self.endpoint = f"http://127.0.0.1:{self.http_port}"
        self.traces_file = tmp / "otlp-traces.jsonl"
        self.log_path = tmp / "rotel.log"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 20.0) -> Rotel:
        cmd = [str(self.binary), "start", "--otlp-http-endpoint", f"127.0.0.1:{self.http_port}",
               "--otlp-grpc-endpoint", f"127.0.0.1:{self.grpc_port}", "--exporter", "blackhole",
               "--traces-batch-timeout", "100ms", "--otlp-with-trace-processor", str(PROCESSOR)]
        env = {**os.environ, "PDS_OTLP_TRACES_FILE": str(self.traces_file)}
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"rotel exited {self.proc.returncode}: {self.log_tail()}")
            try:
                socket.create_connection(("127.0.0.1", self.http_port), timeout=0.5).close()
                return self
            except OSError:
                time.sleep(0.1)
        raise TimeoutError(f"rotel did not listen in {timeout_s} s: {self.log_tail()}")

    def spans(self) -> list[SpanRecord]:
        """Every span the collector has stored so far."""
        return load_otlp_json(self.traces_file).spans if self.traces_file.exists() else []

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, lines: int = 30) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
