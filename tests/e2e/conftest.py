from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.e2e.stack import Stack


@pytest.fixture(scope="session")
def tiny_stack(settings, tmp_path_factory) -> Iterator[Stack]:
    """The disaggregated stack (1 prefill, 1 decode) serving the seeded tiny Llama."""
    stack = Stack(settings, tmp_path_factory.mktemp("tiny-stack"), model="tiny")
    try:
        yield stack.start()
    finally:
        stack.stop()
