"""merak_tp: tensor-parallel layers with sub-pipelined (overlapped) communication.

Layers take their TP process group as a constructor argument; ``parallelize``
converts an existing model following a plan. No module-level parallel state.
Every parameter it touches carries a ``ShardSpec`` (``get_shard_spec``), the shard metadata
the other packages read; a module it changes has a ``ModuleSpec`` (``get_module_spec``),
never an attribute written into it. See the package README for the API and limits.
"""

from merak_tp._events import record_overlap_events
from merak_tp.collectives import (
    copy_to_tp_region,
    gather_from_sequence_region,
    gather_from_tp_region,
    reduce_from_tp_region,
    reduce_scatter_to_sequence_region,
    scatter_to_sequence_region,
    scatter_to_tp_region,
)
from merak_tp.context import (
    ContextParallel,
    active_context,
    context_parallel,
    cp_attention,
    cp_positions,
    ring_attention,
    shard_positions,
    ulysses_attention,
)
from merak_tp.embedding import VocabParallelEmbedding
from merak_tp.latent_kv import LatentKVProjection
from merak_tp.linear import ColumnParallelLinear, RowParallelLinear
from merak_tp.loss import vocab_parallel_cross_entropy
from merak_tp.module_spec import ModuleSpec, get_module_spec
from merak_tp.moe_norm import ShardedRMSNorm, TPExperts, shard_experts
from merak_tp.overlap import (
    SequenceGather,
    SequenceScatter,
    TPRegion,
    make_region,
    make_sequence_gather,
    make_sequence_scatter,
    remove_region,
)
from merak_tp.parallelize import gather_tensor, grad_sum_groups, is_replicated, parallelize
from merak_tp.plans import (
    MODULE_KINDS,
    STYLES,
    TPPlan,
    get_plan,
    list_plans,
    plan_for_model,
    plan_from_mapping,
    register_plan,
    trace_leaf_names,
)
from merak_tp.rng import RNGTracker, sharded_dropout, tp_seed
from merak_tp.shard_spec import ShardSpec, get_shard_spec, has_shard_spec, set_shard_spec

__version__ = "0.1.0"

TP_LEAF_MODULES: tuple[type, ...] = (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    TPRegion,
    SequenceScatter,
    SequenceGather,
    ShardedRMSNorm,
    TPExperts,
    LatentKVProjection,
)
"""Classes an fx tracer must keep as opaque leaves (``isinstance`` covers the region subclasses)."""

__all__ = [
    "MODULE_KINDS",
    "STYLES",
    "TP_LEAF_MODULES",
    "ColumnParallelLinear",
    "ContextParallel",
    "LatentKVProjection",
    "ModuleSpec",
    "RNGTracker",
    "RowParallelLinear",
    "SequenceGather",
    "SequenceScatter",
    "ShardSpec",
    "ShardedRMSNorm",
    "TPExperts",
    "TPPlan",
    "TPRegion",
    "VocabParallelEmbedding",
    "__version__",
    "active_context",
    "context_parallel",
    "copy_to_tp_region",
    "cp_attention",
    "cp_positions",
    "gather_from_sequence_region",
    "gather_from_tp_region",
    "gather_tensor",
    "grad_sum_groups",
    "get_module_spec",
    "get_plan",
    "get_shard_spec",
    "has_shard_spec",
    "is_replicated",
    "list_plans",
    "make_region",
    "make_sequence_gather",
    "make_sequence_scatter",
    "parallelize",
    "plan_for_model",
    "plan_from_mapping",
    "record_overlap_events",
    "reduce_from_tp_region",
    "reduce_scatter_to_sequence_region",
    "register_plan",
    "remove_region",
    "ring_attention",
    "scatter_to_sequence_region",
    "scatter_to_tp_region",
    "set_shard_spec",
    "shard_experts",
    "shard_positions",
    "sharded_dropout",
    "tp_seed",
    "trace_leaf_names",
    "ulysses_attention",
    "vocab_parallel_cross_entropy",
]
