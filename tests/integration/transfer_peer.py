"""A KV sender in its own OS process, driven over a multiprocessing pipe (used by test_transport.py).

Commands (tuples): ("send", SendPlan) → replies ("sent", payload bytes); ("stop",) → exits. Errors reply
("error", repr). The KV it sends is `layer_kv(seed, ...)`, so the receiving test can rebuild it exactly.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

import torch

from pdserve.messages import KVEndpoint


@dataclass(frozen=True)
class SendPlan:
    """One transfer to send: `num_layers` × `num_chunks` chunks of `chunk_tokens` rows each.
    `corrupt` names (layer, chunk) pairs to flip a byte in (the sender is a `CorruptingTransport`);
    `finish=False` leaves out the end marker;
    `from_thread` sends through `send_layer_threadsafe` from a worker thread, as a torch forward would;
    `burst` fires every chunk's send without waiting for the previous one (prefill's layer-wise mode)."""

    endpoint: KVEndpoint
    transfer_id: str
    num_layers: int
    num_chunks: int
    chunk_tokens: int
    seed: int
    corrupt: frozenset[tuple[int, int]] = field(default_factory=frozenset)
    finish: bool = True
    from_thread: bool = False
    traceparent: str | None = None
    burst: bool = False  # fire every send at once and the end marker with them, as `OutboundKV` does


def layer_kv(seed: int, layer: int, num_tokens: int, num_kv_heads: int = 2,
             head_dim: int = 8) -> torch.Tensor:
    """Deterministic fp32 KV of one layer: `[num_tokens, 2, num_kv_heads, head_dim]`."""
    g = torch.Generator().manual_seed(seed * 1000 + layer)
    return torch.randn(num_tokens, 2, num_kv_heads, head_dim, generator=g)


async def send_plan(transport, plan: SendPlan) -> int:
    """Send every chunk of `plan` layer by layer, chunk by chunk; returns payload bytes sent."""
    total = plan.num_chunks * plan.chunk_tokens
    kv = [layer_kv(plan.seed, layer, total) for layer in range(plan.num_layers)]
    sent, burst = 0, []
    for chunk in range(plan.num_chunks):
        start = chunk * plan.chunk_tokens
        for layer in range(plan.num_layers):
            data = kv[layer][start : start + plan.chunk_tokens]
            if (layer, chunk) in plan.corrupt:
                transport.corrupt_next += 1
            args = (plan.endpoint, plan.transfer_id, layer, chunk, start, data, plan.traceparent)
            if plan.burst:
                # Started now (corrupt_next is taken by the send it was meant for), awaited below.
                burst.append(asyncio.ensure_future(transport.send_layer(*args)))
                await asyncio.sleep(0)
            elif plan.from_thread:
                sent += await asyncio.to_thread(lambda a=args: transport.send_layer_threadsafe(*a).result())
            else:
                sent += await transport.send_layer(*args)
    finish = (transport.finish(plan.endpoint, plan.transfer_id, plan.num_layers, plan.num_chunks)
              if plan.finish else asyncio.sleep(0))
    *sizes, _ = await asyncio.gather(*burst, finish)
    return sent + sum(sizes)


def run_sender(kind: str, conn: Connection, env: dict[str, str] | None = None) -> None:
    """Process entry point: start a `kind` transport and serve commands from `conn` until ("stop",)."""
    os.environ.update(env or {})
    asyncio.run(_serve(kind, conn))


async def _serve(kind: str, conn: Connection) -> None:
    from pdserve.transfer import make_transport
    from tests.faults.corrupting import CorruptingTransport

    transport = CorruptingTransport(make_transport(kind))
    await transport.start()
    conn.send(("ready", transport.endpoint()))
    try:
        while True:
            cmd = await asyncio.to_thread(conn.recv)
            if cmd[0] == "stop":
                return
            try:
                plans: list[SendPlan] = cmd[1]
                conn.send(("sent", sum([await send_plan(transport, plan) for plan in plans])))
            except Exception as e:
                conn.send(("error", repr(e)))
    finally:
        await transport.stop()
