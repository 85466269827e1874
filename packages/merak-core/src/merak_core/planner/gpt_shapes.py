"""GPT- and Llama-shaped decoder models built from a few numbers, for planning without weights.

:func:`build_decoder` returns a plain ``nn.Module`` (token embedding, ``num_layers`` pre-norm
blocks, final norm, vocabulary head, optionally tied to the embedding) built from (layers,
hidden, heads, vocab, seq); under ``merak_graph.empty_init()`` it lives on the meta device and a
70B-parameter model costs no memory. Its linears follow Megatron's naming (``qkv``/``proj`` in
attention, ``fc_in``/``fc_out`` in the MLP), so the TP plan is the usual one.

:data:`PAPER_MODELS` holds the GPT sizes of the Merak paper's experiments and
:data:`REFERENCE_MODELS` a Llama-70B and a GPT-20B shape for the dry-run benchmarks.

Deliberately not here: rotary embeddings, grouped-query attention (``kv_heads`` only shrinks the
key/value projection) and dropout; they do not change the cost or memory much at these sizes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["PAPER_MODELS", "REFERENCE_MODELS", "DecoderShape", "build_decoder", "decoder_inputs"]


@dataclass(frozen=True, kw_only=True)
class DecoderShape:
    """The numbers that fix a decoder's size."""

    num_layers: int
    """Transformer blocks."""
    hidden: int
    """Width of the residual stream."""
    num_heads: int
    """Attention heads (TP must divide it)."""
    vocab_size: int
    """Vocabulary (TP must divide it)."""
    seq_len: int
    """Tokens per sample."""
    ffn_hidden: int | None = None
    """MLP width; None: 4 * hidden (GPT)."""
    num_kv_heads: int | None = None
    """Key/value heads (grouped-query attention); None: ``num_heads``."""
    gated_mlp: bool = False
    """Llama's SwiGLU MLP (three matrices) instead of GPT's GELU MLP (two)."""
    tie_embeddings: bool = True
    """The vocabulary head shares the embedding matrix (a parameter held by the first and last stage)."""

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden", "num_heads", "vocab_size", "seq_len"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"DecoderShape.{name}={v!r}: expected an int >= 1")
        if self.hidden % self.num_heads:
            raise ValueError(
                f"DecoderShape: hidden={self.hidden} is not a multiple of num_heads={self.num_heads}"
            )
        kv = self.kv_heads
        if kv < 1 or self.num_heads % kv:
            raise ValueError(
                f"DecoderShape.num_kv_heads={self.num_kv_heads!r}: expected a divisor of num_heads="
                f"{self.num_heads}"
            )

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads if self.num_kv_heads is not None else self.num_heads

    @property
    def ffn(self) -> int:
        return self.ffn_hidden if self.ffn_hidden is not None else 4 * self.hidden

    def num_parameters(self) -> int:
        """Parameters (tied embedding counted once), from the formula of :func:`build_decoder`."""
        h, f = self.hidden, self.ffn
        kv = h // self.num_heads * self.kv_heads
        attn = h * (h + 2 * kv) + (h + 2 * kv) + h * h + h
        mlp = (3 * h * f if self.gated_mlp else 2 * h * f) + (0 if self.gated_mlp else f + h)
        block = attn + mlp + 4 * h
        emb = self.vocab_size * h * (1 if self.tie_embeddings else 2)
        return self.num_layers * block + emb + self.seq_len * h + 2 * h


# The GPT models of the Merak paper's 64-GPU experiments (hidden, layers and heads of Megatron-LM's
# usual configurations for these sizes; GPT-2 vocabulary padded to a multiple of 128, 1024 tokens).
PAPER_MODELS: dict[str, DecoderShape] = {
    "gpt-1.5b": DecoderShape(num_layers=48, hidden=1600, num_heads=32, vocab_size=50304, seq_len=1024),
    "gpt-2.5b": DecoderShape(num_layers=54, hidden=1920, num_heads=32, vocab_size=50304, seq_len=1024),
    "gpt-8.3b": DecoderShape(num_layers=72, hidden=3072, num_heads=32, vocab_size=50304, seq_len=1024),
    "gpt-20b": DecoderShape(num_layers=44, hidden=6144, num_heads=64, vocab_size=50304, seq_len=1024),
}

REFERENCE_MODELS: dict[str, DecoderShape] = {
    "llama-70b": DecoderShape(
        num_layers=80,
        hidden=8192,
        num_heads=64,
        num_kv_heads=8,
        vocab_size=32000,
        seq_len=4096,
        ffn_hidden=28672,
        gated_mlp=True,
        tie_embeddings=False,
    ),
    "gpt-20b": PAPER_MODELS["gpt-20b"],
}


class _Attention(nn.Module):
    def __init__(self, s: DecoderShape) -> None:
        super().__init__()
        self.num_heads, self.kv_heads, self.head_dim = s.num_heads, s.kv_heads, s.hidden // s.num_heads
        self.qkv = nn.Linear(s.hidden, s.hidden + 2 * self.kv_heads * self.head_dim)
        self.proj = nn.Linear(s.hidden, s.hidden)

    def forward(self, x_bsh: torch.Tensor) -> torch.Tensor:
        b, t, h = x_bsh.shape
        kv = self.kv_heads * self.head_dim
        q, k, v = self.qkv(x_bsh).split([h, kv, kv], dim=-1)
        q = q.view(b, t, -1, self.head_dim).transpose(1, 2)
        k = k.view(b, t, -1, self.head_dim).transpose(1, 2)
        v = v.view(b, t, -1, self.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=self.kv_heads != self.num_heads
        )
        return self.proj(y.transpose(1, 2).reshape(b, t, h))


class _Mlp(nn.Module):
    def __init__(self, s: DecoderShape) -> None:
        super().__init__()
        self.gated = s.gated_mlp
        self.fc_in = nn.Linear(s.hidden, (2 if s.gated_mlp else 1) * s.ffn, bias=not s.gated_mlp)
        self.fc_out = nn.Linear(s.ffn, s.hidden, bias=not s.gated_mlp)

    def forward(self, x_bsh: torch.Tensor) -> torch.Tensor:
        up = self.fc_in(x_bsh)
        if self.gated:
            gate, val = up.chunk(2, dim=-1)
            return self.fc_out(F.silu(gate) * val)
        return self.fc_out(F.gelu(up))


class _Block(nn.Module):
    def __init__(self, s: DecoderShape) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(s.hidden)
        self.attn = _Attention(s)
        self.norm2 = nn.LayerNorm(s.hidden)
        self.mlp = _Mlp(s)

    def forward(self, x_bsh: torch.Tensor) -> torch.Tensor:
        x_bsh = x_bsh + self.attn(self.norm1(x_bsh))
        return x_bsh + self.mlp(self.norm2(x_bsh))


class Decoder(nn.Module):
    """A decoder-only language model of a given :class:`DecoderShape` (returns logits)."""

    def __init__(self, s: DecoderShape) -> None:
        super().__init__()
        self.shape = s
        self.embed = nn.Embedding(s.vocab_size, s.hidden)
        self.pos = nn.Embedding(s.seq_len, s.hidden)
        self.blocks = nn.ModuleList(_Block(s) for _ in range(s.num_layers))
        self.norm = nn.LayerNorm(s.hidden)
        self.head = nn.Linear(s.hidden, s.vocab_size, bias=False)
        if s.tie_embeddings:
            self.head.weight = self.embed.weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x_bsh = self.embed(input_ids) + self.pos(positions)
        for block in self.blocks:
            x_bsh = block(x_bsh)
        return self.head(self.norm(x_bsh))


def build_decoder(shape: DecoderShape, *, dtype: torch.dtype = torch.bfloat16) -> Decoder:
    """A :class:`Decoder` of ``shape`` on the meta device in ``dtype`` (no memory, no initialisation)."""
    from merak_graph import empty_init

    with empty_init():
        model = Decoder(shape)
    return model.to(dtype)


def decoder_inputs(shape: DecoderShape, micro_batch_size: int = 1) -> tuple[torch.Tensor]:
    """Meta example inputs (token ids) for one microbatch."""
    return (torch.zeros(micro_batch_size, shape.seq_len, dtype=torch.long, device="meta"),)
