"""docker-compose.yml runs the same processes, with the same PDS_* variables, as `pdserve up`.

No Docker engine here, so the compose file is read as YAML (merge keys resolved by PyYAML) and compared
with `pdserve.service_plan`, the list the supervisor starts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from pdserve.service_plan import ServiceSpec, service_plan

ROOT = Path(__file__).resolve().parents[2]
WORKER_ROLES = {"prefill", "decode"}


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def active(compose: dict[str, Any], profile: str | None) -> dict[str, dict[str, Any]]:
    """Services `docker compose [--profile P] up` starts: those without profiles plus those in P."""
    return {
        name: svc
        for name, svc in compose["services"].items()
        if not svc.get("profiles") or (profile is not None and profile in svc["profiles"])
    }


def pdserve_processes(services: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The services whose command is `python -m pdserve.services.<name>`."""
    return {
        name: svc
        for name, svc in services.items()
        if svc.get("command", [])[:2] == ["python", "-m"]
        and svc["command"][2].startswith("pdserve.services.")
    }


def described(spec: ServiceSpec) -> tuple[str, str, str]:
    return spec.name, spec.module, spec.role


def in_compose(name: str, svc: dict[str, Any]) -> tuple[str, str, str]:
    return name, svc["command"][2], svc["environment"]["PDS_ROLE"]


def assert_same_environment(spec: ServiceSpec, env: dict[str, str]) -> None:
    expected = spec.environment(
        nats_url="nats://x", database_url="postgresql+asyncpg://x", model="m", var_dir=Path("/v"),
        gateway_port=8000,
    )
    missing = set(expected) - set(env)
    assert not missing, f"{spec.name}: compose lacks {sorted(missing)}"
    for key in ("PDS_WORKER_ID", "PDS_ROLE", "PDS_PORT"):
        if key in expected:
            assert str(env[key]) == expected[key], f"{spec.name}: {key}"


def test_default_compose_stack_is_the_disaggregated_plan(compose: dict[str, Any]) -> None:
    services = pdserve_processes(active(compose, None))
    plan = service_plan("disaggregated", 1, 1)
    assert sorted(in_compose(n, s) for n, s in services.items()) == sorted(map(described, plan))
    for spec in plan:
        assert_same_environment(spec, services[spec.name]["environment"])


def test_colocated_profile_without_prefill_and_decode_is_the_colocated_plan(compose: dict[str, Any]) -> None:
    services = {
        name: svc
        for name, svc in pdserve_processes(active(compose, "colocated")).items()
        if svc["environment"]["PDS_ROLE"] not in WORKER_ROLES  # `--scale prefill-0=0 --scale decode-0=0`
    }
    plan = service_plan("colocated", 1, 1)
    assert sorted(in_compose(n, s) for n, s in services.items()) == sorted(map(described, plan))
    for spec in plan:
        assert_same_environment(spec, services[spec.name]["environment"])


def test_make_up_colocated_scales_away_exactly_the_disaggregated_workers(compose: dict[str, Any]) -> None:
    workers = [
        name
        for name, svc in pdserve_processes(active(compose, None)).items()
        if svc["environment"]["PDS_ROLE"] in WORKER_ROLES
    ]
    makefile = (ROOT / "Makefile").read_text()
    for name in workers:
        assert f"--scale {name}=0" in makefile


def test_every_pdserve_container_waits_for_migrations_and_reaches_nats(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert services["migrate"]["command"] == ["pdserve", "migrate"]
    assert "-js" in services["nats"]["command"]
    for name, svc in pdserve_processes(services).items():
        assert svc["depends_on"]["migrate"]["condition"] == "service_completed_successfully", name
        assert svc["environment"]["PDS_NATS_URL"] == "nats://nats:4222", name


def test_gateway_publishes_its_port_and_listens_beyond_localhost(compose: dict[str, Any]) -> None:
    gateway = compose["services"]["gateway"]
    assert "127.0.0.1:8000:8000" in gateway["ports"]
    assert gateway["environment"]["PDS_HOST"] == "0.0.0.0"


def test_prometheus_scrapes_every_pdserve_container(compose: dict[str, Any]) -> None:
    scrape = yaml.safe_load((ROOT / "observability" / "prometheus.yml").read_text())
    job = next(j for j in scrape["scrape_configs"] if j["job_name"] == "pdserve")
    targets = {t for group in job["static_configs"] for t in group["targets"]}
    port = compose["x-pdserve-env"]["PDS_METRICS_PORT"]
    processes = pdserve_processes(compose["services"])
    # The gateway serves /metrics on its HTTP port (the app route); the others on PDS_METRICS_PORT.
    expected = {f"{name}:{svc['environment']['PDS_PORT'] if name == 'gateway' else port}"
                for name, svc in processes.items()}
    assert targets == expected
