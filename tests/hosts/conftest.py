"""Fixtures of the multi-host suite (docs/architecture.md §13): three test hosts as network namespaces
(`netns.Hosts`), a 3-server NATS cluster across them (`nats_cluster.NatsCluster`), Postgres relayed onto
the bridge (`relay.py`), and `host_settings(name)`: settings of a stack of its own on them. Every test
here is skipped, with the reason, where network namespaces cannot be made (not root, no iproute2)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from functools import cache

import pytest
from sqlalchemy.engine import make_url

from tests.hosts.nats_cluster import NatsCluster
from tests.hosts.netns import ROOT, Hosts, unavailable

HOST_NAMES = ["control", "prefill", "decode"]


@cache
def _unavailable() -> str:
    return unavailable()


@pytest.fixture(autouse=True)
def _needs_namespaces() -> None:
    if reason := _unavailable():
        pytest.skip(reason)


@pytest.fixture(scope="session")
def hosts() -> Iterator[Hosts]:
    if reason := _unavailable():
        pytest.skip(reason)
    made = Hosts.create(HOST_NAMES)
    try:
        yield made
    finally:
        made.destroy()


@pytest.fixture(scope="session")
def nats_cluster(hosts: Hosts, tmp_path_factory) -> Iterator[NatsCluster]:
    cluster = NatsCluster(list(hosts), tmp_path_factory.mktemp("nats-cluster"), f"pds{hosts.tag}")
    try:
        yield cluster.start()
    finally:
        cluster.stop()


def _target(database_url: str) -> str:
    """Where the relay connects: `host:port`, or the Unix socket of a server that has no TCP port."""
    url = make_url(database_url)
    if socket_dir := url.query.get("host"):
        return f"{socket_dir}/.s.PGSQL.{url.port or 5432}"
    return f"{url.host or '127.0.0.1'}:{url.port or 5432}"


@pytest.fixture(scope="session")
def postgres_relay(hosts: Hosts, postgres_admin_url: str) -> Iterator[tuple[str, int]]:
    """(bridge address, port) where the hosts reach the run's Postgres."""
    proc = subprocess.Popen([sys.executable, "-m", "tests.hosts.relay", hosts.gateway_address,
                             _target(postgres_admin_url)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline().split()
        assert line and line[0] == "listening", "the Postgres relay did not start"
        yield hosts.gateway_address, int(line[1])
    finally:
        proc.terminate()
        proc.wait(10)


def relayed(database_url: str, relay: tuple[str, int]) -> str:
    """`database_url` reached through the relay on the bridge."""
    url = make_url(database_url)
    query = {k: v for k, v in url.query.items() if k != "host"}
    return url.set(host=relay[0], port=relay[1], query=query).render_as_string(hide_password=False)


@pytest.fixture(scope="session")
def host_settings(isolated_settings, nats_cluster: NatsCluster, postgres_relay):
    """`make(name)` → settings of a stack on the hosts: its own database (reached over the bridge), stream
    (3 replicas on the cluster) and subject prefix."""

    def make(name: str):
        s = isolated_settings(name)
        return s.model_copy(update={"nats_url": nats_cluster.url, "events_replicas": 3,
                                    "database_url": relayed(s.database_url, postgres_relay)})

    return make
