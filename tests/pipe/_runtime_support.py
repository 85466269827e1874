"""Hand-split stage modules of the reference GPT and Llama for the runtime tests.

Each builder takes a full reference model and returns its *units* (an embedding unit, one unit
per block, a head unit) built from the model's own submodules, so a parameter keeps its
identity and its name in the full model: gradients are compared by the full model's names.
:func:`split_units` cuts the unit chain into contiguous stages.

Boundaries: GPT passes one tensor; Llama passes a tuple ``(x, cos, sin)`` (cos/sin do not
require grad); the "dict" Llama variant passes ``{"hidden": x, "cos": ..., "sin": ...,
"seq_len": int}``, a dict with a non-tensor constant that each unit checks.
"""

from __future__ import annotations

import torch
from torch import nn

from tests.support.models import GPT, DecoderConfig, Llama


class GPTEmbed(nn.Module):
    def __init__(self, model: GPT) -> None:
        super().__init__()
        self.wte, self.wpe, self.drop = model.wte, model.wpe, model.drop

    def forward(self, input_ids_bt: torch.Tensor) -> torch.Tensor:
        pos_t = torch.arange(input_ids_bt.size(1), device=input_ids_bt.device)
        return self.drop(self.wte(input_ids_bt) + self.wpe(pos_t))


class GPTHead(nn.Module):
    def __init__(self, model: GPT) -> None:
        super().__init__()
        self.ln_f, self.lm_head = model.ln_f, model.lm_head

    def forward(self, x_bth: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(x_bth))


class LlamaEmbed(nn.Module):
    def __init__(self, model: Llama, *, as_dict: bool) -> None:
        super().__init__()
        self.embed_tokens = model.embed_tokens
        self.rope = (model.rope_cos, model.rope_sin)  # plain attribute: not this unit's buffers
        self.as_dict = as_dict

    def forward(self, input_ids_bt: torch.Tensor):  # type: ignore[no-untyped-def]
        t = input_ids_bt.size(1)
        x_bth = self.embed_tokens(input_ids_bt)
        cos_td = torch.narrow(self.rope[0], 0, 0, t).to(x_bth.dtype)
        sin_td = torch.narrow(self.rope[1], 0, 0, t).to(x_bth.dtype)
        if self.as_dict:
            return {"hidden": x_bth, "cos": cos_td, "sin": sin_td, "seq_len": t}
        return x_bth, cos_td, sin_td


class LlamaLayer(nn.Module):
    def __init__(self, block: nn.Module, *, as_dict: bool) -> None:
        super().__init__()
        self.block = block
        self.as_dict = as_dict

    def forward(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        if self.as_dict:
            x, cos, sin, t = kwargs["hidden"], kwargs["cos"], kwargs["sin"], kwargs["seq_len"]
            if not isinstance(t, int) or t != x.size(1):
                raise AssertionError(f"constant seq_len={t!r} does not match hidden {tuple(x.shape)}")
            return {"hidden": self.block(x, cos, sin), "cos": cos, "sin": sin, "seq_len": t}
        x, cos, sin = args
        return self.block(x, cos, sin), cos, sin


class LlamaHead(nn.Module):
    def __init__(self, model: Llama) -> None:
        super().__init__()
        self.norm, self.lm_head = model.norm, model.lm_head

    def forward(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        x = kwargs["hidden"] if kwargs else args[0]
        return self.lm_head(self.norm(x))


def build_model(name: str, *, num_layers: int, dropout: float = 0.0, seed: int = 0) -> nn.Module:
    """A float64 reference model with ``num_layers`` blocks, built under a fixed seed."""
    torch.manual_seed(seed)
    if name == "gpt":
        return GPT(DecoderConfig(num_layers=num_layers, dropout=dropout)).double()
    if name in ("llama", "llama-dict"):
        return Llama(DecoderConfig(num_layers=num_layers, num_kv_heads=2, dropout=dropout)).double()
    raise ValueError(name)


def model_units(name: str, model: nn.Module) -> list[nn.Module]:
    """The unit chain of a full model (shares its parameters)."""
    if name == "gpt":
        assert isinstance(model, GPT)
        return [GPTEmbed(model), *model.blocks, GPTHead(model)]
    as_dict = name == "llama-dict"
    assert isinstance(model, Llama)
    return [
        LlamaEmbed(model, as_dict=as_dict),
        *(LlamaLayer(b, as_dict=as_dict) for b in model.layers),
        LlamaHead(model),
    ]


def split_units(units: list[nn.Module], num_stages: int) -> list[nn.Sequential]:
    """Contiguous, as even as possible split of ``units`` into ``num_stages`` Sequentials."""
    if len(units) < num_stages:
        raise ValueError(f"{len(units)} units cannot fill {num_stages} stages")
    base, extra = divmod(len(units), num_stages)
    out, start = [], 0
    for s in range(num_stages):
        size = base + (1 if s < extra else 0)
        out.append(nn.Sequential(*units[start : start + size]))
        start += size
    return out


def layers_for(num_stages: int) -> int:
    """Enough blocks that every stage holds at least one unit (two units per stage where possible)."""
    return max(2, 2 * num_stages - 2)
