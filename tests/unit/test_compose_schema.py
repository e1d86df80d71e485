"""docker-compose.yml is a valid Compose file (no Docker engine here: it is checked against the Compose
specification's JSON schema, the copy the check-jsonschema package vendors from the compose-spec project,
Apache-2.0), and every port it publishes is bound to loopback."""

from __future__ import annotations

import copy
import json
import re
from importlib.resources import files
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
LOOPBACK_PORT = re.compile(r"^127\.0\.0\.1:\d+:\d+(/(tcp|udp))?$")


@pytest.fixture(scope="module")
def validator() -> jsonschema.protocols.Validator:
    vendored = files("check_jsonschema.builtin_schemas.vendor").joinpath("compose-spec.json")
    schema = json.loads(vendored.read_text())
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema)


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def test_docker_compose_yml_follows_the_compose_specification(validator, compose):
    errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(compose)]
    assert not errors, "\n".join(errors)
    broken = copy.deepcopy(compose)
    broken["services"]["gateway"]["ports"] = [{"published": "8000", "bogus": True}]
    assert not validator.is_valid(broken)  # the schema does reject what is not Compose


def test_every_published_port_is_bound_to_loopback(compose):
    published = {name: svc.get("ports", []) for name, svc in compose["services"].items() if svc.get("ports")}
    assert published  # the stack does publish ports
    for name, ports in published.items():
        for port in ports:
            if isinstance(port, dict):
                assert port.get("host_ip") == "127.0.0.1", (name, port)
            else:
                assert LOOPBACK_PORT.match(str(port)), (name, port)
