"""Fixtures of the gateway's integration tests (tests/integration/gateway_harness.py), for every module here;
a module that defines a fixture of the same name (`bus`, `engine`, `spans`) uses its own."""

from tests.integration.gateway_harness import (  # noqa: F401
    app,
    bus,
    client,
    coord,
    coordinator,
    db,
    gw_settings,
    server_url,
    spans,
    tokenizer,
)
