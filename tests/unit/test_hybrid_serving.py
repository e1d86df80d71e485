"""What the stack side of a hybrid adds around the engine: the compatibility descriptor carries the family
and the cache layout (so a Llama worker and a Kimi Linear worker never pair), `pdserve up --model` takes
kimi-tiny or a model directory, the new event fields default so old rows still parse, and the TTFT
breakdown carves the serial state transfer out of the prefill phase without changing the total."""

from __future__ import annotations

import argparse
import json

import pytest

from pdserve.config import ModelSettings, WorkerSettings
from pdserve.engine.loader import build_model, load_model
from pdserve.events import PrefillCompleted, TransferCompleted, TTFTBreakdown
from pdserve.lifecycle.completion import ttft_breakdown
from pdserve.messages import DecodeAdmitted, DecodeFinished, FinishReason
from pdserve.routing.registry import WorkerRegistry
from pdserve.service_plan import model_arg
from pdserve.workers.heartbeat import compatibility_descriptor


@pytest.fixture(scope="module")
def descriptors(tmp_path_factory):
    settings = WorkerSettings()
    out = {}
    for name in ("tiny", "kimi-tiny"):
        loaded = load_model(name, ModelSettings().weights_cache_dir)
        out[name] = (loaded, compatibility_descriptor(loaded, settings, build_model(loaded)))
    return out


def test_a_llama_descriptor_keeps_its_kv_head_fields(descriptors) -> None:
    loaded, d = descriptors["tiny"]
    cfg = loaded.config
    assert (d.family, d.num_layers, d.num_kv_heads, d.head_dim) == ("llama", cfg.num_layers, cfg.num_kv_heads,
                                                                    cfg.head_dim)
    assert d.paged_row_shape == (2, cfg.num_kv_heads, cfg.head_dim) and d.state_layout == ()


def test_a_hybrid_descriptor_names_its_family_paged_rows_and_state_tensors(descriptors) -> None:
    loaded, d = descriptors["kimi-tiny"]
    cfg = loaded.config
    assert d.family == "kimi_linear" and d.num_layers == cfg.num_mla_layers
    assert d.paged_row_shape == (cfg.kv_lora_rank + cfg.qk_rope_head_dim,)
    heads, dk = cfg.linear_num_heads, cfg.linear_head_dim
    assert d.state_layout == (
        f"recurrent[{cfg.num_kda_layers},{heads},{dk},{dk}]:float32",
        f"conv[{cfg.num_kda_layers},{cfg.linear_conv_kernel_dim - 1},{cfg.conv_dim}]:float32",
    )
    assert not WorkerRegistry.compatible(d, descriptors["tiny"][1])
    # a descriptor of a worker from before these fields parses as what it was: a Llama
    new_fields = {"family", "paged_row_shape", "state_layout"}
    old = json.loads(descriptors["tiny"][1].model_dump_json(exclude=new_fields))
    assert type(d).model_validate(old).family == "llama"


def test_up_takes_a_builtin_name_or_a_model_directory_as_an_absolute_path(tmp_path, monkeypatch) -> None:
    assert model_arg("kimi-tiny") == "kimi-tiny"
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    assert model_arg("m") == str(tmp_path / "m")
    with pytest.raises(argparse.ArgumentTypeError, match="unknown model"):
        model_arg("no-such-model")


def test_new_event_fields_default_for_old_rows() -> None:
    old_transfer = {"transfer_id": "t", "transport": "ucxx", "kv_bytes": 10, "num_layers": 2,
                    "transfer_s": 0.1, "checksum_ok": True}
    assert TransferCompleted.model_validate(old_transfer).state_bytes == 0
    old_prefill = {"prefill_worker_id": "p", "transfer_id": "t", "first_token_id": 1, "num_cached_tokens": 0,
                   "num_computed_tokens": 4, "kv_bytes": 10, "prefill_s": 0.1}
    done = PrefillCompleted.model_validate(old_prefill)
    assert (done.num_checkpoint_tokens, done.state_bytes) == (0, 0)
    phases = ("queue_s", "route_s", "reserve_s", "prefill_s", "exposed_transfer_s", "first_token_s", "ttft_s")
    assert TTFTBreakdown.model_validate(dict.fromkeys(phases, 0.0)).state_transfer_s == 0


def test_the_state_transfer_is_carved_out_of_the_prefill_phase() -> None:
    t = {"route": 100.0, "reserve": 100.01, "prefill": 100.02, "prefilled": 100.5}
    done = DecodeFinished(request_id="r", worker_id="d", finish_reason=FinishReason.LENGTH,
                          num_output_tokens=3, first_token_ts=100.6, last_token_ts=101.0)
    admitted = DecodeAdmitted(request_id="r", worker_id="d", transfer_bytes=1, transfer_s=0.1,
                              transfer_done_ts=100.52, first_token_ts=100.6)
    llama = ttft_breakdown(99.99, done, admitted, t)
    hybrid = ttft_breakdown(99.99, done, admitted, {**t, "state_sent": 100.45})
    assert llama.state_transfer_s == 0 and llama.prefill_s == pytest.approx(0.48)
    assert hybrid.state_transfer_s == pytest.approx(0.05) and hybrid.prefill_s == pytest.approx(0.43)

    def parts(b: TTFTBreakdown) -> float:
        return sum(v for k, v in b.model_dump().items() if k != "ttft_s")

    assert parts(hybrid) == pytest.approx(parts(llama)) == pytest.approx(hybrid.ttft_s)
