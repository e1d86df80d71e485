"""A pdserve stack placed on test hosts: each service of `service_plan` started as `tests/e2e/stack.py`
starts it, but inside the network namespace of the host `placement` names (`ip netns exec`), connected
to every server of the hosts' NATS cluster (`PDS_NATS_URL` comma-separated), with the events stream on 3
replicas, Postgres through the bridge relay, and each worker's KV transport bound to its host's address
(`PDS_KV_HOST`: UCX over TCP between hosts). The gateway listens on its host's address; the test process
is its client across the bridge.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from pdserve.config import CommonSettings
from pdserve.service_plan import ServiceSpec
from tests.e2e.stack import Stack
from tests.hosts.netns import Host, Hosts

# Default placement (must-show 1 of issue 20): the control plane on one host, each pool on its own.
PLACEMENT = {"recorder": "control", "router": "control", "coordinator": "control", "gateway": "control",
             "prefill": "prefill", "decode": "decode"}


class HostStack(Stack):
    """`settings` carry the cluster's URLs and the relayed database URL (`conftest.host_settings`);
    `placement` maps a service name, or a worker's role, to a host name; `env` goes on top of every
    service's environment."""

    def __init__(self, settings: CommonSettings, var_dir: Path, hosts: Hosts,
                 placement: dict[str, str] | None = None, env: dict[str, str] | None = None,
                 **kwargs) -> None:
        super().__init__(settings, var_dir, **kwargs)
        self.hosts = hosts
        self.placement = {**PLACEMENT, **(placement or {})}
        self.extra_env = env or {}
        self.url = f"http://{self.host_of(self.spec('gateway')).address}:{self.port}"

    def spec(self, name: str) -> ServiceSpec:
        return next(s for s in self.plan if s.name == name)

    def host_of(self, spec: ServiceSpec) -> Host:
        return self.hosts[self.placement.get(spec.name) or self.placement[spec.role]]

    def env(self, spec: ServiceSpec) -> dict[str, str]:
        host = self.host_of(spec)
        env = {**super().env(spec), "PDS_EVENTS_REPLICAS": "3", "PDS_KV_HOST": host.address,
               **self.extra_env}
        if spec.role == "gateway":
            # Off loopback the gateway would require API keys; this stack's clients are the tests.
            env.update(PDS_HOST=host.address, PDS_API_KEYS="off")
        return env

    def start_service(self, spec: ServiceSpec) -> None:
        log = open(self.var_dir / f"{spec.name}.log", "ab")
        self.procs[spec.name] = self.host_of(spec).popen(
            [sys.executable, "-m", self.module(spec)], env=self.env(spec), stdout=log,
            stderr=subprocess.STDOUT)
