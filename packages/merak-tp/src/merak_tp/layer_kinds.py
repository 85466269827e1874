"""Which parallel layer replaces a module under a plan style, and building it from the module.

Owns the kind of a module under a style (:func:`_kind`: its stock kind, a transformers ``Conv1D``,
or the kind the plan declares in ``module_kinds``; see [Note: stock forwards] in
:mod:`merak_tp.parallelize`) and the construction of the replacement layer by slicing the module's
weights (:func:`_build`: vocab-parallel embeddings, column/row-parallel linears, sharded experts and
norms). Matching the plan's patterns and swapping the layers in stay in :mod:`merak_tp.parallelize`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed import ProcessGroup

from merak_tp.embedding import VocabParallelEmbedding
from merak_tp.linear import ColumnParallelLinear, RowParallelLinear
from merak_tp.moe_norm import ShardedRMSNorm, shard_experts
from merak_tp.plans import TPPlan


def _is_conv1d(module: nn.Module) -> bool:
    cls = type(module)
    return cls.__name__ == "Conv1D" and cls.__module__.startswith("transformers") and hasattr(module, "nf")


_NEEDS = {
    "vocab": "an nn.Embedding",
    "experts": "a transformers experts module",
    "sharded_norm": "an RMSNorm",
}


def _kind(module: nn.Module, name: str, style: str, plan: TPPlan) -> str:
    """How ``module`` is sharded under ``style``: its stock kind, or the kind the plan declares for its class.

    See [Note: stock forwards].
    """
    if style in ("experts", "sharded_norm"):
        return style
    cls = type(module)
    declared = plan.module_kinds.get(cls.__name__)
    if style == "vocab":
        if declared in ("embedding", "scaled_embedding") and isinstance(module, nn.Embedding):
            return declared
        if isinstance(module, nn.Embedding) and cls.forward is nn.Embedding.forward:
            return "embedding"
        base, what = "nn.Embedding", "a plain lookup of its rows"
        fixes = "'embedding' (a plain lookup) or 'scaled_embedding' (rows times module.embed_scale)"
    else:
        if _is_conv1d(module):
            return "conv1d"
        if declared == "linear" and isinstance(module, nn.Linear):
            return "linear"
        if isinstance(module, nn.Linear) and cls.forward is nn.Linear.forward:
            return "linear"
        base, what, fixes = "nn.Linear", "x @ weight.T + bias", "'linear'"
    if not isinstance(module, nn.Embedding if style == "vocab" else nn.Linear):
        raise ValueError(
            f"{name}: style {style!r} needs an {base} (or transformers Conv1D, or a class the plan "
            f"declares in module_kinds), got {cls.__name__}; give {name!r} another style or "
            "leave it replicated"
        )
    raise ValueError(
        f"{name}: {cls.__module__}.{cls.__qualname__} subclasses {base} but overrides forward, so replacing it "
        f"by a parallel layer could change the result. If its forward computes exactly {what}, declare it in "
        f"the plan: module_kinds={{{cls.__name__!r}: {fixes}}}; otherwise leave {name!r} replicated "
        "(style 'replicate' or no pattern)"
    )


def _build(
    module: nn.Module,
    name: str,
    style: str,
    kind: str,
    sections: Any,
    *,
    group: ProcessGroup | None,
    chunks: int,
    sp: bool,
    in_region: bool,
    vocab_loss: bool,
    head_sp: bool,
) -> nn.Module:
    if kind == "experts":
        return shard_experts(module, name, group=group)
    if kind == "sharded_norm":
        return ShardedRMSNorm.from_norm(module, name, group=group)
    if style == "vocab":
        if kind == "scaled_embedding":
            scale = getattr(module, "embed_scale", None)
            if not isinstance(scale, (torch.Tensor, float, int)):
                raise ValueError(
                    f"{name}: declared 'scaled_embedding' but {type(module).__name__} has no "
                    f"embed_scale (got {scale!r})"
                )
            return VocabParallelEmbedding.from_embedding(module, group=group, embed_scale=scale)  # type: ignore[arg-type]
        return VocabParallelEmbedding.from_embedding(module, group=group)  # type: ignore[arg-type]
    transposed = kind == "conv1d"
    if style in ("column", "column_qkv", "lm_head"):
        return ColumnParallelLinear.from_linear(
            module,
            group=group,
            gather_output=style == "lm_head" and not vocab_loss,
            sequence_parallel=sp and not in_region and (style != "lm_head" or head_sp),
            overlap_chunks=chunks,
            sections=3 if style == "column_qkv" else sections,
            transposed=transposed,
        )
    if style == "row":
        return RowParallelLinear.from_linear(
            module, group=group, sequence_parallel=sp, overlap_chunks=chunks, transposed=transposed
        )
    raise AssertionError(style)


__all__: list[str] = []  # the layer construction internals of merak_tp.parallelize
