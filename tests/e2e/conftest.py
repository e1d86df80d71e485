from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.e2e.stack import Stack


@pytest.fixture(scope="module")
def tiny_stack(isolated_settings, tmp_path_factory) -> Iterator[Stack]:
    """The disaggregated stack (1 prefill, 1 decode) serving the seeded tiny Llama, with its own database,
    stream and subjects."""
    stack = Stack(isolated_settings("tinystack"), tmp_path_factory.mktemp("tiny-stack"), model="tiny")
    try:
        yield stack.start()
    finally:
        stack.stop()
