"""Expert routing of a mixture-of-experts MLP: sigmoid scores, group-limited top-k, a selection-only bias.

The router DeepSeek-V3 introduced (DeepSeek-AI, "DeepSeek-V3 Technical Report", arXiv:2412.19437, §2.1.2:
sigmoid affinities, the "auxiliary-loss-free" bias `e_score_correction_bias` added for choosing experts
only, node-limited routing by groups) and Kimi Linear uses (Kimi Linear report §4: its MoE follows
Moonlight/DeepSeek-V3):

    s = sigmoid(x W_gate^T)                                      [tokens, experts]
    group score = sum of the 2 largest (s + bias) in the group;  keep the `topk_group` best groups
    experts = top-k of (s + bias) within the kept groups
    weights = s[experts] (without the bias), / their sum when `renormalize`, * `scaling`
"""

from __future__ import annotations

import torch


def route_topk(
    router_logits: torch.Tensor, correction_bias: torch.Tensor, top_k: int, num_groups: int,
    topk_groups: int, renormalize: bool, scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's experts and their weights.

    router_logits: [tokens, experts] fp32 (x @ W_gate^T); correction_bias: [experts] fp32. `experts` must
    divide into `num_groups` groups of at least 2. Returns (weights [tokens, top_k] fp32, experts
    [tokens, top_k] int64), in no particular order within a token.
    """
    num_tokens, num_experts = router_logits.shape
    scores = router_logits.sigmoid()
    choice = scores + correction_bias
    group_scores = choice.view(num_tokens, num_groups, -1).topk(2, dim=-1).values.sum(-1)  # [tokens, groups]
    kept = torch.zeros_like(group_scores, dtype=torch.bool)
    kept.scatter_(1, group_scores.topk(topk_groups, dim=-1, sorted=False).indices, True)
    in_kept = kept.unsqueeze(-1).expand(num_tokens, num_groups, num_experts // num_groups).reshape_as(choice)
    experts = choice.masked_fill(~in_kept, -torch.inf).topk(top_k, dim=-1, sorted=False).indices
    weights = scores.gather(1, experts)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scaling, experts
