"""deploy/k8s's NATS configuration forms a real 3-node JetStream cluster: the rendered `nats.conf` (its
routes pointed at loopback ports instead of the StatefulSet's DNS names, everything else as applied) and
the generated authorization run three nats-servers; a process connecting as its own user with
PDS_EVENTS_REPLICAS=3 (the overlay's pdserve-env) makes the events stream with 3 replicas, and its events
are still stored after the node it was connected to is killed."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import subprocess

import httpx
import nats
import pytest

from pdserve.bus import Bus
from pdserve.config import CommonSettings
from pdserve.embedded import free_port, nats_server_binary
from tests.unit.test_k8s_manifests import find, render


@pytest.fixture(scope="module")
def manifests(tmp_path_factory):
    return render(tmp_path_factory.mktemp("k8s"), "disaggregated")


@pytest.fixture(scope="module")
def cluster(manifests, tmp_path_factory):
    """Three nodes from the rendered config, as nats-0..2: (client URLs, processes, monitor ports,
    passwords)."""
    tmp = tmp_path_factory.mktemp("k8s-nats")
    conf = find(manifests, "ConfigMap", "nats-config")["data"]["nats.conf"]
    auth = base64.b64decode(find(manifests, "Secret", "nats-auth")["data"]["nats-auth.conf"]).decode()
    env = find(manifests, "Secret", "nats-passwords")["data"]
    passwords = {k: base64.b64decode(v).decode() for k, v in env.items()}
    passwords["admin"] = json.loads(auth.removeprefix("authorization "))["users"][0]["password"]
    clients, routes, monitors = ([free_port() for _ in range(3)] for _ in range(3))
    procs: list[subprocess.Popen] = []
    try:
        for i in range(3):
            node = conf.replace("listen: 0.0.0.0:4222", f"listen: 127.0.0.1:{clients[i]}")
            node = node.replace("store_dir: /data", f"store_dir: {tmp / f'n{i}' / 'data'}")
            node = node.replace("listen: 0.0.0.0:6222", f"listen: 127.0.0.1:{routes[i]}")
            node = node.replace("http: 0.0.0.0:8222", f"http: 127.0.0.1:{monitors[i]}")
            for j in range(3):
                node = node.replace(f"nats://nats-{j}.nats-cluster:6222", f"nats://127.0.0.1:{routes[j]}")
            assert ".nats-cluster:" not in node
            (tmp / f"n{i}" / "auth").mkdir(parents=True)
            (tmp / f"n{i}" / "auth" / "nats-auth.conf").write_text(auth)
            (tmp / f"n{i}" / "nats.conf").write_text(node)
            log = open(tmp / f"n{i}" / "nats.log", "wb")  # noqa: SIM115 (the server's for its life)
            procs.append(subprocess.Popen(  # server_name: $POD_NAME, as the StatefulSet sets it
                [str(nats_server_binary()), "-c", str(tmp / f"n{i}" / "nats.conf")],
                env={**os.environ, "POD_NAME": f"nats-{i}"}, stdin=subprocess.DEVNULL, stdout=log,
                stderr=subprocess.STDOUT))
        yield [f"nats://127.0.0.1:{p}" for p in clients], procs, monitors, passwords
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(10)


async def healthy(monitor_port: int, timeout_s: float = 30.0) -> None:
    """Until the node's /healthz answers 200: JetStream up and current with the meta leader."""
    async with httpx.AsyncClient() as c:
        for _ in range(int(timeout_s / 0.25)):
            try:
                if (await c.get(f"http://127.0.0.1:{monitor_port}/healthz")).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.25)
    raise AssertionError(f"node with monitor :{monitor_port} not healthy in {timeout_s} s")


async def test_the_events_stream_has_three_replicas_and_survives_a_node(cluster):
    urls, procs, monitors, passwords = cluster
    for port in monitors:
        await healthy(port)
    settings = CommonSettings(nats_url=urls[0], nats_user="gateway", nats_password=passwords["gateway"],
                              events_replicas=3)
    bus = None
    for _ in range(40):  # the stream needs a meta leader; a fresh cluster elects one within seconds
        try:
            bus = await Bus.connect(settings, "gateway")
            info = await bus.js.stream_info(settings.events_stream)
            break
        except nats.errors.Error:
            if bus is not None:
                await bus.close()
                bus = None
            await asyncio.sleep(0.5)
    assert bus is not None
    try:
        assert info.config.num_replicas == 3
        assert len(info.cluster.replicas) == 2  # the leader and two followers
        subject = bus.subjects.event("r1", "RequestReceived")

        async def publish_acked(msg_id: str, what: str) -> None:
            # Asked again while the stream's group elects a leader (a new stream's first, or after a
            # loss); the message id makes a retry of one that was stored unacknowledged a no-op.
            for _ in range(40):
                try:
                    await bus.js.publish(subject, b"{}", timeout=2, headers={"Nats-Msg-Id": msg_id})
                    return
                except (nats.errors.Error, TimeoutError):
                    await asyncio.sleep(0.5)
            raise AssertionError(f"no publish acknowledged {what}")

        await publish_acked("m1", "on the fresh cluster")
        procs[0].kill()  # the node the gateway is connected to
        procs[0].wait(10)
        await publish_acked("m2", "after losing one node")
    finally:
        await bus.close()
    admin = await nats.connect(urls[1], user="admin", password=passwords["admin"])
    try:
        info = await admin.jetstream().stream_info(settings.events_stream)
        assert info.state.messages == 2
    finally:
        await admin.close()
