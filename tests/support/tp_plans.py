"""TP plans for the reference models of ``tests/support/models.py``, registered for their classes.

merak-tp's built-in plans cover transformers families by ``model_type``; these
test models are registered by class (identity, not name), so a user class that
happens to be called ``GPT`` gets no plan by accident.
"""

from __future__ import annotations

import merak_tp
from tests.support.models import GPT, Bert, Llama

GPT_PLAN = merak_tp.TPPlan(
    name="gpt",
    layers={
        "wte": "vocab",
        "blocks.*.attn.q_proj": "column",
        "blocks.*.attn.k_proj": "column",
        "blocks.*.attn.v_proj": "column",
        "blocks.*.attn.o_proj": "row",
        "blocks.*.mlp.fc_in": "column",
        "blocks.*.mlp.fc_out": "row",
        "lm_head": "lm_head",
    },
    attributes={"blocks.*.attn": ("num_heads", "num_kv_heads")},
    regions=("blocks.*.attn", "blocks.*.mlp"),
    rng_regions=("blocks.*.attn",),
    sequence_scatter=("blocks.0",),
    sequence_full=("wte", "wpe"),
)

LLAMA_PLAN = merak_tp.TPPlan(
    name="llama",
    layers={
        "layers.*.self_attn.q_proj": "column",
        "layers.*.self_attn.k_proj": "column",
        "layers.*.self_attn.v_proj": "column",
        "layers.*.self_attn.o_proj": "row",
        "layers.*.mlp.gate_proj": "column",
        "layers.*.mlp.up_proj": "column",
        "layers.*.mlp.down_proj": "row",
        "embed_tokens": "vocab",
        "lm_head": "lm_head",
    },
    attributes={"layers.*.self_attn": ("num_heads", "num_kv_heads")},
    regions=("layers.*.self_attn", "layers.*.mlp"),
    rng_regions=("layers.*.self_attn",),
    sequence_scatter=("layers.0",),
    sequence_full=("embed_tokens",),
)

BERT_PLAN = merak_tp.TPPlan(
    name="bert",
    layers={
        "word_embeddings": "vocab",
        "layers.*.attention.q_proj": "column",
        "layers.*.attention.k_proj": "column",
        "layers.*.attention.v_proj": "column",
        "layers.*.attention.o_proj": "row",
        "layers.*.intermediate": "column",
        "layers.*.output": "row",
        "decoder": "lm_head",
    },
    attributes={"layers.*.attention": ("num_heads", "num_kv_heads")},
    regions=("layers.*.attention",),
    rng_regions=("layers.*.attention",),
    sequence_scatter=("layers.0",),
    sequence_full=("word_embeddings", "position_embeddings", "token_type_embeddings", "embeddings_norm"),
)

for _plan, _cls in ((GPT_PLAN, GPT), (LLAMA_PLAN, Llama), (BERT_PLAN, Bert)):
    merak_tp.register_plan(_plan, classes=(_cls,), overwrite=True)
