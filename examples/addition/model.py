"""The demo's model: a small GPT-style decoder written as a user would write it.

Plain ``torch.nn`` code with nothing Merak-specific: Merak traces it, cuts it
into pipeline stages and shards it for tensor parallelism from outside. The
module names differ from GPT-2's on purpose; the tensor-parallel plan in
``config.yaml`` says which linears are column- or row-parallel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True, kw_only=True)
class TinyGPTConfig:
    vocab_size: int = 13
    context: int = 16
    width: int = 64
    depth: int = 4
    heads: int = 4


class SelfAttention(nn.Module):
    def __init__(self, cfg: TinyGPTConfig) -> None:
        super().__init__()
        self.num_heads = cfg.heads
        self.head_dim = cfg.width // cfg.heads
        self.query = nn.Linear(cfg.width, cfg.width)
        self.key = nn.Linear(cfg.width, cfg.width)
        self.value = nn.Linear(cfg.width, cfg.width)
        self.out = nn.Linear(cfg.width, cfg.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.query(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = self.key(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.value(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, -1))


class Layer(nn.Module):
    def __init__(self, cfg: TinyGPTConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.width)
        self.attn = SelfAttention(cfg)
        self.norm2 = nn.LayerNorm(cfg.width)
        self.up = nn.Linear(cfg.width, 4 * cfg.width)
        self.down = nn.Linear(4 * cfg.width, cfg.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class TinyGPT(nn.Module):
    """Decoder-only transformer; the output head shares the token embedding."""

    def __init__(self, cfg: TinyGPTConfig | None = None) -> None:
        super().__init__()
        cfg = cfg or TinyGPTConfig()
        self.token_embed = nn.Embedding(cfg.vocab_size, cfg.width)
        self.pos_embed = nn.Embedding(cfg.context, cfg.width)
        self.layers = nn.ModuleList(Layer(cfg) for _ in range(cfg.depth))
        self.final_norm = nn.LayerNorm(cfg.width)
        self.head = nn.Linear(cfg.width, cfg.vocab_size, bias=False)
        self.head.weight = self.token_embed.weight
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(input_ids.size(1), device=input_ids.device)
        x = self.token_embed(input_ids) + self.pos_embed(pos)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.final_norm(x))


def build_model(**sizes: int) -> TinyGPT:
    return TinyGPT(TinyGPTConfig(**sizes))
