"""A tiny mixture-of-experts Llama in plain PyTorch: the reference model of the expert-parallel tests.

``MoEBlock`` follows merak_core's MoE block protocol (docs/expert_parallel.md): ``num_experts``,
``experts`` (an ``nn.ModuleList`` of SwiGLU experts) and ``run_experts(x_nh, weights_nk, experts_nk)``,
the dropless weighted sum over each token's chosen experts. Its ``forward`` routes as Mixtral does:
softmax over the router's logits, the top-k experts, their weights normalised to sum to one.
Every expert runs, on zero rows when no token chose it, so its gradient is zeros (not None) on one
process as under expert parallelism. With ``router_aux_loss_coef`` non-zero (``MoEConfig``) a block keeps its
routing of the last forward in ``router_stats`` and ``load_balancing_loss()`` is Switch's loss over its own
tokens (merak_core's [Note: a protocol block's router aux loss]; the one-process references add it).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tests.support.models import Attention, DecoderConfig, RMSNorm, rotary_tables


@dataclass(frozen=True, kw_only=True)
class MoEConfig:
    """Sizes of the tiny MoE Llama."""

    vocab_size: int = 96
    hidden_size: int = 32
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    expert_size: int = 16
    num_experts: int = 4
    top_k: int = 2
    max_seq_len: int = 64
    routing: str = "mixtral"
    router_aux_loss_coef: float = 0.0
    """``mixtral`` (softmax top-k, weights normalised) or ``deepseek`` (DeepSeek-V3: sigmoid scores, grouped
    routing, a score-correction bias for the choice only, scaled weights, one shared expert)."""


class Expert(nn.Module):
    """One SwiGLU expert."""

    def __init__(self, hidden: int, inner: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)

    def forward(self, x_nh: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x_nh)) * self.up_proj(x_nh))


class MoEBlock(nn.Module):
    """Top-k softmax routing over ``num_experts`` SwiGLU experts, dropless."""

    def __init__(self, hidden: int, inner: int, num_experts: int, top_k: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.top_k = top_k
        self.router = nn.Linear(hidden, num_experts, bias=False)
        self.experts = nn.ModuleList(Expert(hidden, inner) for _ in range(num_experts))

    router_aux_loss_coef: float = 0.0
    router_stats: tuple[torch.Tensor, torch.Tensor] | None = None

    def route(self, x_nh: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Normalised top-k weights and the chosen experts' indices, both ``[n, k]``."""
        probs_ne = F.softmax(self.router(x_nh), dim=-1)
        weights_nk, experts_nk = probs_ne.topk(self.top_k, dim=-1)
        if self.router_aux_loss_coef:
            self.router_stats = (probs_ne, experts_nk)
        return weights_nk / weights_nk.sum(-1, keepdim=True), experts_nk

    def load_balancing_loss(self) -> torch.Tensor:
        """``E * sum_e f_e * P_e`` over the tokens of the last forward (one process: the whole microbatch)."""
        assert self.router_stats is not None
        probs_ne, experts_nk = self.router_stats
        n = probs_ne.size(0)
        chosen_e = F.one_hot(experts_nk, self.num_experts).sum((0, 1)).to(probs_ne.dtype)
        return self.num_experts * torch.sum(chosen_e / n * probs_ne.mean(0))

    def run_experts(
        self, x_nh: torch.Tensor, weights_nk: torch.Tensor, experts_nk: torch.Tensor
    ) -> torch.Tensor:
        out_nh = torch.zeros_like(x_nh)
        for e, expert in enumerate(self.experts):
            tokens, slots = (experts_nk == e).nonzero(as_tuple=True)
            y_nh = expert(x_nh.index_select(0, tokens)) * weights_nk[tokens, slots].unsqueeze(-1)
            out_nh = out_nh.index_add(0, tokens, y_nh)
        return out_nh

    def forward(self, x_bth: torch.Tensor) -> torch.Tensor:
        b, t, h = x_bth.shape
        x_nh = x_bth.reshape(b * t, h)
        weights_nk, experts_nk = self.route(x_nh)
        return self.run_experts(x_nh, weights_nk, experts_nk).reshape(b, t, h)


class DeepSeekMoEBlock(MoEBlock):
    """DeepSeek-V3 routing: sigmoid scores; experts in ``num_groups`` groups, a group scored by the sum of its
    two best experts and the best ``top_groups`` groups kept; top-k among their experts by score plus a
    correction bias (the choice only); the chosen scores normalised and scaled; plus a shared expert
    every token visits (a dense module: replicated over DP, not dispatched)."""

    def __init__(
        self, hidden: int, inner: int, num_experts: int, top_k: int, num_groups: int = 2, top_groups: int = 1
    ) -> None:
        super().__init__(hidden, inner, num_experts, top_k)
        self.num_groups, self.top_groups, self.scale = num_groups, top_groups, 2.5
        self.register_buffer("score_bias", torch.linspace(-0.1, 0.1, num_experts))
        self.shared_expert = Expert(hidden, inner)

    def route(self, x_nh: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores_ne = torch.sigmoid(self.router(x_nh))
        choice_ne = scores_ne + self.score_bias.to(scores_ne.dtype)
        n = x_nh.size(0)
        per_group = choice_ne.view(n, self.num_groups, -1)
        group_scores_ng = per_group.topk(2, dim=-1).values.sum(-1)
        kept_ng = torch.zeros_like(group_scores_ng).scatter(
            1, group_scores_ng.topk(self.top_groups, dim=-1).indices, 1.0
        )
        mask_ne = kept_ng.unsqueeze(-1).expand_as(per_group).reshape(n, -1)
        experts_nk = choice_ne.masked_fill(mask_ne == 0, float("-inf")).topk(self.top_k, dim=-1).indices
        weights_nk = scores_ne.gather(1, experts_nk)
        return weights_nk / weights_nk.sum(-1, keepdim=True) * self.scale, experts_nk

    def forward(self, x_bth: torch.Tensor) -> torch.Tensor:
        return super().forward(x_bth) + self.shared_expert(x_bth)


class MoELlamaBlock(nn.Module):
    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        attn_cfg = DecoderConfig(
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            num_heads=cfg.num_heads,
            num_kv_heads=cfg.num_kv_heads,
            max_seq_len=cfg.max_seq_len,
        )
        self.input_layernorm = RMSNorm(cfg.hidden_size)
        self.self_attn = Attention(attn_cfg, causal=True, bias=False, rotary=True)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size)
        block = DeepSeekMoEBlock if cfg.routing == "deepseek" else MoEBlock
        self.moe = block(cfg.hidden_size, cfg.expert_size, cfg.num_experts, cfg.top_k)
        if cfg.router_aux_loss_coef:
            self.moe.router_aux_loss_coef = cfg.router_aux_loss_coef

    def forward(self, x_bth: torch.Tensor, cos_td: torch.Tensor, sin_td: torch.Tensor) -> torch.Tensor:
        x_bth = x_bth + self.self_attn(self.input_layernorm(x_bth), None, cos_td, sin_td)
        return x_bth + self.moe(self.post_attention_layernorm(x_bth))


class MoELlama(nn.Module):
    """Llama-style decoder whose MLPs are ``MoEBlock``s."""

    def __init__(self, cfg: MoEConfig | None = None) -> None:
        super().__init__()
        cfg = cfg or MoEConfig()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(MoELlamaBlock(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        cos, sin = rotary_tables(cfg.max_seq_len, cfg.hidden_size // cfg.num_heads)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, input_ids_bt: torch.Tensor) -> torch.Tensor:
        t = input_ids_bt.size(1)
        x_bth = self.embed_tokens(input_ids_bt)
        cos_td = torch.narrow(self.rope_cos, 0, 0, t).to(x_bth.dtype)
        sin_td = torch.narrow(self.rope_sin, 0, 0, t).to(x_bth.dtype)
        for layer in self.layers:
            x_bth = layer(x_bth, cos_td, sin_td)
        return self.lm_head(self.norm(x_bth))


__all__ = ["DeepSeekMoEBlock", "Expert", "MoEBlock", "MoEConfig", "MoELlama", "MoELlamaBlock"]


def _register_tp_plan() -> None:
    """TP for the MoE Llama: attention, embedding and head sharded; the MoE blocks whole (their experts go to EP)."""
    import merak_tp

    plan = merak_tp.TPPlan(
        name="moe_llama",
        layers={
            "layers.*.self_attn.q_proj": "column",
            "layers.*.self_attn.k_proj": "column",
            "layers.*.self_attn.v_proj": "column",
            "layers.*.self_attn.o_proj": "row",
            "embed_tokens": "vocab",
            "lm_head": "lm_head",
        },
        attributes={"layers.*.self_attn": ("num_heads", "num_kv_heads")},
        regions=("layers.*.self_attn",),
        rng_regions=("layers.*.self_attn",),
    )
    merak_tp.register_plan(plan, classes=(MoELlama,), overwrite=True)


if importlib.util.find_spec("merak_tp") is not None:
    _register_tp_plan()
