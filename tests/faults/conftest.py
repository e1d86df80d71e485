"""Fixtures of the fault suite: one disaggregated stack (2 prefill, 2 decode workers, tiny model) that
every test breaks one way and leaves whole again, the greedy oracle, and a reader of the event store."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator

import pytest

from pdserve.store.queries import make_engine
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


@pytest.fixture(scope="session")
def reference(settings):
    """(model, tokenizer) of the tiny Llama in this process: the greedy oracle."""
    from pdserve.engine.loader import load_model
    from pdserve.engine.model import LlamaModel

    loaded = load_model("tiny", settings.var_dir / "weights")
    return LlamaModel(loaded.config, loaded.weights), loaded.tokenizer


@pytest.fixture
async def store(fault_stack) -> AsyncIterator:
    """(event store engine, bus): what `recorded_lifecycles` reads and asks `caught_up`."""
    from pdserve.bus import Bus

    engine = make_engine(fault_stack.settings.database_url)
    bus = await Bus.connect(fault_stack.settings, "fault-test")
    yield engine, bus
    await bus.close()
    await engine.dispose()


def spec_of(stack: Stack, name: str):
    return next(s for s in stack.plan if s.name == name)


def restart(stack: Stack, name: str) -> None:
    """Start a killed service again (same name, so a worker keeps its id)."""
    stack.start_service(spec_of(stack, name))
