"""Small reference models shared by every package's tests.

Each model is plain ``torch.nn`` code, traceable by ``torch.fx.symbolic_trace``
and by ``torch.export``, small enough to run in float64 on CPU in milliseconds:

- ``GPT``: a GPT-2 style decoder (learned positions, LayerNorm, GELU MLP) whose
  output projection is tied to the input embedding;
- ``Llama``: a Llama style decoder (RMSNorm, rotary positions, SwiGLU MLP,
  grouped-query attention), untied head;
- ``Bert``: a BERT style encoder with an attention mask input (a broadcast
  value that every layer reads) and token types;
- ``ResNet``: a small CNN of residual blocks (GroupNorm by default, so that
  splitting a batch into microbatches does not change the math; BatchNorm on
  request, for buffer handling tests).

Attention modules keep separate ``q_proj``/``k_proj``/``v_proj``/``o_proj``
linears and expose ``num_heads``/``num_kv_heads``/``head_dim`` so tensor
parallel plans can shard them and fix the per-rank head counts.

Context parallel: inside ``merak_tp.context_parallel(...)`` (Merak's trainer
enters it at cp > 1) attention goes through the hook ``merak_tp.cp_attention``
and the Llama's rotary positions through ``merak_tp.cp_positions`` (the global
positions of the local tokens); outside it (and without merak-tp installed)
the code below runs exactly as before.

Shape legend: b batch, t tokens, h hidden, v vocabulary, n heads, d head dim.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

# --------------------------------------------------------------------------- configs


@dataclass(frozen=True, kw_only=True)
class DecoderConfig:
    """Sizes of the GPT / Llama / BERT style models."""

    vocab_size: int = 96
    hidden_size: int = 32
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 4
    intermediate_size: int = 64
    max_seq_len: int = 64
    dropout: float = 0.0
    type_vocab_size: int = 2


# --------------------------------------------------------------------------- attention

_CP: Any = importlib.import_module("merak_tp.context") if importlib.util.find_spec("merak_tp") else None


def _cp_active() -> bool:
    """Whether a context-parallel context is active (the hook of merak_tp.context)."""
    return _CP is not None and _CP.active_context() is not None


class Attention(nn.Module):
    """Multi-head (optionally grouped-query) self-attention with separate projections."""

    def __init__(self, cfg: DecoderConfig, *, causal: bool, bias: bool, rotary: bool) -> None:
        super().__init__()
        if cfg.hidden_size % cfg.num_heads:
            raise ValueError(f"hidden_size={cfg.hidden_size} not divisible by num_heads={cfg.num_heads}")
        if cfg.num_heads % cfg.num_kv_heads:
            raise ValueError(f"num_heads={cfg.num_heads} not divisible by num_kv_heads={cfg.num_kv_heads}")
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.hidden_size // cfg.num_heads
        self.causal = causal
        self.rotary = rotary
        self.dropout = cfg.dropout
        h, d = cfg.hidden_size, self.head_dim
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=bias)

    def forward(
        self,
        x_bth: torch.Tensor,
        mask_b11t: torch.Tensor | None = None,
        cos_td: torch.Tensor | None = None,
        sin_td: torch.Tensor | None = None,
    ) -> torch.Tensor:
        b, t, _ = x_bth.shape
        # Head counts are read from the module at run time: TP shards change them.
        q = self.q_proj(x_bth).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x_bth).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x_bth).view(b, t, -1, self.head_dim).transpose(1, 2)
        if self.rotary:
            assert cos_td is not None and sin_td is not None
            q = apply_rotary(q, cos_td, sin_td)
            k = apply_rotary(k, cos_td, sin_td)
        if _cp_active() and mask_b11t is None:
            y = _CP.cp_attention(q, k, v, causal=self.causal)
            return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))
        rep = self.num_heads // self.num_kv_heads
        if rep > 1:
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask_b11t,
            dropout_p=self.dropout if self.training else 0.0,
            is_causal=self.causal,
        )
        y = y.transpose(1, 2).reshape(b, t, -1)
        return self.o_proj(y)


def rotary_tables(
    max_seq_len: int, head_dim: int, base: float = 10000.0
) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    pos = torch.arange(max_seq_len, dtype=torch.float64)
    freqs = torch.outer(pos, inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().float(), emb.sin().float()


def apply_rotary(x_bntd: torch.Tensor, cos_td: torch.Tensor, sin_td: torch.Tensor) -> torch.Tensor:
    half = x_bntd.shape[-1] // 2
    x1 = x_bntd[..., :half]
    x2 = x_bntd[..., half:]
    rotated = torch.cat([-x2, x1], dim=-1)
    return x_bntd * cos_td + rotated * sin_td


# --------------------------------------------------------------------------- GPT


class GPTMLP(nn.Module):
    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.fc_in = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.fc_out = nn.Linear(cfg.intermediate_size, cfg.hidden_size)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x_bth: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.fc_out(F.gelu(self.fc_in(x_bth))))


class GPTBlock(nn.Module):
    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.hidden_size)
        self.attn = Attention(cfg, causal=True, bias=True, rotary=False)
        self.ln_2 = nn.LayerNorm(cfg.hidden_size)
        self.mlp = GPTMLP(cfg)

    def forward(self, x_bth: torch.Tensor) -> torch.Tensor:
        x_bth = x_bth + self.attn(self.ln_1(x_bth))
        return x_bth + self.mlp(self.ln_2(x_bth))


class GPT(nn.Module):
    """GPT-2 style decoder; ``lm_head.weight`` is ``wte.weight`` (tied)."""

    def __init__(self, cfg: DecoderConfig | None = None) -> None:
        super().__init__()
        cfg = cfg or DecoderConfig()
        self.config = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.wpe = nn.Embedding(cfg.max_seq_len, cfg.hidden_size)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(GPTBlock(cfg) for _ in range(cfg.num_layers))
        self.ln_f = nn.LayerNorm(cfg.hidden_size)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, input_ids_bt: torch.Tensor) -> torch.Tensor:
        pos_t = torch.arange(input_ids_bt.size(1), device=input_ids_bt.device)
        x_bth = self.drop(self.wte(input_ids_bt) + self.wpe(pos_t))
        for block in self.blocks:
            x_bth = block(x_bth)
        return self.lm_head(self.ln_f(x_bth))


# --------------------------------------------------------------------------- Llama


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


class LlamaMLP(nn.Module):
    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x_bth: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x_bth)) * self.up_proj(x_bth))


class LlamaBlock(nn.Module):
    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size)
        self.self_attn = Attention(cfg, causal=True, bias=False, rotary=True)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size)
        self.mlp = LlamaMLP(cfg)

    def forward(self, x_bth: torch.Tensor, cos_td: torch.Tensor, sin_td: torch.Tensor) -> torch.Tensor:
        x_bth = x_bth + self.self_attn(self.input_layernorm(x_bth), None, cos_td, sin_td)
        return x_bth + self.mlp(self.post_attention_layernorm(x_bth))


class Llama(nn.Module):
    """Llama style decoder with grouped-query attention (num_kv_heads < num_heads)."""

    supports_context_parallel = True
    """Its attention and rotary positions use merak_tp's context-parallel hook (module docstring)."""

    def __init__(self, cfg: DecoderConfig | None = None) -> None:
        super().__init__()
        cfg = cfg or DecoderConfig(num_kv_heads=2)
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaBlock(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        cos, sin = rotary_tables(cfg.max_seq_len, cfg.hidden_size // cfg.num_heads)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, input_ids_bt: torch.Tensor) -> torch.Tensor:
        t = input_ids_bt.size(1)
        x_bth = self.embed_tokens(input_ids_bt)
        if _cp_active():  # context parallel: the global positions of the local tokens
            pos = _CP.cp_positions(t, self.rope_cos.device)
            cos_td, sin_td = self.rope_cos[pos].to(x_bth.dtype), self.rope_sin[pos].to(x_bth.dtype)
        else:
            # torch.narrow, not slicing: fx can trace a buffer narrowed by a traced length.
            cos_td = torch.narrow(self.rope_cos, 0, 0, t).to(x_bth.dtype)
            sin_td = torch.narrow(self.rope_sin, 0, 0, t).to(x_bth.dtype)
        for layer in self.layers:
            x_bth = layer(x_bth, cos_td, sin_td)
        return self.lm_head(self.norm(x_bth))


# --------------------------------------------------------------------------- BERT


class BertLayer(nn.Module):
    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.attention = Attention(cfg, causal=False, bias=True, rotary=False)
        self.attention_norm = nn.LayerNorm(cfg.hidden_size)
        self.intermediate = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.output = nn.Linear(cfg.intermediate_size, cfg.hidden_size)
        self.output_norm = nn.LayerNorm(cfg.hidden_size)

    def forward(self, x_bth: torch.Tensor, mask_b11t: torch.Tensor) -> torch.Tensor:
        x_bth = self.attention_norm(x_bth + self.attention(x_bth, mask_b11t))
        return self.output_norm(x_bth + self.output(F.gelu(self.intermediate(x_bth))))


class Bert(nn.Module):
    """BERT style encoder with a masked-LM head; ``attention_mask`` is 1 for real tokens."""

    def __init__(self, cfg: DecoderConfig | None = None) -> None:
        super().__init__()
        cfg = cfg or DecoderConfig()
        self.config = cfg
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.position_embeddings = nn.Embedding(cfg.max_seq_len, cfg.hidden_size)
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, cfg.hidden_size)
        self.embeddings_norm = nn.LayerNorm(cfg.hidden_size)
        self.layers = nn.ModuleList(BertLayer(cfg) for _ in range(cfg.num_layers))
        self.head_transform = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.head_norm = nn.LayerNorm(cfg.hidden_size)
        self.decoder = nn.Linear(cfg.hidden_size, cfg.vocab_size)

    def forward(
        self,
        input_ids_bt: torch.Tensor,
        attention_mask_bt: torch.Tensor,
        token_type_ids_bt: torch.Tensor,
    ) -> torch.Tensor:
        pos_t = torch.arange(input_ids_bt.size(1), device=input_ids_bt.device)
        x_bth = (
            self.word_embeddings(input_ids_bt)
            + self.position_embeddings(pos_t)
            + self.token_type_embeddings(token_type_ids_bt)
        )
        x_bth = self.embeddings_norm(x_bth)
        # Additive mask: 0 where attended, a large negative number where padded.
        keep_b11t = attention_mask_bt[:, None, None, :].to(x_bth.dtype)
        mask_b11t = (1.0 - keep_b11t) * -1e9
        for layer in self.layers:
            x_bth = layer(x_bth, mask_b11t)
        return self.decoder(self.head_norm(F.gelu(self.head_transform(x_bth))))


# --------------------------------------------------------------------------- CNN


@dataclass(frozen=True, kw_only=True)
class CNNConfig:
    in_channels: int = 3
    channels: int = 8
    num_blocks: int = 4
    num_classes: int = 10
    norm: str = "group"  # "group" (microbatch-invariant) or "batch" (has running-stat buffers)


def _norm(kind: str, channels: int) -> nn.Module:
    if kind == "group":
        return nn.GroupNorm(2, channels)
    if kind == "batch":
        return nn.BatchNorm2d(channels)
    raise ValueError(f"norm must be 'group' or 'batch', got {kind!r}")


class ResidualBlock(nn.Module):
    def __init__(self, channels: int, norm: str) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.norm1 = _norm(norm, channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.norm2 = _norm(norm, channels)

    def forward(self, x_bchw: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.norm1(self.conv1(x_bchw)))
        y = self.norm2(self.conv2(y))
        return F.relu(x_bchw + y)


class ResNet(nn.Module):
    def __init__(self, cfg: CNNConfig | None = None) -> None:
        super().__init__()
        cfg = cfg or CNNConfig()
        self.config = cfg
        self.stem = nn.Conv2d(cfg.in_channels, cfg.channels, 3, padding=1, bias=False)
        self.stem_norm = _norm(cfg.norm, cfg.channels)
        self.blocks = nn.Sequential(*(ResidualBlock(cfg.channels, cfg.norm) for _ in range(cfg.num_blocks)))
        self.fc = nn.Linear(cfg.channels, cfg.num_classes)

    def forward(self, images_bchw: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.stem_norm(self.stem(images_bchw)))
        x = self.blocks(x)
        return self.fc(x.mean(dim=(2, 3)))


# --------------------------------------------------------------------------- registry


@dataclass(frozen=True)
class ReferenceModel:
    """A model builder plus deterministic example inputs and a loss for it."""

    name: str
    build: Callable[[], nn.Module]
    make_inputs: Callable[[int, int, int], tuple[torch.Tensor, ...]]  # (batch, seq, seed)
    make_labels: Callable[[int, int, int], torch.Tensor]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    input_names: tuple[str, ...]


def _tokens(vocab: int) -> Callable[[int, int, int], tuple[torch.Tensor, ...]]:
    def make(batch: int, seq: int, seed: int) -> tuple[torch.Tensor, ...]:
        g = torch.Generator().manual_seed(seed)
        return (torch.randint(0, vocab, (batch, seq), generator=g),)

    return make


def _token_labels(vocab: int) -> Callable[[int, int, int], torch.Tensor]:
    def make(batch: int, seq: int, seed: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed + 7919)
        return torch.randint(0, vocab, (batch, seq), generator=g)

    return make


def _bert_inputs(vocab: int) -> Callable[[int, int, int], tuple[torch.Tensor, ...]]:
    def make(batch: int, seq: int, seed: int) -> tuple[torch.Tensor, ...]:
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, vocab, (batch, seq), generator=g)
        lengths = torch.randint(max(1, seq // 2), seq + 1, (batch,), generator=g)
        mask = (torch.arange(seq)[None, :] < lengths[:, None]).long()
        types = (torch.arange(seq)[None, :] >= (lengths[:, None] // 2)).long() * mask
        return ids, mask, types

    return make


def _images(batch: int, _seq: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, 3, 8, 8, generator=g, dtype=torch.float64),)


def _classes(batch: int, _seq: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + 7919)
    return torch.randint(0, 10, (batch,), generator=g)


def lm_loss(logits_btv: torch.Tensor, labels_bt: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy; label -100 is ignored."""
    return F.cross_entropy(
        logits_btv.reshape(-1, logits_btv.size(-1)), labels_bt.reshape(-1), ignore_index=-100
    )


def class_loss(logits_bc: torch.Tensor, labels_b: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits_bc, labels_b)


_V = DecoderConfig().vocab_size

REFERENCE_MODELS: dict[str, ReferenceModel] = {
    "gpt": ReferenceModel("gpt", GPT, _tokens(_V), _token_labels(_V), lm_loss, ("input_ids",)),
    "llama": ReferenceModel("llama", Llama, _tokens(_V), _token_labels(_V), lm_loss, ("input_ids",)),
    "bert": ReferenceModel(
        "bert",
        Bert,
        _bert_inputs(_V),
        _token_labels(_V),
        lm_loss,
        ("input_ids", "attention_mask", "token_type_ids"),
    ),
    "resnet": ReferenceModel("resnet", ResNet, _images, _classes, class_loss, ("images",)),
}


def build_reference(name: str, *, seed: int = 0, dtype: torch.dtype = torch.float64) -> nn.Module:
    """Build reference model ``name`` with a fixed seed, in ``dtype`` (float64 by default)."""
    if name not in REFERENCE_MODELS:
        raise ValueError(f"unknown reference model {name!r}; choose from {sorted(REFERENCE_MODELS)}")
    torch.manual_seed(seed)
    return REFERENCE_MODELS[name].build().to(dtype)


def init_like_gpt2(module: nn.Module, std: float = 0.02) -> None:
    """A transformers-style ``_init_weights`` used to test custom initialisers."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=std)
        if getattr(module, "bias", None) is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.LayerNorm):
        nn.init.ones_(module.weight)
        nn.init.zeros_(module.bias)


__all__ = [
    "Attention",
    "Bert",
    "CNNConfig",
    "DecoderConfig",
    "GPT",
    "Llama",
    "REFERENCE_MODELS",
    "ReferenceModel",
    "ResNet",
    "RMSNorm",
    "build_reference",
    "class_loss",
    "init_like_gpt2",
    "lm_loss",
]

# The reference models' TP plans, registered for these classes (after they are defined), when merak-tp
# is installed (``nox -s package`` tests merak-graph and merak-pipe without it).
if importlib.util.find_spec("merak_tp") is not None:
    from tests.support import tp_plans as _tp_plans  # noqa: F401
