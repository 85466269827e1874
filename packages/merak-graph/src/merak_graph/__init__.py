"""merak_graph: trace, shard and partition PyTorch models into pipeline stages.

The model is never materialised whole: build it under ``empty_init()``, then
``partition(model, num_stages, example_inputs=...)`` traces it (torch.export or
torch.fx), annotates costs on meta tensors, cuts the graph into a chain of
shards at small boundaries and assigns contiguous shards to stages;
``Partition.build_stage(i, device=...)`` materialises one stage. See README.md.
"""

from merak_graph.costs import CostModel, NodeCost, ValueSpec, annotate_costs, graph_cost_summary
from merak_graph.empty import (
    adopt_constructor_buffers,
    constructor_buffers,
    empty_init,
    is_meta_module,
    materialize,
)
from merak_graph.errors import InputMismatchError, PartitionError, TraceError
from merak_graph.partitioning import (
    PARAM_MEMORY_FACTOR,
    Partition,
    SharedParameter,
    StageInfo,
    partition,
    partition_sharded,
    partition_traced,
)
from merak_graph.profiling import profile_shards
from merak_graph.sharding import BoundaryValue, Shard, ShardedGraph, natural_shard_count, shard
from merak_graph.solver import optimal_contiguous_partition, uniform_partition
from merak_graph.stage import StageModule, retarget_devices
from merak_graph.tracing import trace

__version__ = "0.1.0"

__all__ = [
    "PARAM_MEMORY_FACTOR",
    "BoundaryValue",
    "CostModel",
    "InputMismatchError",
    "NodeCost",
    "Partition",
    "PartitionError",
    "Shard",
    "ShardedGraph",
    "SharedParameter",
    "StageInfo",
    "StageModule",
    "TraceError",
    "ValueSpec",
    "__version__",
    "adopt_constructor_buffers",
    "annotate_costs",
    "constructor_buffers",
    "empty_init",
    "graph_cost_summary",
    "is_meta_module",
    "materialize",
    "natural_shard_count",
    "optimal_contiguous_partition",
    "partition",
    "partition_sharded",
    "partition_traced",
    "profile_shards",
    "retarget_devices",
    "shard",
    "trace",
    "uniform_partition",
]
