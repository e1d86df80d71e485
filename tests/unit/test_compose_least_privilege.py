"""docker-compose.yml runs every process on its own least privileges, as `pdserve up` does: its own NATS user
(from the users file the one-shot `nats-users` service generates for exactly these processes, which the
nats service loads) and its own Postgres role; only `migrate` connects as the owner."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from sqlalchemy.engine import make_url

from pdserve.service_plan import ServiceSpec
from tests.unit.test_compose_matches_cli import pdserve_processes

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def mounts(svc: dict[str, Any]) -> dict[str, str]:
    """Container path → volume of a service's mounts."""
    return {v.split(":")[1]: v.split(":")[0] for v in svc.get("volumes", [])}


def test_each_process_has_its_own_nats_user_and_database_role(compose):
    processes = pdserve_processes(compose["services"])
    for name, svc in processes.items():
        env = svc["environment"]
        spec = ServiceSpec(name, svc["command"][2], env["PDS_ROLE"])
        assert env["PDS_NATS_USER"] == name
        assert make_url(env["PDS_DATABASE_URL"]).username == spec.database_role, name
        users_dir = str(Path(env["PDS_NATS_USERS_FILE"]).parent)
        assert mounts(svc)[users_dir] == "nats-auth", name
        assert "PDS_NATS_PASSWORD" not in env  # no secret in the repository
    assert make_url(compose["services"]["migrate"]["environment"]["PDS_DATABASE_URL"]).username == "postgres"


def test_the_generated_users_are_exactly_the_processes_and_nats_requires_them(compose):
    services = compose["services"]
    generator = services["nats-users"]["command"]
    assert generator[:2] == ["pdserve", "nats-users"]
    out = generator[generator.index("--out") + 1]
    named = {arg for arg in generator[4:] if ":" in arg}
    assert named == {f"{n}:{s['environment']['PDS_ROLE']}" for n, s in pdserve_processes(services).items()}
    assert mounts(services["nats-users"])[out] == "nats-auth"
    nats = services["nats"]
    config = Path(nats["command"][nats["command"].index("-c") + 1])
    assert mounts(nats)[str(config.parent)] == "nats-auth" and config.name == "nats-auth.conf"
    assert nats["depends_on"]["nats-users"]["condition"] == "service_completed_successfully"
