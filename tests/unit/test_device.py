"""The engine's device setting reaches every tensor it allocates: the weights, the KV pool, the rope
tables, and every tensor a forward builds or computes. Checked on torch's `meta` device (tensors with a
shape and no data): a dispatch mode sees every aten op of a real forward and fails on any tensor input
that is not on the device — where a stray CPU tensor on a CUDA worker would fail (or silently copy)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from pdserve.engine.device import engine_dtype
from pdserve.engine.loader import load_model
from pdserve.engine.model import LlamaModel
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.scheduler import ScheduledSeq
from pdserve.engine.sequence import Sequence

META = torch.device("meta")


class OnlyOn(TorchDispatchMode):
    """Records every aten op whose tensor arguments or results are not all on `device`."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device
        self.strays: list[str] = []
        self.num_ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.num_ops += 1
        for t in tree_leaves((args, kwargs, out)):
            if isinstance(t, torch.Tensor) and t.device != self.device:
                self.strays.append(f"{func}: a {t.device} tensor {tuple(t.shape)}")
        return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return load_model("tiny", tmp_path_factory.mktemp("weights"))


def tensors_of(obj, seen=None) -> list[torch.Tensor]:
    """Every tensor reachable from `obj`'s attributes (lists and dicts included)."""
    seen = seen if seen is not None else set()
    if id(obj) in seen:
        return []
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in tensors_of(v, seen)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in tensors_of(v, seen)]
    if hasattr(obj, "__dict__"):
        return [t for v in vars(obj).values() for t in tensors_of(v, seen)]
    return []


def test_every_weight_pool_and_table_lives_on_the_engines_device(tiny):
    model = LlamaModel(tiny.config, tiny.weights, device=META, dtype=torch.bfloat16)
    runner = ModelRunner(model, num_blocks=8, block_size=16)
    found = tensors_of(runner)
    assert len(found) >= 3 + 6 * tiny.config.num_layers + tiny.config.num_layers  # weights, tables, pool
    assert {t.device for t in found} == {META}
    assert {t.dtype for t in found} == {torch.bfloat16}


def test_a_mixed_forward_touches_no_tensor_off_the_engines_device(tiny):
    model = LlamaModel(tiny.config, tiny.weights, device=META, dtype=torch.bfloat16)
    runner = ModelRunner(model, num_blocks=8, block_size=16)
    prefill, decode = Sequence("p", list(range(1, 40))), Sequence("d", list(range(1, 20)))
    prefill.block_table, decode.block_table = [0, 1, 2], [3, 4]
    prefill.num_computed_tokens, decode.num_computed_tokens = 16, 18  # a later chunk, and a decode step
    hooked: list[int] = []
    with OnlyOn(META) as mode:
        logits = runner.execute([ScheduledSeq(decode, 1), ScheduledSeq(prefill, 23)],
                                lambda layer, kv: hooked.append(layer))
    assert mode.num_ops > 20 * tiny.config.num_layers and mode.strays == []
    assert logits.shape == (2, tiny.config.vocab_size) and logits.device == META
    assert hooked == list(range(tiny.config.num_layers))


def test_the_dispatch_check_catches_a_stray_cpu_tensor():
    with OnlyOn(META) as mode:
        torch.bmm(torch.zeros(1, 2, 3, device=META), torch.zeros(1, 3, 4))  # bmm lets this through
    assert mode.strays


def test_dtype_follows_the_device():
    assert engine_dtype(torch.device("cpu")) == torch.float32
    assert engine_dtype(torch.device("cuda")) == torch.bfloat16
