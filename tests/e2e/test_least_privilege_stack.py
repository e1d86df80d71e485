"""A whole stack (tiny model, disaggregated) on a nats-server that requires `pdserve.nats_auth`'s per-service
users, each process connected as its own (as `pdserve up` runs it), and on its database roles: requests
complete with every lifecycle event recorded, and the server refused nothing — the permissions are what the
services need, not more (the denials themselves: tests/integration/test_least_privilege.py)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from pdserve.embedded import free_port, start_nats
from pdserve.nats_auth import ADMIN, stack_users, write_server_config, write_users
from pdserve.service_plan import service_plan
from tests.e2e.test_prefix_cache import lifecycle, prompt
from tests.faults.conftest import EnvStack

pytestmark = pytest.mark.stack


@pytest.fixture(scope="module")
def secured_stack(isolated_settings, tmp_path_factory) -> Iterator[tuple[EnvStack, object]]:
    tmp = tmp_path_factory.mktemp("secured-stack")
    settings = isolated_settings("lpstack")
    users = stack_users([(s.name, s.role) for s in service_plan("disaggregated")], settings.subject_prefix,
                        settings.events_stream)
    write_server_config(tmp / "auth.conf", users)
    write_users(tmp / "users.json", users)
    server = start_nats(tmp / "js", port=free_port(), config_path=tmp / "auth.conf")
    plan = service_plan("disaggregated")
    stack = EnvStack(settings.model_copy(update={"nats_url": server.url}), tmp / "stack", {},
                     {s.name: {"PDS_NATS_USER": s.name, "PDS_NATS_USERS_FILE": str(tmp / "users.json")}
                      for s in plan}, model="tiny")
    admin = next(u for u in users if u.name == ADMIN)
    stack.nats_credentials = {"user": admin.name, "password": admin.password}
    try:
        yield stack.start(), server
    finally:
        stack.stop()
        server.stop()


def test_requests_complete_with_each_service_on_its_own_least_privileges(secured_stack):
    stack, server = secured_stack
    for stream in (False, True):
        body = {"model": stack.served_model, "prompt": prompt(3), "max_tokens": 6, "temperature": 0,
                "ignore_eos": True, "stream": stream}
        r = httpx.post(f"{stack.url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        events = lifecycle(stack, r.headers["x-request-id"])
        assert {"RequestReceived", "RequestRouted", "DecodeReserved", "PrefillStarted", "PrefillCompleted",
                "TransferCompleted", "DecodeStarted", "RequestCompleted"} <= set(events), sorted(events)
        assert events["RequestCompleted"]["completion_tokens"] == 6
    log = server.log_path.read_text(errors="replace")
    violations = [line for line in log.splitlines() if "Violation" in line]
    assert not violations, json.dumps(violations[:10], indent=1)
