"""A two-stage pipeline with a tied embedding, and its single-process gradients (dp=2 x pp=2).

Stage 0 = embedding + one residual block, stage 1 = one block + a head tied to the embedding;
float64 weights and a global batch from fixed seeds. Used by the tests of DP gradient sync and of
ZeRO-2/3 inside a real merak-pipe pipeline step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, HIDDEN, SEQ = 11, 6, 5
DP, PP, MICRO, PER_RANK = 2, 2, 2, 4


class Embed(nn.Module):
    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.clone())

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class Block(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor) -> None:
        super().__init__()
        self.linear = nn.Linear(HIDDEN, HIDDEN).double()
        with torch.no_grad():
            self.linear.weight.copy_(weight)
            self.linear.bias.copy_(bias)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + torch.tanh(self.linear(h))


class TiedHead(nn.Module):
    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.clone())

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h @ self.weight.t()


def stage_weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(21)
    w = {"embed.weight": torch.randn(VOCAB, HIDDEN, generator=g, dtype=torch.float64)}
    for i in range(2):
        w[f"block{i}.weight"] = torch.randn(HIDDEN, HIDDEN, generator=g, dtype=torch.float64) * 0.3
        w[f"block{i}.bias"] = torch.randn(HIDDEN, generator=g, dtype=torch.float64) * 0.1
    return w


def global_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    n = DP * PER_RANK
    return torch.randint(0, VOCAB, (n, SEQ), generator=g), torch.randint(0, VOCAB, (n, SEQ), generator=g)


def tied_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


def reference_grads() -> dict[str, torch.Tensor]:
    w = stage_weights()
    stage0 = nn.Sequential(Embed(w["embed.weight"]), Block(w["block0.weight"], w["block0.bias"]))
    block1 = Block(w["block1.weight"], w["block1.bias"])
    ids, labels = global_batch()
    embed = stage0[0].weight
    tied_loss(block1(stage0(ids)) @ embed.t(), labels).backward()
    return {
        "embed.weight": embed.grad,
        "block0.weight": stage0[1].linear.weight.grad,
        "block0.bias": stage0[1].linear.bias.grad,
        "block1.weight": block1.linear.weight.grad,
        "block1.bias": block1.linear.bias.grad,
    }
