"""Fixtures of the fault suite: one disaggregated stack (2 prefill, 2 decode workers, tiny model) that
every test breaks one way and leaves whole again, the greedy oracle, and a reader of the event store."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from pdserve.config import CommonSettings
from pdserve.service_plan import ServiceSpec
from pdserve.store.queries import make_db
from tests.e2e.stack import Stack

FAULT_ENV = {"PDS_COMMIT_EVERY_TOKENS": "8"}


@pytest.fixture(scope="session")
def fault_env() -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in FAULT_ENV}
    os.environ.update(FAULT_ENV)
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="session")
def fault_stack(isolated_settings, tmp_path_factory, fault_env) -> Iterator[Stack]:
    """Its own database, stream and subjects: no other test's stack answers or records its traffic."""
    stack = Stack(isolated_settings("faults"), tmp_path_factory.mktemp("fault-stack"), model="tiny",
                  n_prefill=2, n_decode=2)
    try:
        yield stack.start()
    finally:
        stack.stop()


class EnvStack(Stack):
    """A `Stack` whose services start with `env` on top, and service `name` with `service_env[name]` on top
    of that (each service reads only the variables that concern it)."""

    def __init__(self, settings: CommonSettings, var_dir: Path, env: dict[str, str],
                 service_env: dict[str, dict[str, str]] | None = None, **kwargs) -> None:
        super().__init__(settings, var_dir, **kwargs)
        self.extra_env = env
        self.service_env = service_env or {}

    def env(self, spec: ServiceSpec) -> dict[str, str]:
        return {**super().env(spec), **self.extra_env, **self.service_env.get(spec.name, {})}


@pytest.fixture(scope="session")
def smollm2_reference(smollm2):
    """(model, tokenizer) of SmolLM2-135M-Instruct in this process: the greedy oracle of SmolLM2 stacks."""
    from pdserve.engine.model import LlamaModel

    return LlamaModel(smollm2.config, smollm2.weights), smollm2.tokenizer


@asynccontextmanager
async def open_store(settings: CommonSettings) -> AsyncIterator:
    """(event store db, bus) of a stack's settings: what `recorded_lifecycles` reads and asks
    `caught_up`; the bus also serves tests that watch the stack's subjects."""
    from pdserve.bus import Bus

    db = make_db(settings.database_url)
    bus = await Bus.connect(settings, "fault-test")
    try:
        yield db, bus
    finally:
        await bus.close()
        await db.dispose()


@pytest.fixture
async def store(fault_stack) -> AsyncIterator:
    """(event store db, bus) of the fault stack."""
    async with open_store(fault_stack.settings) as s:
        yield s


def spec_of(stack: Stack, name: str):
    return next(s for s in stack.plan if s.name == name)


def restart(stack: Stack, name: str) -> None:
    """Start a killed service again (same name, so a worker keeps its id)."""
    stack.start_service(spec_of(stack, name))
