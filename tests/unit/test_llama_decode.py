"""A pure decode step's layers in one C call (kernels/llama_decode.py) against the forward's kernel-by-kernel
path: the same logits and the same KV pools, to the bit, step after step of a running batch; steps that are
not pure decode keep the kernel-by-kernel path; a bad slot writes nothing."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from pdserve.engine import linear
from pdserve.engine.linear import CALIBRATED_ROWS, SKINNY
from pdserve.engine.llm_engine import EngineConfig, LLMEngine
from pdserve.engine.loader import tiny_config, tiny_weights
from pdserve.engine.model import LlamaModel
from pdserve.engine.sequence import Sequence
from pdserve.kernels import skinny_linear
from pdserve.kernels.paged_attention import attention_metadata
from pdserve.messages import SamplingParams

pytestmark = pytest.mark.skipif(skinny_linear.skinny_kernel() is None, reason="no C compiler here")

VOCAB = SimpleNamespace(vocab_size=512, bos_token_id=1, eos_token_id=2)
# the tiny test model's heads (4 / 2 of 16), and SmolLM2's (9 / 3 of 64) on a narrow residual stream
CONFIGS = {
    "tiny": tiny_config(VOCAB),
    "smollm2_heads": dataclasses.replace(tiny_config(VOCAB), num_layers=3, hidden_size=96,
                                         intermediate_size=160, num_heads=9, num_kv_heads=3, head_dim=64),
}


class Spy:
    """Counts the C calls of a model's `decode_layers`."""

    def __init__(self, model: LlamaModel) -> None:
        assert model.decode_layers is not None
        self.calls, run = 0, model.decode_layers.run

        def counted(*args, **kwargs):
            self.calls += 1
            return run(*args, **kwargs)

        model.decode_layers.run = counted  # type: ignore[method-assign]


def run_engine(model: LlamaModel, steps: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Three sequences (prompts of 5, 17 and 33 tokens, the last arriving after two steps) through prefill
    and `steps` steps in all; returns every step's logits and the KV pools at the end."""
    engine = LLMEngine(model, EngineConfig(num_blocks=32, max_num_batched_tokens=64))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (5, 17, 33)]
    greedy = SamplingParams(max_tokens=steps, ignore_eos=True, temperature=0)
    logits: list[torch.Tensor] = []
    forward = model.forward

    def recorded(*args, **kwargs):
        out = forward(*args, **kwargs)
        logits.append(out.clone())
        return out

    model.forward = recorded  # type: ignore[method-assign]
    for i, prompt in enumerate(prompts[:2]):
        engine.add_request(Sequence(f"s{i}", prompt, greedy))
    for step in range(steps):
        if step == 2:
            engine.add_request(Sequence("late", prompts[2], greedy))
        engine.step()
    return logits, engine.runner.kv_cache


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_one_c_call_computes_what_the_kernel_by_kernel_path_does(name: str, monkeypatch) -> None:
    monkeypatch.setattr(linear, "_PATHS", dict.fromkeys(CALIBRATED_ROWS, SKINNY))
    config = CONFIGS[name]
    weights = tiny_weights(config, seed=7)
    in_c, by_kernel = LlamaModel(config, weights), LlamaModel(config, weights)
    spy = Spy(in_c)
    by_kernel.decode_layers = None
    logits_c, kv_c = run_engine(in_c, steps=12)
    logits_k, kv_k = run_engine(by_kernel, steps=12)
    # prefill steps (and the step that prefills the late prompt beside two decodes) are not pure decode
    assert 0 < spy.calls < len(logits_c) == len(logits_k) == 12
    for a, b in zip(logits_c, logits_k, strict=True):
        assert torch.equal(a, b)
    for a, b in zip(kv_c, kv_k, strict=True):
        assert torch.equal(a, b)


def test_no_c_call_where_the_gemms_take_another_path(monkeypatch) -> None:
    monkeypatch.setattr(linear, "_PATHS", dict.fromkeys(CALIBRATED_ROWS, linear.ONEDNN))
    model = LlamaModel(CONFIGS["tiny"], tiny_weights(CONFIGS["tiny"], seed=7))
    spy = Spy(model)
    run_engine(model, steps=6)
    assert spy.calls == 0


def test_a_slot_outside_the_pools_writes_nothing() -> None:
    config = CONFIGS["smollm2_heads"]
    model = LlamaModel(config, tiny_weights(config, seed=7))
    assert model.decode_layers is not None
    pools = [torch.zeros(4, 16, 2, config.num_kv_heads, config.head_dim) for _ in range(config.num_layers)]
    hidden = torch.randn(2, config.hidden_size)
    before = hidden.clone()
    positions = torch.tensor([3, 5])
    meta = attention_metadata(torch.tensor([[0], [1]]), [4, 6], [1, 1], 16)
    with pytest.raises(IndexError):
        model.decode_layers.run(hidden, model.cos[positions], model.sin[positions], torch.tensor([3, 64]),
                                meta, pools)
    assert torch.equal(hidden, before) and all(not pool.any() for pool in pools)
