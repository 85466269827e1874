"""A user's transformers model for ``merak train``: a small Llama, randomly initialised (no download).

Nothing here is Merak-specific: the factory returns ``transformers.LlamaForCausalLM``
as any Hugging Face user would build it. Merak picks the built-in TP plan for
Llama, traces the model, cuts it into pipeline stages and trains it.
Needs the optional extra: ``pip install -c constraints.txt transformers safetensors``.
"""

from __future__ import annotations

from typing import Any


def build_llama(
    *,
    vocab_size: int = 13,
    hidden_size: int = 64,
    num_layers: int = 4,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    context: int = 16,
    **config: Any,
) -> Any:
    """``LlamaForCausalLM`` from a small ``LlamaConfig`` (``use_cache=False``: training needs no KV cache)."""
    try:
        import transformers
    except ImportError as exc:
        raise ImportError(
            "this example needs transformers: pip install -c constraints.txt transformers safetensors"
        ) from exc
    cfg = transformers.LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=4 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=context,
        use_cache=False,
        **config,
    )
    return transformers.LlamaForCausalLM(cfg)
