"""Exercise A and E from the model configs: Llama-3-70B's published config gives the checklist's 160 KiB per
token, 640,000 KiB (its "640 MB") at 4,000 tokens and its link times against 143 ms of prefill; SmolLM2's
and kimi-tiny's bytes come from the configs the engine serves; the duplication share falls with fleet size."""

from __future__ import annotations

import json

import pytest

from pdserve.advise.economics import CHECKLIST_PREFILL_TOK_S, duplication, economics
from pdserve.advise.models import kimi_linear_spec, llama_3_70b, llama_num_params
from pdserve.cli import main as cli
from pdserve.engine.kimi_linear_config import KDA, MLA, KimiLinearConfig
from pdserve.engine.kimi_tiny import kimi_tiny_config
from pdserve.engine.tokenizer import load_tokenizer
from pdserve.hardware.links import CHECKLIST_LINKS, link
from pdserve.hardware.models import LLAMA_3_70B


def test_llama_3_70b_reproduces_the_checklist_transfer_table():
    spec = llama_3_70b()
    assert spec.kv_bytes_per_token == 80 * 2 * 8 * 128 * 1 == 160 * 1024
    assert spec.kv_bytes(4000) == 655_360_000 == 640_000 * 1024  # the checklist's "640 MB" counts KiB
    e = economics(
        spec,
        [("4000", 4000)],
        [4000 / CHECKLIST_PREFILL_TOK_S],
        CHECKLIST_PREFILL_TOK_S,
        "checklist",
        [link(n) for n in CHECKLIST_LINKS],
    )
    rows = e.prompts[0].rows
    assert round(e.prompts[0].prefill_s * 1e3) == 143
    # exact bytes (655.36 MB): 2.4% above the checklist's, which divides 640 "MB" = 640e6 B
    assert [round(r.transfer_s * 1e3, 1) for r in rows] == [1.8, 13.1, 54.6, 218.5]
    assert [round(link(n).transfer_s(640e6) * 1e3, 1) for n in CHECKLIST_LINKS] == [1.7, 12.8, 53.3, 213.4]
    assert [r.cheaper_than_recompute for r in rows] == [True, True, True, False]  # Ethernet 25G: unusable
    assert rows[0].exposed_layerwise_s == pytest.approx(2e-6 + 655_360_000 / 80 / 370e9)


def test_llama_3_70b_weights_and_their_duplication_against_fleet_size():
    assert llama_num_params(LLAMA_3_70B.config) == 70_553_706_496  # "71 GB" at FP8
    d = duplication(llama_3_70b().weight_bytes, fleets=(2, 8, 16, 32))
    assert [round(r.weight_share, 4) for r in d.rows] == [0.441, 0.1102, 0.0551, 0.0276]
    assert (d.min_accelerators_per_copy, d.fleet_for_threshold) == (1, 18)
    with pytest.raises(ValueError):
        duplication(1, threshold=1.5)


def test_kimi_tiny_moves_latent_kv_and_its_kda_state_apart():
    cfg = kimi_tiny_config(load_tokenizer("kimi-tiny"))
    spec = kimi_linear_spec(
        "kimi-tiny", cfg, num_params=1, kv_dtype="fp32", weight_dtype="fp32", source="test"
    )
    assert spec.kv_bytes_per_token == 2 * (32 + 8) * 4  # 2 MLA layers, kv_lora_rank + rope dim, fp32
    # 4 KDA layers: recurrent 2 heads × 32 × 32, conv (4 − 1) × 3 · 2 · 32, fp32
    assert spec.state_bytes_per_request == 4 * (2 * 32 * 32 + 3 * 192) * 4 == 41_984
    assert spec.transfer_bytes(1000) == 320_000 + 41_984
    e = economics(spec, [("p50", 1000)], [0.1], None, "test", [link("RoCE 100G")])
    row = e.prompts[0].rows[0]
    # layer-wise, the last MLA layer's share and the whole state stay exposed: the state cannot overlap
    assert row.exposed_layerwise_s == pytest.approx(2e-6 + (160_000 + 41_984) / 12e9)


def test_a_config_with_no_kda_layer_moves_no_state():
    cfg = KimiLinearConfig(
        vocab_size=8,
        hidden_size=8,
        intermediate_size=8,
        moe_intermediate_size=8,
        num_hidden_layers=1,
        layer_types=(MLA,),
        mlp_layer_types=("dense",),
        num_attention_heads=1,
        q_lora_rank=None,
        kv_lora_rank=4,
        qk_nope_head_dim=2,
        qk_rope_head_dim=2,
        v_head_dim=2,
        linear_num_heads=1,
        linear_head_dim=2,
        linear_conv_kernel_dim=4,
        num_local_experts=2,
        num_experts_per_tok=1,
        n_shared_experts=0,
        n_group=1,
        topk_group=1,
        norm_topk_prob=True,
        routed_scaling_factor=1.0,
        rms_norm_eps=1e-5,
        max_position_embeddings=16,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=1,
    )
    assert KDA not in cfg.layer_types
    assert kimi_linear_spec("x", cfg, 1, "fp8", "fp8", "t").state_bytes_per_request == 0


def test_the_economics_command_prints_every_link_as_json(capsys):
    assert cli.main(["advise", "economics", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["model"]["name"] == "Llama-3-70B" and out["prompts"][0]["kv_bytes"] == 655_360_000
    assert len(out["prompts"][0]["rows"]) == 13 and out["duplication"]["fleet_for_threshold"] == 18
