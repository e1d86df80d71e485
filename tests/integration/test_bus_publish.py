"""`Bus.publish`: a message published with `now=True` has left the process when the call returns; without,
it waits in nats-py's buffer for the connection's flusher (docs/architecture.md §3, the first token)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from pdserve.bus import Bus
from pdserve.config import CommonSettings
from pdserve.messages import TokenChunk


@pytest.fixture
async def bus(settings: CommonSettings) -> AsyncIterator[Bus]:
    b = await Bus.connect(settings, "test-publish")
    yield b
    await b.close()


async def test_publish_now_has_written_the_message_when_it_returns(bus: Bus) -> None:
    chunk = TokenChunk(request_id="r-now", index=0, token_ids=(7,))
    subject = bus.subjects.tokens(chunk.request_id)
    await bus.publish(subject, chunk)
    assert bus.nc.pending_data_size > 0  # buffered: the flusher writes it once this task yields
    await bus.nc.flush()
    assert bus.nc.pending_data_size == 0
    await bus.publish(subject, chunk, now=True)
    assert bus.nc.pending_data_size == 0

