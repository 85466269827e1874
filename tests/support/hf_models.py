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
