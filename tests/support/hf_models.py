"""Tiny transformers configurations shared by every package's tests (one factory per family).

Imported only where ``transformers`` is installed; nothing is downloaded.
"""

from __future__ import annotations

from typing import Any


def tiny_gpt2_config(vocab_size: int, **overrides: Any) -> Any:
    """The tests' tiny GPT-2: 2 layers, width 32, 4 heads, 64 positions, no dropout.

    ``overrides`` replace or add ``GPT2Config`` fields (``use_cache=False``, token ids, ...).
    """
    import transformers as tf

    fields: dict[str, Any] = {
        "vocab_size": vocab_size,
        "n_embd": 32,
        "n_layer": 2,
        "n_head": 4,
        "n_positions": 64,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
    }
    return tf.GPT2Config(**{**fields, **overrides})


def tiny_decoder_fields(vocab_size: int, **overrides: Any) -> dict[str, Any]:
    """The tests' tiny Llama-shaped decoder (Llama, Qwen2, Mistral, ... take the same fields).

    2 layers, width 32, MLP 64, 4 query and 2 key/value heads, 64 positions; ``overrides`` replace
    or add fields. Returns the keyword arguments of the family's config class.
    """
    fields: dict[str, Any] = {
        "vocab_size": vocab_size,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
    }
    return {**fields, **overrides}
