"""TP plans: which module gets which parallel style, and built-in plans by model type.

A plan maps module-name patterns (``fnmatch`` style, ``*`` matches any text
including dots) to styles:

``"column"``      ``ColumnParallelLinear`` (output features split)
``"column_qkv"``  a fused q/k/v projection: each of the 3 sections split separately
``"row"``         ``RowParallelLinear`` (input features split, output all-reduced)
``"vocab"``       ``VocabParallelEmbedding``
``"lm_head"``     column over the vocabulary; gathers the logits unless the plan
                  (or ``parallelize``) asks for the vocab-parallel loss
``"replicate"``   left as is (documentation; unmatched modules are replicated)

plus the per-rank attributes to divide (head counts, fused split sizes), the
*regions* (column -> local -> row blocks, for overlap and sequence parallel),
and where sequence parallelism starts. A user plan for their own model is a
few lines::

    plan = TPPlan(name="mine", layers={"layers.*.fc1": "column", "layers.*.fc2": "row"},
                  regions=("layers.*",))
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import nn

__all__ = ["STYLES", "TPPlan", "get_plan", "plan_for_model", "register_plan"]

STYLES = ("column", "column_qkv", "row", "vocab", "lm_head", "replicate")


@dataclass(frozen=True, kw_only=True)
class TPPlan:
    """How to tensor-parallelize one model family."""

    name: str
    """Registry name of the plan."""
    layers: Mapping[str, str]
    """Module-name pattern -> style (one of ``STYLES``); the first matching pattern wins."""
    attributes: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    """Module-name pattern -> names of integer attributes divided by the TP size (head counts...)."""
    regions: tuple[str, ...] = ()
    """Patterns of modules that are 'column layers -> local compute -> one row layer' blocks."""
    sequence_scatter: tuple[str, ...] = ()
    """Patterns of modules whose first input enters sequence parallelism (split along the sequence)."""
    sequence_gather: tuple[str, ...] = ()
    """Patterns of modules whose first input leaves sequence parallelism (all-gathered). Empty: the
    LM head (a column layer) gathers the sequence itself."""
    sequence_full: tuple[str, ...] = ()
    """Patterns of modules that run on the full sequence: before ``sequence_scatter`` or from
    ``sequence_gather`` on (their replicated parameters' gradients are already complete)."""
    rng_regions: tuple[str, ...] = ()
    """Patterns of regions whose dropout acts only on sharded activations (e.g. attention probabilities
    of the local heads): with ``parallelize(..., rng_tracker=...)`` they run inside ``fork("tp")``. A
    region that drops a replicated tensor (dropout after its row layer) must not be listed."""
    vocab_parallel_loss: bool = False
    """Leave the LM head's logits vocab-sharded (use ``vocab_parallel_cross_entropy``)."""
    fixup: Callable[[nn.Module, str, int], None] | None = None
    """Called as ``fixup(module, name, tp)`` for every module after sharding, to fix other attributes."""

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("TPPlan.name must be a non-empty string")
        bad = {p: s for p, s in self.layers.items() if s not in STYLES}
        if bad:
            raise ValueError(f"TPPlan {self.name!r}: unknown styles {bad}; expected one of {STYLES}")

    def with_options(self, **changes: Any) -> TPPlan:
        """A copy with some fields changed (e.g. ``vocab_parallel_loss=True``)."""
        return dataclasses.replace(self, **changes)


_PLANS: dict[str, TPPlan] = {}
_BY_TYPE: dict[str, str] = {}


def register_plan(plan: TPPlan, *, model_types: tuple[str, ...] = (), overwrite: bool = False) -> TPPlan:
    """Register ``plan`` under its name, and as the default for class names / HF ``model_type``s."""
    if plan.name in _PLANS and not overwrite:
        raise ValueError(f"a TP plan named {plan.name!r} exists; pass overwrite=True to replace it")
    _PLANS[plan.name] = plan
    for t in model_types:
        _BY_TYPE[t] = plan.name
    return plan


def get_plan(name: str) -> TPPlan:
    """The registered plan called ``name``."""
    if name not in _PLANS:
        raise ValueError(f"unknown TP plan {name!r}; registered plans: {sorted(_PLANS)}")
    return _PLANS[name]


def plan_for_model(model: nn.Module) -> TPPlan:
    """The built-in plan for ``model``, by class name, then by ``model.config.model_type``."""
    for cls in type(model).__mro__:
        if cls.__name__ in _BY_TYPE:
            return _PLANS[_BY_TYPE[cls.__name__]]
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if isinstance(model_type, str) and model_type in _BY_TYPE:
        return _PLANS[_BY_TYPE[model_type]]
    raise ValueError(
        f"no built-in TP plan for {type(model).__name__} (model_type={model_type!r}); built-in plans cover "
        f"{sorted(_BY_TYPE)}. Write a TPPlan (module-name patterns -> 'column'/'row'/'vocab'/'lm_head') "
        "and pass it as parallelize(model, plan, group=...), or register_plan(plan, model_types=(...,))"
    )


# --------------------------------------------------------------------------- built-in plans

register_plan(TPPlan(
    name="gpt",
    layers={
        "wte": "vocab",
        "blocks.*.attn.q_proj": "column", "blocks.*.attn.k_proj": "column", "blocks.*.attn.v_proj": "column",
        "blocks.*.attn.o_proj": "row",
        "blocks.*.mlp.fc_in": "column", "blocks.*.mlp.fc_out": "row",
        "lm_head": "lm_head",
    },
    attributes={"blocks.*.attn": ("num_heads", "num_kv_heads")},
    regions=("blocks.*.attn", "blocks.*.mlp"),
    rng_regions=("blocks.*.attn",),
    sequence_scatter=("blocks.0",),
    sequence_full=("wte", "wpe"),
), model_types=("GPT",))

register_plan(TPPlan(
    name="llama",
    layers={
        "layers.*.self_attn.q_proj": "column", "layers.*.self_attn.k_proj": "column",
        "layers.*.self_attn.v_proj": "column", "layers.*.self_attn.o_proj": "row",
        "layers.*.mlp.gate_proj": "column", "layers.*.mlp.up_proj": "column", "layers.*.mlp.down_proj": "row",
        "embed_tokens": "vocab", "lm_head": "lm_head",
    },
    attributes={"layers.*.self_attn": ("num_heads", "num_kv_heads")},
    regions=("layers.*.self_attn", "layers.*.mlp"),
    rng_regions=("layers.*.self_attn",),
    sequence_scatter=("layers.0",),
    sequence_full=("embed_tokens",),
), model_types=("Llama",))

register_plan(TPPlan(
    name="bert",
    layers={
        "word_embeddings": "vocab",
        "layers.*.attention.q_proj": "column", "layers.*.attention.k_proj": "column",
        "layers.*.attention.v_proj": "column", "layers.*.attention.o_proj": "row",
        "layers.*.intermediate": "column", "layers.*.output": "row",
        "decoder": "lm_head",
    },
    attributes={"layers.*.attention": ("num_heads", "num_kv_heads")},
    regions=("layers.*.attention",),
    rng_regions=("layers.*.attention",),
    sequence_scatter=("layers.0",),
    sequence_full=("word_embeddings", "position_embeddings", "token_type_embeddings", "embeddings_norm"),
), model_types=("Bert",))


def _hf_heads(module: nn.Module, name: str, tp: int) -> None:
    """transformers attention modules: record per-rank head counts as ``num_heads``/``num_kv_heads``."""
    config = getattr(module, "config", None)
    if config is None or not hasattr(module, "q_proj") or not hasattr(config, "num_attention_heads"):
        return
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    for what, n in (("num_attention_heads", heads), ("num_key_value_heads", kv_heads)):
        if n % tp:
            raise ValueError(f"{name}: {what}={n} is not divisible by the tensor-parallel size {tp}; "
                             f"choose a TP degree that divides {n}")
    module.num_heads = heads // tp  # type: ignore[assignment]
    module.num_kv_heads = kv_heads // tp  # type: ignore[assignment]


register_plan(TPPlan(
    name="hf_gpt2",
    layers={
        "*wte": "vocab",
        "*h.*.attn.c_attn": "column_qkv", "*h.*.attn.c_proj": "row",
        "*h.*.mlp.c_fc": "column", "*h.*.mlp.c_proj": "row",
        "lm_head": "lm_head",
    },
    attributes={"*h.*.attn": ("num_heads", "split_size", "embed_dim")},
    regions=("*h.*.attn", "*h.*.mlp"),
    sequence_scatter=("*h.0",),
    # GPT2Model reshapes after ln_f with the input's sequence length: leave SP before ln_f.
    sequence_gather=("*ln_f",),
    sequence_full=("*wte", "*wpe", "*ln_f"),
), model_types=("gpt2",))

_HF_LLAMA_LAYERS = {
    "*layers.*.self_attn.q_proj": "column", "*layers.*.self_attn.k_proj": "column",
    "*layers.*.self_attn.v_proj": "column", "*layers.*.self_attn.o_proj": "row",
    "*layers.*.mlp.gate_proj": "column", "*layers.*.mlp.up_proj": "column", "*layers.*.mlp.down_proj": "row",
    "*embed_tokens": "vocab", "lm_head": "lm_head",
}
for _name in ("llama", "qwen2"):
    register_plan(TPPlan(
        name=f"hf_{_name}",
        layers=_HF_LLAMA_LAYERS,
        regions=("*layers.*.self_attn", "*layers.*.mlp"),
        rng_regions=("*layers.*.self_attn",),
        sequence_scatter=("*layers.0",),
        sequence_full=("*embed_tokens",),
        fixup=_hf_heads,
    ), model_types=(_name,))

register_plan(TPPlan(
    name="hf_bert",
    layers={
        "*word_embeddings": "vocab",
        "*attention.self.query": "column", "*attention.self.key": "column", "*attention.self.value": "column",
        "*attention.output.dense": "row",
        "*intermediate.dense": "column", "*layer.*.output.dense": "row",
        "cls.predictions.decoder": "lm_head",
    },
    attributes={"*attention.self": ("num_attention_heads", "all_head_size")},
    # Not a full column -> row block (the row layer is in BertSelfOutput): a region so that sequence
    # parallelism gathers the sequence once for q/k/v; overlap stays at the layer level.
    regions=("*attention.self",),
    rng_regions=("*attention.self",),
    sequence_scatter=("*encoder.layer.0",),
    sequence_full=("*embeddings.*",),
), model_types=("bert",))
