"""Kimi Linear's architecture hyper-parameters, read from (and written as) a checkpoint's config.json.

Field meanings are HF `KimiLinearConfig`'s (transformers/models/kimi_linear/configuration_kimi_linear.py)
and the Kimi Linear release's; config.json spells some of them two ways, both read here: HF's
`save_pretrained` writes its attribute-map aliases (`model_max_length`, `num_experts`,
`num_experts_per_token`, `num_expert_group`, `num_shared_experts`, `moe_renormalize`), the original release
writes the field names and keeps the linear-attention settings in a `linear_attn_config` sub-dict
(1-based `kda_layers` / `full_attn_layers`, `head_dim`, `num_heads`, `short_conv_kernel_size`) with
`first_k_dense_replace` for the dense MLP layers. `to_hf_dict` writes what `save_pretrained` writes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

KDA = "linear_attention"  # a Kimi Delta Attention layer (recurrent state; kernels/gated_delta_rule.py)
MLA = "full_attention"  # a multi-head latent attention layer (paged latent KV; kernels/mla.py)
DENSE, SPARSE = "dense", "sparse"  # the layer's MLP: one SwiGLU, or the MoE

# config.json key -> field, for the keys HF's save_pretrained writes under another name
_ALIASES = {
    "model_max_length": "max_position_embeddings",
    "num_experts": "num_local_experts",
    "num_experts_per_token": "num_experts_per_tok",
    "num_expert_group": "n_group",
    "num_shared_experts": "n_shared_experts",
    "moe_renormalize": "norm_topk_prob",
}


@dataclass(frozen=True)
class KimiLinearConfig:
    """Kimi Linear hyper-parameters (HF names; sizes in elements/tokens). `layer_types[i]` is `KDA` or `MLA`,
    `mlp_layer_types[i]` `DENSE` or `SPARSE`. MLA heads all have their own K/V (num_key_value_heads ==
    num_attention_heads, as kv_b_proj expands the latent per head); `q_lora_rank` None = a plain q_proj."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]
    mlp_layer_types: tuple[str, ...]
    # MLA
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    # KDA
    linear_num_heads: int
    linear_head_dim: int
    linear_conv_kernel_dim: int
    # MoE
    num_local_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    # the rest
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    bos_token_id: int
    eos_token_id: int
    model_type: str = "kimi_linear"

    def __post_init__(self) -> None:
        n = self.num_hidden_layers
        if len(self.layer_types) != n or set(self.layer_types) - {KDA, MLA}:
            raise ValueError(f"layer_types must be {n} of {KDA!r}/{MLA!r}: {self.layer_types}")
        if len(self.mlp_layer_types) != n or set(self.mlp_layer_types) - {DENSE, SPARSE}:
            raise ValueError(f"mlp_layer_types must be {n} of {DENSE!r}/{SPARSE!r}: {self.mlp_layer_types}")
        if self.num_local_experts % self.n_group:
            raise ValueError(f"{self.num_local_experts} experts do not split into {self.n_group} groups")

    @property
    def num_kda_layers(self) -> int:
        return self.layer_types.count(KDA)

    @property
    def num_mla_layers(self) -> int:
        return self.layer_types.count(MLA)

    @property
    def latent_dim(self) -> int:
        """One token's cached row in one MLA layer: kv_lora_rank + qk_rope_head_dim."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of a KDA layer's short convolution: q, k and v side by side, 3 * heads * head_dim."""
        return 3 * self.linear_num_heads * self.linear_head_dim

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of one token's latent KV over all MLA layers, fp32: num_mla_layers * latent_dim * 4."""
        return self.num_mla_layers * self.latent_dim * 4

    @property
    def state_bytes(self) -> int:
        """Bytes of one sequence's KDA state over all KDA layers, fp32: per layer the recurrent state
        (heads * d_k * d_v) and the conv state ((K - 1) * conv_dim)."""
        heads, d = self.linear_num_heads, self.linear_head_dim
        per_layer = heads * d * d + (self.linear_conv_kernel_dim - 1) * self.conv_dim
        return self.num_kda_layers * per_layer * 4

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> KimiLinearConfig:
        """From a config.json in either spelling (see the module doc). Raises ValueError for another
        model_type, an activation other than silu, or grouped MLA K/V heads; KeyError for a missing key."""
        if raw.get("model_type") != "kimi_linear":
            raise ValueError(f"model_type {raw.get('model_type')!r} is not kimi_linear")
        d = {_ALIASES.get(key, key): value for key, value in raw.items()}
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {d['hidden_act']!r}: only silu is supported")
        heads = int(d["num_attention_heads"])
        if int(d.get("num_key_value_heads") or heads) != heads:
            raise ValueError("MLA with num_key_value_heads != num_attention_heads is not supported")
        n = int(d["num_hidden_layers"])
        linear = d.get("linear_attn_config") or {}
        layer_types = d.get("layer_types")
        if layer_types is None and "kda_layers" in linear:
            kinds = {i - 1: KDA for i in linear["kda_layers"]}
            kinds |= {i - 1: MLA for i in linear["full_attn_layers"]}
            layer_types = [kinds[i] for i in range(n)]
        if layer_types is None:  # HF's default: every 4th layer (but the first) full attention
            layer_types = [MLA if i and i % 4 == 0 else KDA for i in range(n)]
        mlp_types = d.get("mlp_layer_types")
        if mlp_types is None:
            first_dense = int(d.get("first_k_dense_replace", 1))
            mlp_types = [DENSE if i < first_dense else SPARSE for i in range(n)]
        eos = d["eos_token_id"]
        return cls(
            vocab_size=int(d["vocab_size"]),
            hidden_size=int(d["hidden_size"]),
            intermediate_size=int(d["intermediate_size"]),
            moe_intermediate_size=int(d["moe_intermediate_size"]),
            num_hidden_layers=n,
            layer_types=tuple(layer_types),
            mlp_layer_types=tuple(mlp_types),
            num_attention_heads=heads,
            q_lora_rank=None if d.get("q_lora_rank") is None else int(d["q_lora_rank"]),
            kv_lora_rank=int(d["kv_lora_rank"]),
            qk_nope_head_dim=int(d["qk_nope_head_dim"]),
            qk_rope_head_dim=int(d["qk_rope_head_dim"]),
            v_head_dim=int(d["v_head_dim"]),
            linear_num_heads=int(linear.get("num_heads", d.get("linear_num_heads", 32))),
            linear_head_dim=int(linear.get("head_dim", d.get("linear_head_dim", 128))),
            linear_conv_kernel_dim=int(
                linear.get("short_conv_kernel_size", d.get("linear_conv_kernel_dim", 4))
            ),
            num_local_experts=int(d["num_local_experts"]),
            num_experts_per_tok=int(d["num_experts_per_tok"]),
            n_shared_experts=int(d.get("n_shared_experts", 1)),
            n_group=int(d.get("n_group", 1)),
            topk_group=int(d.get("topk_group", 1)),
            norm_topk_prob=bool(d.get("norm_topk_prob", True)),
            routed_scaling_factor=float(d.get("routed_scaling_factor", 1.0)),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-5)),
            max_position_embeddings=int(d["max_position_embeddings"]),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            bos_token_id=int(d["bos_token_id"]),
            eos_token_id=int(eos[0] if isinstance(eos, list) else eos),
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """config.json as HF's `save_pretrained` writes it for this config (loadable by
        `transformers.KimiLinearForCausalLM.from_pretrained`, and by `from_hf_dict`)."""
        fields = {
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "moe_intermediate_size": self.moe_intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "layer_types": list(self.layer_types),
            "mlp_layer_types": list(self.mlp_layer_types),
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_attention_heads,
            "q_lora_rank": self.q_lora_rank,
            "kv_lora_rank": self.kv_lora_rank,
            "qk_nope_head_dim": self.qk_nope_head_dim,
            "qk_rope_head_dim": self.qk_rope_head_dim,
            "v_head_dim": self.v_head_dim,
            "linear_num_heads": self.linear_num_heads,
            "linear_head_dim": self.linear_head_dim,
            "linear_conv_kernel_dim": self.linear_conv_kernel_dim,
            "num_local_experts": self.num_local_experts,
            "num_experts_per_tok": self.num_experts_per_tok,
            "n_shared_experts": self.n_shared_experts,
            "n_group": self.n_group,
            "topk_group": self.topk_group,
            "norm_topk_prob": self.norm_topk_prob,
            "routed_scaling_factor": self.routed_scaling_factor,
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
        }
        to_alias = {field: alias for alias, field in _ALIASES.items()}
        return {
            "architectures": ["KimiLinearForCausalLM"],
            "model_type": "kimi_linear",
            "hidden_act": "silu",
            "attention_bias": False,
            "pad_token_id": None,
            "dtype": "float32",
            **{to_alias.get(key, key): value for key, value in fields.items()},
        }
