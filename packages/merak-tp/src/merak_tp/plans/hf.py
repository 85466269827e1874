"""Built-in plans for transformers model families, registered by ``config.model_type``.

Every plan here is Megatron's split: the attention's query/key/value projections
column parallel (whole heads per rank) and its output projection row parallel;
the MLP's up (and gate) projections column parallel and its down projection row
parallel; the token embedding split along the vocabulary and the LM head column
parallel over it. Norms, position embeddings and routers are replicated.

Mixture-of-experts blocks (Mixtral, Qwen3-MoE, DeepSeek-V3) keep every expert on every rank
and split each expert's gate/up projection by columns and its down projection
by rows (style ``experts``). The router stays replicated, so every rank routes
every token to the same experts and the block needs one all-reduce, like a dense
MLP; the load per rank is balanced whatever the routing (experts split across
ranks would need an all-to-all and would load the ranks as unevenly as the
router chooses). The experts module routes tokens with data-dependent shapes
(``nonzero``), which torch.export cannot trace, while its output is always
``[tokens, hidden]``: the plans name it a trace leaf, so pipeline stages keep it
opaque with or without TP (``trace_leaves``). Sequence parallelism is refused:
the block takes every token on every rank.

transformers is not imported here: modules are matched by name and class name.
"""

from __future__ import annotations

import copy
from typing import Any

from torch import nn

from merak_tp.latent_kv import LatentKVProjection
from merak_tp.linear import ColumnParallelLinear
from merak_tp.plans._plan import TPPlan, register_plan

__all__: list[str] = []


def _config(model: nn.Module) -> Any:
    config = getattr(model, "config", None)
    return getattr(config, "text_config", None) or config


def _heads(config: Any) -> tuple[int, int]:
    heads = int(config.num_attention_heads)
    kv = getattr(config, "num_key_value_heads", None) or heads
    return heads, int(kv)


def _head_dim(config: Any) -> int:
    heads, _ = _heads(config)
    return int(getattr(config, "head_dim", None) or config.hidden_size // heads)


def _check_heads(model: nn.Module, tp: int) -> None:
    """Query and key/value heads must split evenly: every rank keeps whole heads and their kv heads."""
    config = _config(model)
    if config is None or not hasattr(config, "num_attention_heads"):
        return
    heads, kv = _heads(config)
    if heads % tp:
        raise ValueError(
            f"{type(model).__name__}: num_attention_heads={heads} is not divisible by the "
            f"tensor-parallel size {tp}; choose a TP degree that divides {heads}"
        )
    if kv % tp:
        extra = (
            " (replicating key/value heads over ranks when tp > num_key_value_heads is not supported: "
            "each replica's gradient would need a sum over its ranks)"
            if kv < tp
            else ""
        )
        raise ValueError(
            f"{type(model).__name__}: num_key_value_heads={kv} is not divisible by the "
            f"tensor-parallel size {tp}{extra}; choose a TP degree that divides {kv}"
        )


def _record_heads(module: nn.Module, name: str, tp: int) -> None:
    """Attention modules holding ``config``: record per-rank head counts (``num_heads``/``num_kv_heads``)."""
    config = getattr(module, "config", None)
    if config is None or not name.endswith("attn") or not hasattr(config, "num_attention_heads"):
        return
    heads, kv = _heads(config)
    module.num_heads = heads // tp  # type: ignore[assignment]
    module.num_kv_heads = kv // tp  # type: ignore[assignment]


def _phi3_fixup(module: nn.Module, name: str, tp: int) -> None:
    """Phi-3 attention splits its fused q/k/v output at ``config.num_attention_heads * head_dim``: give
    each attention module a copy of the config with the per-rank head count."""
    _record_heads(module, name, tp)
    if type(module).__name__ == "Phi3Attention":
        config: Any = copy.copy(module.config)
        config.num_attention_heads = config.num_attention_heads // tp
        config.num_key_value_heads = config.num_key_value_heads // tp
        module.config = config  # type: ignore[assignment]
        module.num_key_value_heads = module.num_key_value_heads // tp  # type: ignore[operator,assignment]


def _qkv_sections(model: nn.Module) -> tuple[int, int, int]:
    """Grouped-query fused q/k/v: ``[heads*d, kv_heads*d, kv_heads*d]``."""
    config = _config(model)
    heads, kv = _heads(config)
    d = _head_dim(config)
    return heads * d, kv * d, kv * d


def _falcon_check(model: nn.Module, tp: int) -> None:
    config = _config(model)
    if getattr(config, "alibi", False):
        raise ValueError(
            "Falcon with alibi=True: the per-head ALiBi slopes are not split over TP ranks; "
            "use tp=1 or a rotary Falcon (alibi=False)"
        )
    if (
        getattr(config, "multi_query", False)
        and not getattr(config, "new_decoder_architecture", False)
        and tp > 1
    ):
        raise ValueError(
            "Falcon multi-query attention (one key/value head, multi_query=True) cannot be split "
            f"over tp={tp} ranks (the key/value head would be replicated); use tp=1, or "
            "new_decoder_architecture=True with num_kv_heads divisible by tp"
        )
    heads = int(config.num_attention_heads)
    kv = int(config.num_kv_heads) if getattr(config, "new_decoder_architecture", False) else heads
    for what, n in (("num_attention_heads", heads), ("num_kv_heads", kv)):
        if n % tp:
            raise ValueError(
                f"Falcon: {what}={n} is not divisible by the tensor-parallel size {tp}; choose a TP "
                f"degree that divides {n}"
            )


_GEMMA_EMBEDDINGS = {f"{g}TextScaledWordEmbedding": "scaled_embedding" for g in ("Gemma", "Gemma2", "Gemma3")}

_ATTN = {
    "*layers.*.self_attn.q_proj": "column",
    "*layers.*.self_attn.k_proj": "column",
    "*layers.*.self_attn.v_proj": "column",
    "*layers.*.self_attn.o_proj": "row",
}
_GATED_MLP = {
    "*layers.*.mlp.gate_proj": "column",
    "*layers.*.mlp.up_proj": "column",
    "*layers.*.mlp.down_proj": "row",
}
_ENDS = {"*embed_tokens": "vocab", "lm_head": "lm_head"}


def _decoder_plan(name: str, layers: dict[str, str], **kw: Any) -> TPPlan:
    kw.setdefault("regions", ("*layers.*.self_attn", "*layers.*.mlp"))
    kw.setdefault("check", _check_heads)
    kw.setdefault("fixup", _record_heads)
    return TPPlan(
        name=name,
        layers=layers,
        rng_regions=("*layers.*.self_attn",),
        sequence_scatter=("*layers.0",),
        sequence_full=("*embed_tokens",),
        optional=("lm_head",),
        **kw,
    )


_HEAD_NORMS = {"*layers.*.self_attn.q_norm": "per_head", "*layers.*.self_attn.k_norm": "per_head"}

for _t in ("llama", "mistral", "qwen2"):
    register_plan(_decoder_plan(f"hf_{_t}", {**_ATTN, **_GATED_MLP, **_ENDS}), model_types=(_t,))
register_plan(
    _decoder_plan("hf_qwen3", {**_ATTN, **_HEAD_NORMS, **_GATED_MLP, **_ENDS}), model_types=("qwen3",)
)

for _t in ("gemma", "gemma2"):
    register_plan(
        _decoder_plan(f"hf_{_t}", {**_ATTN, **_GATED_MLP, **_ENDS}, module_kinds=_GEMMA_EMBEDDINGS),
        model_types=(_t,),
    )
register_plan(
    _decoder_plan(
        "hf_gemma3_text", {**_ATTN, **_HEAD_NORMS, **_GATED_MLP, **_ENDS}, module_kinds=_GEMMA_EMBEDDINGS
    ),
    model_types=("gemma3_text",),
)

register_plan(
    _decoder_plan(
        "hf_olmo2",
        {
            **_ATTN,
            "*layers.*.self_attn.q_norm": "sharded_norm",
            "*layers.*.self_attn.k_norm": "sharded_norm",
            **_GATED_MLP,
            **_ENDS,
        },
    ),
    model_types=("olmo2",),
)

register_plan(
    _decoder_plan(
        "hf_starcoder2", {**_ATTN, "*layers.*.mlp.c_fc": "column", "*layers.*.mlp.c_proj": "row", **_ENDS}
    ),
    model_types=("starcoder2",),
)

register_plan(
    _decoder_plan(
        "hf_phi3",
        {
            "*layers.*.self_attn.qkv_proj": "column",
            "*layers.*.self_attn.o_proj": "row",
            "*layers.*.mlp.gate_up_proj": "column",
            "*layers.*.mlp.down_proj": "row",
            **_ENDS,
        },
        sections={"*layers.*.self_attn.qkv_proj": _qkv_sections, "*layers.*.mlp.gate_up_proj": 2},
        fixup=_phi3_fixup,
    ),
    model_types=("phi3",),
)

_MOE_NO_SP = (
    "its experts block takes every token of the sequence on every rank (the router is replicated and "
    "the experts' partial sums are all-reduced over whole tokens); sequence parallelism would need the "
    "block to gather the sequence first, which this plan does not do"
)

for _t, _extra in (("mixtral", {}), ("qwen3_moe", _HEAD_NORMS)):
    _mlp = _GATED_MLP if _t == "qwen3_moe" else {}  # dense MLPs in the layers listed in mlp_only_layers
    register_plan(
        _decoder_plan(
            f"hf_{_t}",
            {
                **_ATTN,
                **_extra,
                "*layers.*.mlp.experts": "experts",
                "*layers.*.mlp.gate": "replicate",
                **_mlp,
                **_ENDS,
            },
            regions=("*layers.*.self_attn",),
            sequence_parallel=False,
            sequence_parallel_note=_MOE_NO_SP,
            trace_leaves=("*layers.*.mlp.experts",),
            attributes={"*layers.*.mlp.experts": ("intermediate_dim",)},
        ).with_options(optional=("lm_head", *_mlp)),
        model_types=(_t,),
    )


def _deepseek_v3_fixup(module: nn.Module, name: str, tp: int) -> None:
    """Multi-head latent attention: the shared rotary key's gradient summed over the TP ranks.

    Each rank expands the rotary key over its own heads, so that slice of ``kv_a_proj_with_mqa``'s output
    gradient is partial; the latent's comes back whole through ``kv_b_proj`` (a column layer all-reduces its
    input gradient). ``LatentKVProjection`` sums the rotary slice in backward, so the projection, the
    attention's input and every replicated parameter before them get the full gradient.
    """
    _record_heads(module, name, tp)
    if tp > 1 and type(module).__name__ == "DeepseekV3Attention":
        kv_b, kv_a = module.kv_b_proj, module.kv_a_proj_with_mqa
        if not isinstance(kv_b, ColumnParallelLinear) or not isinstance(kv_a, nn.Linear):
            raise ValueError(
                f"{name}: expected kv_b_proj sharded by columns and kv_a_proj_with_mqa an nn.Linear, got "
                f"{type(kv_b).__name__} and {type(kv_a).__name__}; a plan for DeepSeek-V3 must shard kv_b_proj "
                "'column' and leave kv_a_proj_with_mqa replicated"
            )
        rotary = int(module.qk_rope_head_dim)  # type: ignore[arg-type]
        module.kv_a_proj_with_mqa = LatentKVProjection(kv_a, rotary, group=kv_b.group)


_DEEPSEEK_OPTIONAL = (
    "*layers.*.self_attn.q_proj",  # without q_lora_rank
    "*layers.*.self_attn.q_b_proj",  # with q_lora_rank
    *_GATED_MLP,  # dense MLPs in the first first_k_dense_replace layers
    "*layers.*.mlp.shared_experts.gate_proj",
    "*layers.*.mlp.shared_experts.up_proj",
    "*layers.*.mlp.shared_experts.down_proj",
)

# DeepSeek-V3: multi-head latent attention (q_a_proj, q_a_layernorm, kv_a_proj_with_mqa and
# kv_a_layernorm replicated; the head-major q_proj / q_b_proj and kv_b_proj column, o_proj row), the
# routed experts as Mixtral's, shared experts and dense MLPs column/row. No regions: every column
# layer all-reduces its own input gradient, which the latent's exact gradient relies on.
register_plan(
    _decoder_plan(
        "hf_deepseek_v3",
        {
            "*layers.*.self_attn.q_proj": "column",
            "*layers.*.self_attn.q_b_proj": "column",
            "*layers.*.self_attn.kv_b_proj": "column",
            "*layers.*.self_attn.o_proj": "row",
            "*layers.*.mlp.experts": "experts",
            "*layers.*.mlp.gate": "replicate",
            "*layers.*.mlp.shared_experts.gate_proj": "column",
            "*layers.*.mlp.shared_experts.up_proj": "column",
            "*layers.*.mlp.shared_experts.down_proj": "row",
            **_GATED_MLP,
            **_ENDS,
        },
        regions=(),
        fixup=_deepseek_v3_fixup,
        sequence_parallel=False,
        sequence_parallel_note=_MOE_NO_SP,
        trace_leaves=("*layers.*.mlp.experts",),
        attributes={"*layers.*.mlp.experts": ("intermediate_dim",)},
    ).with_options(optional=("lm_head", *_DEEPSEEK_OPTIONAL)),
    model_types=("deepseek_v3",),
)


register_plan(
    TPPlan(
        name="hf_gpt2",
        layers={
            "*wte": "vocab",
            "*h.*.attn.c_attn": "column_qkv",
            "*h.*.attn.c_proj": "row",
            "*h.*.mlp.c_fc": "column",
            "*h.*.mlp.c_proj": "row",
            "lm_head": "lm_head",
        },
        attributes={"*h.*.attn": ("num_heads", "split_size", "embed_dim")},
        regions=("*h.*.attn", "*h.*.mlp"),
        sequence_scatter=("*h.0",),
        # GPT2Model reshapes after ln_f with the input's sequence length: leave SP before ln_f.
        sequence_gather=("*ln_f",),
        sequence_full=("*wte", "*wpe", "*ln_f"),
        optional=("lm_head",),
    ),
    model_types=("gpt2",),
)

register_plan(
    TPPlan(
        name="hf_gpt_neox",
        # The fused q/k/v output is laid out head by head ([q k v] of head 0, then head 1...): a plain
        # column split keeps whole heads.
        layers={
            "*embed_in": "vocab",
            "*layers.*.attention.query_key_value": "column",
            "*layers.*.attention.dense": "row",
            "*layers.*.mlp.dense_h_to_4h": "column",
            "*layers.*.mlp.dense_4h_to_h": "row",
            "embed_out": "lm_head",
            "lm_head": "lm_head",
        },
        regions=("*layers.*.attention", "*layers.*.mlp"),
        rng_regions=("*layers.*.attention",),
        sequence_scatter=("*layers.0",),
        sequence_full=("*embed_in",),
        optional=("embed_out", "lm_head"),
        check=_check_heads,
    ),
    model_types=("gpt_neox",),
)

register_plan(
    TPPlan(
        name="hf_falcon",
        # Fused q/k/v laid out per head ([q k v] per head) or, in the new decoder architecture, per
        # key/value group ([q.. k v] per group): a plain column split keeps whole heads and groups.
        layers={
            "*word_embeddings": "vocab",
            "*h.*.self_attention.query_key_value": "column",
            "*h.*.self_attention.dense": "row",
            "*h.*.mlp.dense_h_to_4h": "column",
            "*h.*.mlp.dense_4h_to_h": "row",
            "lm_head": "lm_head",
        },
        module_kinds={"FalconLinear": "linear"},
        attributes={"*h.*.self_attention": ("num_heads", "num_kv_heads")},
        regions=("*h.*.self_attention", "*h.*.mlp"),
        rng_regions=("*h.*.self_attention",),
        sequence_scatter=("*h.0",),
        sequence_full=("*word_embeddings",),
        optional=("lm_head",),
        check=_falcon_check,
    ),
    model_types=("falcon",),
)

register_plan(
    TPPlan(
        name="hf_opt",
        layers={
            "*decoder.embed_tokens": "vocab",
            "*layers.*.self_attn.q_proj": "column",
            "*layers.*.self_attn.k_proj": "column",
            "*layers.*.self_attn.v_proj": "column",
            "*layers.*.self_attn.out_proj": "row",
            "*layers.*.fc1": "column",
            "*layers.*.fc2": "row",
            "lm_head": "lm_head",
        },
        attributes={"*layers.*.self_attn": ("num_heads", "embed_dim")},
        regions=("*layers.*.self_attn",),
        rng_regions=("*layers.*.self_attn",),
        sequence_scatter=("*layers.0",),
        sequence_full=("*decoder.embed_tokens", "*decoder.embed_positions", "*decoder.project_in"),
        sequence_parallel=False,
        sequence_parallel_note="OPTDecoderLayer flattens batch and sequence into one dim around its MLP (fc1/fc2), "
        "so a sequence-sharded residual stream would be reshaped wrongly",
        optional=("lm_head",),
        check=_check_heads,
    ),
    model_types=("opt",),
)

register_plan(
    TPPlan(
        name="hf_bert",
        layers={
            "*word_embeddings": "vocab",
            "*attention.self.query": "column",
            "*attention.self.key": "column",
            "*attention.self.value": "column",
            "*attention.output.dense": "row",
            "*intermediate.dense": "column",
            "*layer.*.output.dense": "row",
            "cls.predictions.decoder": "lm_head",
        },
        attributes={"*attention.self": ("num_attention_heads", "all_head_size")},
        # Not a full column -> row block (the row layer is in BertSelfOutput): a region so that sequence
        # parallelism gathers the sequence once for q/k/v; overlap stays at the layer level.
        regions=("*attention.self",),
        rng_regions=("*attention.self",),
        sequence_scatter=("*encoder.layer.0",),
        sequence_full=("*embeddings.*",),
        optional=("cls.predictions.decoder",),
    ),
    model_types=("bert",),
)
