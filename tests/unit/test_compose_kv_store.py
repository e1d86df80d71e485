"""The shared KV store in both ways of running a stack: compose's kv-store profile starts a Mooncake master
and the store's memory, every worker container points at it, nothing is published beyond loopback; and
`pdserve up --kv-store mooncake` gives exactly the workers the store's variables."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from pdserve.kv_store import master_address
from pdserve.service_plan import service_plan
from tests.unit.test_compose_matches_cli import active, pdserve_processes

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def test_the_kv_store_profile_adds_the_master_and_the_store_and_nothing_else(compose):
    added = set(active(compose, "kv-store")) - set(active(compose, None))
    assert added == {"mooncake-master", "mooncake-store"}
    master, store = (compose["services"][n] for n in sorted(added))
    assert master["command"][0] == "mooncake_master"
    assert "--enable_http_metadata_server=false" in master["command"]
    assert "--metadata_server=P2PHANDSHAKE" in store["command"]
    for name, svc in compose["services"].items():
        for port in svc.get("ports", []):
            assert port.startswith("127.0.0.1:"), (name, port)


def test_every_worker_container_points_at_the_master_under_its_own_name(compose):
    master = compose["services"]["mooncake-master"]["command"]
    rpc_port = next(a.split("=")[1] for a in master if a.startswith("--rpc_port="))
    workers = {n: s for n, s in pdserve_processes(compose["services"]).items()
               if s["environment"]["PDS_ROLE"] in ("prefill", "decode", "unified")}
    assert workers
    for name, svc in workers.items():
        env = svc["environment"]
        assert env["PDS_KV_STORE"] == "${PDS_KV_STORE:-none}"
        assert master_address(env["PDS_KV_STORE_URL"]) == f"mooncake-master:{rpc_port}"
        assert env["PDS_KV_STORE_LOCAL_HOST"] == name


def test_pdserve_up_with_a_store_gives_its_url_to_the_workers_only():
    env_of = {spec.name: spec.environment(nats_url="nats://x", database_url="postgresql+asyncpg://x",
                                          model="m", var_dir=Path("/v"), gateway_port=8000,
                                          kv_store_url="mooncake://127.0.0.1:5") for spec in service_plan(
        "disaggregated", 2, 1)}
    for name, env in env_of.items():
        if name.startswith(("prefill", "decode")):
            assert env["PDS_KV_STORE"] == "mooncake" and env["PDS_KV_STORE_URL"] == "mooncake://127.0.0.1:5"
        else:
            assert "PDS_KV_STORE" not in env


def test_make_up_passes_kv_store_to_both_ways_of_starting():
    makefile = (ROOT / "Makefile").read_text()
    assert "--kv-store $(KV_STORE)" in makefile and "COMPOSE_KV_mooncake := --profile kv-store" in makefile
    assert "make kv-store-tools" in (ROOT / ".ci" / "run").read_text()
