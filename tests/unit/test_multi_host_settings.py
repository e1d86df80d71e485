"""The settings a stack spread over hosts is configured by (docs/architecture.md §13): a NATS cluster as
a list of URLs, and the UCX configuration a KV address implies."""

from __future__ import annotations

import socket

import psutil
import pytest

from pdserve.config import CommonSettings
from pdserve.transfer.ucxx_transport import interface_of, ucx_options


def test_nats_url_takes_a_cluster_as_comma_separated_urls():
    s = CommonSettings(nats_url="nats://10.0.0.2:4222, nats://10.0.0.3:4222,nats://10.0.0.4:4222,")
    assert s.nats_servers == ["nats://10.0.0.2:4222", "nats://10.0.0.3:4222", "nats://10.0.0.4:4222"]
    assert CommonSettings(nats_url="nats://127.0.0.1:4222").nats_servers == ["nats://127.0.0.1:4222"]


def test_events_stream_replicas_default_to_one_and_stop_at_five():
    assert CommonSettings().events_replicas == 1
    with pytest.raises(ValueError):
        CommonSettings(events_replicas=7)


def test_loopback_kv_host_keeps_shared_memory(monkeypatch):
    monkeypatch.delenv("UCX_TLS", raising=False)
    assert ucx_options("127.0.0.1") == {"TLS": "sm,self"}


def test_kv_host_off_loopback_is_tcp_on_the_interface_holding_it(monkeypatch):
    for var in ("UCX_TLS", "UCX_NET_DEVICES", "UCX_TCP_RX_SEG_SIZE", "UCX_TCP_TX_SEG_SIZE"):
        monkeypatch.delenv(var, raising=False)
    found = [(name, a.address) for name, addrs in psutil.net_if_addrs().items() for a in addrs
             if a.family == socket.AF_INET and not a.address.startswith("127.")]
    if not found:
        pytest.skip("this machine has no IPv4 address off loopback")
    name, address = found[0]
    assert interface_of(address) == name
    options = ucx_options(address)
    assert options["TLS"] == "tcp,self" and options["NET_DEVICES"] == name
    monkeypatch.setenv("UCX_TLS", "rc,tcp,self")  # where an RDMA device exists
    assert ucx_options(address)["TLS"] == "rc,tcp,self"


def test_a_kv_host_no_interface_holds_is_refused():
    with pytest.raises(ValueError, match="no network interface"):
        interface_of("192.0.2.77")  # TEST-NET-1: assigned to nobody
