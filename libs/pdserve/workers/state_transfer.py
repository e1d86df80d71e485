"""The handoff of a hybrid model's per-request recurrent state from a prefill to a decode worker, over the
same `KVTransport` as its paged KV (docs/architecture.md §6, data plane; §12, the state handoff).

The state (`engine.state_pool.SequenceState`: name -> [state layers, *shape], e.g. Kimi Linear's
`recurrent` [layers, heads, d_k, d_v] fp32 and `conv` [layers, K - 1, conv_dim]) exists whole only after
the prompt's last prefill chunk, so it cannot be pipelined against the prefill as the paged KV is: it is
sent whole right after. Each tensor name is a transfer of its own, id `<transfer_id>.state.<name>`
(`state_transfer_id`), of one "layer" (the tensor, `[layers, *shape]`) in one chunk per state layer
(chunk i = rows i:i+1, layer i's tensor), each chunk checksummed by the chunked sender as KV chunks are;
its end marker announces `1 × layers` chunks. One transfer per name, so tensors of different dtypes (a
bf16 conv state beside the fp32 recurrent state on CUDA) each land in a buffer of their own dtype.

The decode side (`StateInbound`) expects every tensor's transfer at reservation, into host buffers; the
state counts as received only once every chunk of every tensor is verified, and only then may the worker
`install_state` it (`workers/kv_transfer.py: InboundKV` waits for it beside the KV). A bad checksum
fails the wait with `ChecksumMismatchError` (its `transfer_id` names the tensor, its `chunk` the layer).
"""

from __future__ import annotations

import asyncio

import torch

from pdserve.engine.state_pool import SequenceState, StateLayout
from pdserve.messages import KVEndpoint
from pdserve.transfer.base import Inbound, InboundState, KVTransport, TransferStats

STATE_MARK = ".state."


def state_transfer_id(transfer_id: str, name: str) -> str:
    """The transfer id of state tensor `name` of transfer `transfer_id` (its own single-use id)."""
    return f"{transfer_id}{STATE_MARK}{name}"


def is_state_transfer(transfer_id: str) -> bool:
    """Whether `transfer_id` is one of a state handoff's (`state_transfer_id`)."""
    return STATE_MARK in transfer_id


def state_bytes(state: SequenceState) -> int:
    """Payload bytes of a whole state (every tensor)."""
    return sum(t.numel() * t.element_size() for t in state.values())


async def send_state(transport: KVTransport, endpoint: KVEndpoint, transfer_id: str, state: SequenceState,
                     traceparent: str | None = None) -> int:
    """Send every tensor of `state` (name -> [layers, *shape], any device: staged to host memory here) to
    `endpoint` as `state_transfer_id(transfer_id, name)`: one checksummed chunk per layer, then the end
    marker; all tensors concurrently. Returns the payload bytes delivered. Raises TransferError when the
    peer cannot be reached, ValueError for an empty tensor."""

    async def one(name: str, tensor: torch.Tensor) -> int:
        if tensor.shape[0] == 0:
            raise ValueError(f"state tensor {name!r} has no layers")
        rows = tensor.detach().to("cpu").contiguous()
        tid = state_transfer_id(transfer_id, name)
        sends = [transport.send_layer(endpoint, tid, 0, layer, layer, rows[layer : layer + 1], traceparent)
                 for layer in range(rows.shape[0])]
        *sent, _ = await asyncio.gather(*sends, transport.finish(endpoint, tid, 1, rows.shape[0]))
        return sum(sent)

    return sum(await asyncio.gather(*(one(name, t) for name, t in state.items())))


class StateInbound:
    """The decode side of one state handoff: `layout`'s tensors land in host buffers
    (`buffers[name]`: [layers, *shape], the tensor's dtype or `dtype`). Created on the transport's loop;
    raises ValueError when the transport refuses a transfer id (already expected)."""

    def __init__(self, transport: KVTransport, transfer_id: str, layout: StateLayout, dtype: torch.dtype
                 ) -> None:
        self.buffers: SequenceState = {
            t.name: torch.empty(layout.num_layers, *t.shape, dtype=t.dtype or dtype) for t in layout.tensors
        }
        self.inbounds: dict[str, Inbound] = {}
        try:
            for name, buf in self.buffers.items():
                self.inbounds[name] = transport.expect(state_transfer_id(transfer_id, name), [buf])
        except ValueError:
            self.cancel()
            raise

    async def wait(self, timeout_s: float) -> TransferStats:
        """Until every chunk of every tensor is verified: the state's stats (`kv_bytes`: its payload bytes,
        `num_layers`: its tensors, `seconds`: the slowest tensor's). Raises what `Inbound.wait` raises for
        the first tensor that fails (ChecksumMismatchError, TransferTimeout, TransferCancelled,
        TransferError); then nothing of the state may be used."""
        stats = await asyncio.gather(*(i.wait(timeout_s) for i in self.inbounds.values()))
        return TransferStats(
            transfer_id=stats[0].transfer_id.split(STATE_MARK)[0], kv_bytes=sum(s.kv_bytes for s in stats),
            num_layers=len(stats), num_chunks=max(s.num_chunks for s in stats),
            seconds=max(s.seconds for s in stats),
        )

    def verified(self) -> SequenceState:
        """The received state (name -> [layers, *shape]), once `wait` returned. Raises RuntimeError before."""
        if not all(i.state is InboundState.DONE for i in self.inbounds.values()):
            raise RuntimeError("the state is not verified")
        return self.buffers

    def cancel(self) -> None:
        """Stop expecting every tensor; idempotent. Await `drained()` before reusing the buffers."""
        for inbound in self.inbounds.values():
            inbound.cancel()

    async def drained(self) -> None:
        """Return once no payload is landing in the buffers."""
        await asyncio.gather(*(i.drained() for i in self.inbounds.values()))
