"""The Kimi Linear decoder: Kimi Delta Attention (KDA) and multi-head latent attention (MLA) layers, dense
and mixture-of-experts MLPs, one forward over a batch of scheduled tokens, the paged latent KV cache of
its MLA layers and the per-request state of its KDA layers.

Architecture: Kimi Team, "Kimi Linear: An Expressive, Efficient Attention Architecture" (arXiv:2510.26692)
— mostly KDA layers (a gated delta rule with per-channel decay over a short convolution, §3) with MLA
layers between them (DeepSeek-V2's latent attention, without position encoding: §4 "NoPE"), every MLP
after the first a DeepSeek-V3-style MoE with a shared expert. Weights are named as the Kimi Linear
checkpoints (and HF's `save_pretrained` of `KimiLinearForCausalLM`) name them; the math is checked
against HF's `KimiLinearForCausalLM` (tests/unit/test_kimi_linear_vs_hf.py). Per layer, pre-norm:

    KDA: [q|k|v] = silu(short_conv(x W_qkv))            kernels/short_conv.py (state: last K-1 inputs)
         q, k = l2norm(q), l2norm(k)                     per head
         g = -exp(A_log) * softplus(x W_fa W_fb + dt_bias)   per head and key channel (log decay <= 0)
         beta = sigmoid(x W_b)                           per head
         o = gated delta rule(q, k, v, g, beta)          kernels/gated_delta_rule.py (state: [H, d_k, d_v])
         out = (rmsnorm(o) * sigmoid(x W_ga W_gb)) W_o   per head, then all heads
    MLA: q = x W_q (or rmsnorm(x W_qa) W_qb);  [c_KV | k_R] = x W_kva;  c_KV = rmsnorm(c_KV)
         cache [c_KV | k_R] per token (paged);  attention as kernels/mla.py;  out = o W_o
    MLP: SwiGLU (dense layers), or MoE: route_topk (kernels/moe.py) over the experts' SwiGLUs, plus the
         shared expert's.

Projections go through `linear.Linear` (oneDNN, weights prepacked), the ones reading the same input fused
into one GEMM (KDA: q, k, v, the forget gate's and output gate's down-projections and beta; MLA: q or
q_a, and kv_a; each expert's gate and up).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F

from pdserve.engine.device import CPU
from pdserve.engine.forward_batch import ForwardBatch
from pdserve.engine.kimi_linear_config import KDA, SPARSE, KimiLinearConfig
from pdserve.engine.linear import Linear, fused, gated
from pdserve.engine.model_family import CacheSpec, LayerHook, placed
from pdserve.engine.state_pool import StateLayout, StatePool, StateTensor
from pdserve.kernels.gated_delta_rule import gated_delta_rule_chunked, gated_delta_rule_step, l2_normalize
from pdserve.kernels.mla import MLAWeights, mla_attention, split_up_proj, store_latent
from pdserve.kernels.moe import route_topk
from pdserve.kernels.rms_norm import rms_norm
from pdserve.kernels.short_conv import causal_conv, causal_conv_step

LATENT_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm: HF's KimiLinearRMSNorm default, not rms_norm_eps

Weight = Callable[[str], torch.Tensor]


class _SwiGLU:
    """`down(silu(gate(x)) * up(x))`, gate and up as one GEMM."""

    def __init__(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> None:
        self.gate_up = gated(gate, up)
        self.down = Linear(down)

    def hidden(self, x: torch.Tensor) -> torch.Tensor:
        return self.gate_up(x)


class _MoE:
    """The sparse MLP: a router over `num_local_experts` SwiGLU experts (top-k per token), plus the shared."""

    def __init__(self, config: KimiLinearConfig, weight: Weight, prefix: str) -> None:
        self.config = config
        self.router = Linear(weight(prefix + "gate.weight").float())
        self.correction_bias = weight(prefix + "gate.e_score_correction_bias").float()
        e = prefix + "experts."
        self.experts = [
            _SwiGLU(weight(f"{e}{i}.w1.weight"), weight(f"{e}{i}.w3.weight"), weight(f"{e}{i}.w2.weight"))
            for i in range(config.num_local_experts)
        ]
        s = prefix + "shared_experts."
        self.shared = _SwiGLU(*(weight(f"{s}{n}_proj.weight") for n in ("gate", "up", "down")))

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """`residual + shared(x) + sum_k w_k expert_k(x)`: [tokens, hidden]."""
        cfg = self.config
        weights, experts = route_topk(
            self.router(x.float()), self.correction_bias, cfg.num_experts_per_tok, cfg.n_group,
            cfg.topk_group, cfg.norm_topk_prob, cfg.routed_scaling_factor,
        )
        out = self.shared.down.add(self.shared.hidden(x), residual)
        for expert in experts.unique().tolist():
            tokens, rank = (experts == expert).nonzero(as_tuple=True)
            mlp = self.experts[expert]
            y = mlp.down(mlp.hidden(x[tokens])).mul_(weights[tokens, rank, None].to(x.dtype))
            out.index_add_(0, tokens, y)
        return out


class _Dense:
    def __init__(self, weight: Weight, prefix: str) -> None:
        self.mlp = _SwiGLU(*(weight(f"{prefix}{n}_proj.weight") for n in ("gate", "up", "down")))

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.mlp.down.add(self.mlp.hidden(x), residual)


class _KDALayer:
    """One KDA layer's weights; `state_index`: its index among the state layers (its state pools)."""

    def __init__(self, config: KimiLinearConfig, weight: Weight, p: str, state_index: int) -> None:
        heads, d = config.linear_num_heads, config.linear_head_dim
        self.state_index = state_index
        a = p + "self_attn."
        # one GEMM: q, k, v (conv inputs) | forget gate down-projection | beta logits | output gate down
        self.in_proj = fused(*(weight(a + n + ".weight") for n in
                               ("q_proj", "k_proj", "v_proj", "f_a_proj", "b_proj", "g_a_proj")))
        self.splits = (3 * heads * d, d, heads, d)
        self.conv = torch.cat([weight(a + f"{n}_conv1d.weight") for n in "qkv"]).squeeze(1)  # [3 H d, K]
        self.f_b = Linear(weight(a + "f_b_proj.weight"))
        self.dt_bias = weight(a + "dt_bias").float()  # [H d]
        rate = weight(a + "A_log").float().reshape(heads).exp()  # per head
        self.neg_rate = (-rate).repeat_interleave(d)  # [H d]: -exp(A_log) for each key channel
        self.g_b = Linear(weight(a + "g_b_proj.weight"))
        self.o_norm = weight(a + "o_norm.weight")
        self.o = Linear(weight(a + "o_proj.weight"))


class _MLALayer:
    """One MLA layer's weights; `paged_index`: its index among the paged layers (its KV pool)."""

    def __init__(self, config: KimiLinearConfig, weight: Weight, p: str, paged_index: int) -> None:
        self.paged_index = paged_index
        a = p + "self_attn."
        kv_a = weight(a + "kv_a_proj_with_mqa.weight")
        if config.q_lora_rank is None:
            q = weight(a + "q_proj.weight")
            self.q_b, self.q_a_norm = None, None
        else:
            q = weight(a + "q_a_proj.weight")
            self.q_a_norm = weight(a + "q_a_layernorm.weight")
            self.q_b = Linear(weight(a + "q_b_proj.weight"))
        self.q_width = q.shape[0]
        self.in_proj = fused(q, kv_a)
        self.kv_a_norm = weight(a + "kv_a_layernorm.weight")
        kv_b = weight(a + "kv_b_proj.weight")
        w_uk, w_uv = split_up_proj(kv_b, config.num_attention_heads, config.qk_nope_head_dim)
        self.weights = MLAWeights(Linear(kv_b), w_uk, w_uv)
        self.o = Linear(weight(a + "o_proj.weight"))


class _Layer(NamedTuple):
    input_norm: torch.Tensor
    mixer: _KDALayer | _MLALayer
    post_norm: torch.Tensor
    mlp: _MoE | _Dense


class _KDABatch(NamedTuple):
    """Where the KDA layers of one forward read and write state, worked out once for every layer.

    `prefill`: (first row, new tokens, slot, segment ends with the checkpoint slot after each or None)
    per sequence of several new tokens; `decode_rows`, `decode_slots`: [num_decode] int64 for the
    sequences of one new token; `decode_checkpoints`: (slot, checkpoint slot) to copy after the step.
    """

    prefill: list[tuple[int, int, int, list[tuple[int, int | None]]]]
    decode_rows: torch.Tensor
    decode_slots: torch.Tensor
    decode_checkpoints: list[tuple[int, int]]


class KimiLinearModel:
    """A Kimi Linear decoder on `device` in `dtype` (fp32 on CPU; see `device.py`), an `EngineModel`.

    `weights` are tensors by checkpoint name (see `loader`), copied to `device` and `dtype` (the router
    and the forget gate's parameters kept fp32, as HF keeps them). Raises KeyError when a weight is missing.
    """

    family = "kimi_linear"

    def __init__(
        self,
        config: KimiLinearConfig,
        weights: dict[str, torch.Tensor],
        device: torch.device = CPU,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.config = config
        self.device = torch.device(device)
        self.dtype = dtype
        weight = placed(weights, self.device, dtype)
        self.embed = weight("model.embed_tokens.weight")
        self.layers: list[_Layer] = []
        num_state = num_paged = 0
        for i, kind in enumerate(config.layer_types):
            p = f"model.layers.{i}."
            if kind == KDA:
                mixer: _KDALayer | _MLALayer = _KDALayer(config, weight, p, num_state)
                num_state += 1
            else:
                mixer = _MLALayer(config, weight, p, num_paged)
                num_paged += 1
            if config.mlp_layer_types[i] == SPARSE:
                mlp: _MoE | _Dense = _MoE(config, weight, p + "mlp.")
            else:
                mlp = _Dense(weight, p + "mlp.")
            norms = weight(p + "input_layernorm.weight"), weight(p + "post_attention_layernorm.weight")
            self.layers.append(_Layer(norms[0], mixer, norms[1], mlp))
        self.final_norm = weight("model.norm.weight")
        self.lm_head = Linear(self.embed if config.tie_word_embeddings else weight("lm_head.weight"))

    def cache_spec(self) -> CacheSpec:
        """MLA layers paged, one token's row [kv_lora_rank + qk_rope_head_dim] (c_KV then k_R); KDA layers
        stateful, per request `recurrent` [heads, d_k, d_v] fp32 and `conv` [K - 1, 3 * heads * d_k]."""
        cfg = self.config
        heads, d = cfg.linear_num_heads, cfg.linear_head_dim
        state = StateLayout(
            cfg.num_kda_layers,
            (
                StateTensor("recurrent", (heads, d, d), torch.float32),
                StateTensor("conv", (cfg.linear_conv_kernel_dim - 1, cfg.conv_dim)),
            ),
        )
        return CacheSpec(cfg.num_mla_layers, (cfg.latent_dim,), state)

    @torch.inference_mode()
    def forward(
        self, batch: ForwardBatch, kv_cache: list[torch.Tensor], layer_hook: LayerHook | None = None,
        states: StatePool | None = None,
    ) -> torch.Tensor:
        """Compute `batch`'s tokens: MLA layers write their latents into their slots of `kv_cache` (one
        pool per MLA layer, [num_blocks, block_size, kv_lora_rank + rope_dim]; rows `batch.store_rows`),
        KDA layers advance each sequence's state in `states` (slots `batch.state`, snapshotted into
        `batch.state.checkpoints`). Returns the logits of the rows `batch.logits_indices`:
        [len(logits_indices), vocab_size] fp32. `layer_hook(l, kv_cache[l])` runs as soon as MLA layer l's
        latents are stored, before its attention. Raises ValueError without `states` / `batch.state`.
        """
        if states is None or batch.state is None:
            raise ValueError("a Kimi Linear forward needs the state pool and the batch's state slots")
        cfg = self.config
        kda = self._kda_batch(batch)
        hidden = F.embedding(batch.input_ids, self.embed)  # [T, hidden]
        for layer in self.layers:
            x = rms_norm(hidden, layer.input_norm, cfg.rms_norm_eps)
            if isinstance(layer.mixer, _KDALayer):
                hidden = self._kda(layer.mixer, x, hidden, kda, states)
            else:
                hidden = self._mla(layer.mixer, x, hidden, batch, kv_cache, layer_hook)
            hidden = layer.mlp.add(rms_norm(hidden, layer.post_norm, cfg.rms_norm_eps), hidden)
        last = rms_norm(hidden[batch.logits_indices], self.final_norm, cfg.rms_norm_eps)
        return self.lm_head(last)

    # ------------------------------------------------------------ KDA

    def _kda_batch(self, batch: ForwardBatch) -> _KDABatch:
        assert batch.state is not None
        prefill, decode_rows, decode_slots, decode_checkpoints = [], [], [], []
        row = 0
        for n, slot, saves in zip(batch.attention.query_lens, batch.state.slots, batch.state.checkpoints,
                                  strict=True):
            if n == 1:
                decode_rows.append(row)
                decode_slots.append(slot)
                decode_checkpoints += ((slot, checkpoint) for _, checkpoint in saves)
            else:
                ends: list[tuple[int, int | None]] = list(saves)
                if not ends or ends[-1][0] != n:
                    ends.append((n, None))
                prefill.append((row, n, slot, ends))
            row += n

        def tensor(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=self.device)

        return _KDABatch(prefill, tensor(decode_rows), tensor(decode_slots), decode_checkpoints)

    def _kda(
        self, layer: _KDALayer, x: torch.Tensor, residual: torch.Tensor, kda: _KDABatch, states: StatePool
    ) -> torch.Tensor:
        cfg = self.config
        heads, d = cfg.linear_num_heads, cfg.linear_head_dim
        num_tokens = x.shape[0]
        qkv, f_a, b, g_a = self.split(layer.in_proj(x), layer.splits)
        g = F.softplus(layer.f_b(f_a).float() + layer.dt_bias).mul_(layer.neg_rate).view(num_tokens, heads, d)
        beta = b.float().sigmoid()  # [T, heads]
        recurrent = states.tensors["recurrent"][layer.state_index]  # [slots, heads, d, d]
        conv = states.tensors["conv"][layer.state_index]  # [slots, K - 1, 3 heads d]
        scale = d**-0.5
        out = torch.empty(num_tokens, heads, d, dtype=torch.float32, device=self.device)

        def q_k_v(mixed: torch.Tensor):
            q, k, v = mixed.float().view(-1, 3, heads, d).unbind(1)
            return l2_normalize(q), l2_normalize(k), v

        for row, _, slot, ends in kda.prefill:  # segment by segment, snapshotting at each checkpoint
            start = 0
            for end, checkpoint in ends:
                rows = slice(row + start, row + end)
                q, k, v = q_k_v(causal_conv(qkv[rows], layer.conv, conv[slot]))
                out[rows] = gated_delta_rule_chunked(q, k, v, g[rows], beta[rows], recurrent[slot], scale)
                if checkpoint is not None:
                    states.copy_slot(slot, checkpoint, layer.state_index)
                start = end
        if kda.decode_rows.numel():
            rows, slots = kda.decode_rows, kda.decode_slots
            conv_states = conv.index_select(0, slots)
            q, k, v = q_k_v(causal_conv_step(qkv[rows], layer.conv, conv_states))
            conv.index_copy_(0, slots, conv_states)
            state = recurrent.index_select(0, slots)
            out[rows] = gated_delta_rule_step(q, k, v, g[rows], beta[rows], state, scale)
            recurrent.index_copy_(0, slots, state)
            for slot, checkpoint in kda.decode_checkpoints:
                states.copy_slot(slot, checkpoint, layer.state_index)
        gate = layer.g_b(g_a).view(num_tokens, heads, d)
        o = rms_norm(out.to(self.dtype), layer.o_norm, cfg.rms_norm_eps).mul_(torch.sigmoid(gate))
        return layer.o.add(o.view(num_tokens, heads * d), residual)

    # ------------------------------------------------------------ MLA

    def _mla(
        self, layer: _MLALayer, x: torch.Tensor, residual: torch.Tensor, batch: ForwardBatch,
        kv_cache: list[torch.Tensor], layer_hook: LayerHook | None,
    ) -> torch.Tensor:
        cfg = self.config
        num_tokens = x.shape[0]
        rank = cfg.kv_lora_rank
        proj = layer.in_proj(x)
        q, kv = proj[:, : layer.q_width], proj[:, layer.q_width :]
        if layer.q_b is not None:
            q = layer.q_b(rms_norm(q, layer.q_a_norm, LATENT_NORM_EPS))
        latent = torch.cat((rms_norm(kv[:, :rank], layer.kv_a_norm, LATENT_NORM_EPS), kv[:, rank:]), dim=-1)
        pool = kv_cache[layer.paged_index]
        store_rows, store_slots = batch.store_slots()
        store_latent(pool, store_slots, latent if store_rows is None else latent[store_rows])
        if layer_hook is not None:
            layer_hook(layer.paged_index, pool)
        heads, qk_dim = cfg.num_attention_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        attn = mla_attention(q.reshape(num_tokens, heads, qk_dim), pool, batch.attention, layer.weights,
                             cfg.qk_nope_head_dim, qk_dim**-0.5)
        return layer.o.add(attn.reshape(num_tokens, heads * cfg.v_head_dim), residual)

    @staticmethod
    def split(t: torch.Tensor, widths: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
        """Column blocks of `t` [rows, sum(widths)] (views)."""
        return t.split(list(widths), dim=-1)
