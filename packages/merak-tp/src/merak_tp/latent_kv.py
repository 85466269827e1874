"""The latent key/value projection of multi-head latent attention (DeepSeek-V3) under TP.

DeepSeek-V3's ``kv_a_proj_with_mqa`` maps the hidden state to ``[latent | shared rotary key]``.
Under TP the latent goes through ``kv_b_proj``, a column layer whose backward all-reduces its
input gradient, so the latent's gradient is complete on every rank; the rotary key is shared by
all heads but each rank expands it over its own heads only, so its gradient is one rank's part.
``LatentKVProjection`` keeps the projection's weights replicated and whole, computes the same
output (identity forward), and sums the rotary slice's gradient over the TP group in backward:
the projection's weights, the input's gradient and every replicated parameter before it get the
full gradient, equal on every rank. It is a module (a trace leaf), not a hook, so a traced
pipeline stage keeps its backward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

from merak_tp._tp_module import _TPModule
from merak_tp.collectives import copy_to_tp_region

__all__ = ["LatentKVProjection"]


class LatentKVProjection(_TPModule):
    """``nn.Linear``'s forward over the same (replicated) parameters; backward sums the gradient of the
    last ``rotary`` output features over ``group``."""

    def __init__(self, linear: nn.Linear, rotary: int, *, group: ProcessGroup | None) -> None:
        super().__init__()
        if not 0 < rotary < linear.out_features:
            raise ValueError(
                f"LatentKVProjection: rotary={rotary} must be between 1 and out_features-1 "
                f"({linear.out_features - 1}) of the projection it wraps"
            )
        self._bind_group(group)
        self.in_features, self.out_features, self.rotary = linear.in_features, linear.out_features, rotary
        self.weight = linear.weight
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias)
        latent, key = out.split([self.out_features - self.rotary, self.rotary], dim=-1)
        return torch.cat((latent, copy_to_tp_region(key, self.group)), dim=-1)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, rotary={self.rotary}, "
            f"bias={self.bias is not None}, tp_size={self.tp_size}"
        )
