"""Expert parallelism in the cluster cost model: what ``ep`` changes in a stage's seconds and bytes.

[Note: expert-parallel cost terms] For a model whose MoE blocks follow the protocol
(:mod:`merak_core.parallel.expert_parallel`), at ``ep > 1`` (uniform routing assumed):
- compute: an MoE block costs its active experts' FLOPs, ``k`` of ``E`` (each token's ``k`` rows through one
  expert each), whatever the ep: the meta trace runs every block as one expert over ``n * k`` rows
  (:func:`merak_core.parallel.active_experts.active_expert_blocks`), so the partitioner's and the planner's layer costs hold the active
  experts only;
- communication: per MoE block and microbatch, two all-to-alls in forward (tokens out, results back) and
  two in backward, each sending ``tokens * k * (ep - 1) / ep * hidden * bytes`` off the rank
  (:func:`all_to_all_bytes`), priced over the EP group's link (``ep`` DP neighbours: one node when
  ``ep * tp`` fits in it) as ``(ep - 1)`` latencies plus those bytes at the link's bandwidth; not
  overlapped;
- memory: expert parameters, their gradients and optimizer states are divided by ep (whole experts, not
  split by tp), the dense ones as before; under ZeRO-1 the experts' optimizer states are sharded over
  the expert-replica group (``dp / ep`` ranks), the dense ones over dp; under ZeRO-2/3 the experts'
  parameters, gradients and optimizer states likewise (divided by ep, then by ``dp / ep``: by dp per rank),
  and ZeRO-3's all-gathers of the experts run over that replica group (``dp / ep`` ranks ``ep`` DP
  neighbours apart), the dense ones' over dp.
Deliberately approximated: the experts' compute is divided by tp like the rest of the layer (at tp > 1
the runtime keeps experts whole), the DP gradient all-reduce carries the experts' ``1 / ep`` share over
the whole DP ring (it runs over the smaller replica group), and routing skew (a hot expert) is not
priced.

Not here: the dense terms (:mod:`.cluster_cost`), applying these to a stage (:mod:`.expert_pricing`), the
search over ep (:mod:`.cluster_search`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch import nn

if TYPE_CHECKING:
    from merak_core.planner.cluster import ClusterSpec

__all__ = [
    "MoECosts",
    "all_to_all_bytes",
    "all_to_all_bytes_per_sample",
    "all_to_all_s",
    "expert_degrees",
    "fused_experts_whole",
    "moe_costs",
    "model_step_all_to_all_bytes",
    "moe_of",
    "step_all_to_all_bytes",
]


@dataclass(frozen=True, kw_only=True)
class MoECosts:
    """What the cluster model needs of a model's MoE blocks."""

    expert_params: frozenset[str]
    """Canonical names of the experts' parameters (sharded over ep)."""
    num_experts: int
    """Experts per block (the smallest, when blocks differ): ep must divide it."""
    top_k: int
    """Experts each token visits."""
    blocks_per_layer: tuple[int, ...]
    """MoE blocks in each layer (graph shard) of the chain."""
    block_bytes_per_sample: float
    """Bytes of a block's output for one sample (tokens x hidden x bytes): what its rows carry."""


def all_to_all_bytes(tokens: float, top_k: int, ep: int, hidden: int, dtype_bytes: float) -> float:
    """Bytes one rank sends to other ranks in one all-to-all of a block: ``tokens * k * (ep-1)/ep * hidden * bytes``."""
    return tokens * top_k * (ep - 1) / ep * hidden * dtype_bytes


def step_all_to_all_bytes(
    *, tokens: float, top_k: int, ep: int, hidden: int, dtype_bytes: float, moe_layers: int, microbatches: int
) -> float:
    """Off-rank bytes one rank sends per step: four all-to-alls (two forward, two backward) per MoE block and
    microbatch of ``tokens`` tokens."""
    return 4 * moe_layers * microbatches * all_to_all_bytes(tokens, top_k, ep, hidden, dtype_bytes)


def all_to_all_s(nbytes: float, ep: int, tp: int, cluster: ClusterSpec) -> float:
    """One all-to-all over the first EP group (``ep`` DP neighbours, TP fastest) sending ``nbytes`` off-rank."""
    if ep <= 1:
        return 0.0
    bandwidth, latency = cluster.link([d * tp for d in range(ep)])
    return (ep - 1) * latency + nbytes / bandwidth


def expert_degrees(costs: Any, dp: int) -> list[int]:
    """The ep to try at ``dp``: 1, and for an MoE model every ep > 1 dividing dp and the experts."""
    moe = moe_of(costs)
    if moe is None:
        return [1]
    return [ep for ep in range(1, dp + 1) if dp % ep == 0 and moe.num_experts % ep == 0]


def moe_of(costs: Any) -> MoECosts | None:
    """The MoE blocks of ``costs`` (a :class:`merak_core.planner.cluster_cost.ModelCosts`; None: a dense
    model). The costs are typed ``Any`` here: cluster_cost imports this module."""
    moe = getattr(costs, "moe", None)
    return moe if isinstance(moe, MoECosts) else None


@contextlib.contextmanager
def fused_experts_whole(model: nn.Module) -> Iterator[list[type]]:
    """Within: transformers' fused experts modules (Mixtral, Qwen3-MoE, DeepSeek-V3) run as
    :class:`~merak_core.parallel.expert_hf.WholeFusedExperts` (on meta tensors the work of the active experts,
    ``k`` of ``E`` per token: [Note: active-expert cost]); yields their classes, to trace as leaves. The
    classes are restored on exit."""
    from merak_core.parallel.expert_hf import WholeFusedExperts
    from merak_core.parallel.expert_parallel import ep_class
    from merak_core.parallel.fused_experts import fused_experts

    saved = [(m, type(m)) for _, m in fused_experts(model)]
    try:
        for m, cls in saved:
            m.__class__ = ep_class(WholeFusedExperts, cls)
        yield list(dict.fromkeys(type(m) for m, _ in saved))
    finally:
        for m, cls in saved:
            m.__class__ = cls


def _top_k(node: Any, module: Any) -> int:
    """Experts each token visits in the block called by ``node``: a protocol block's ``top_k``; for fused
    experts the width of the ``top_k_index`` the block passes them (its second argument)."""
    if hasattr(module, "top_k"):
        return int(module.top_k)
    arg = node.args[1] if len(node.args) > 1 else node.kwargs.get("top_k_index")
    shape = getattr(getattr(arg, "meta", {}).get("merak_value"), "shape", ())
    return int(shape[-1]) if shape else 1


def moe_costs(model: nn.Module, sharded: Any, canonical: dict[int, str]) -> MoECosts | None:
    """:class:`MoECosts` of ``model`` traced under ``active_expert_blocks`` and :func:`fused_experts_whole`
    into ``sharded`` (its chain of shards, annotated); None without protocol blocks or fused experts
    modules. ``canonical``: parameter id -> canonical name."""
    from merak_core.parallel.expert_parallel import is_moe_block, moe_blocks
    from merak_core.parallel.fused_experts import fused_experts, is_fused_experts

    blocks = moe_blocks(model)
    fused = fused_experts(model)
    if not blocks and not fused:
        return None
    params = [p for _, b in blocks for p in b.experts.parameters()]
    params += [p for _, m in fused for p in (m.gate_up_proj, m.down_proj)]
    per_layer, sample_bytes, top_k = [], [], [1]
    for shard in sharded.shards:
        calls = []
        for n in shard.module.graph.nodes:
            sub = shard.module.get_submodule(str(n.target)) if n.op == "call_module" else None
            if sub is not None and (is_moe_block(sub) or is_fused_experts(sub)):
                calls.append(n)
                top_k.append(_top_k(n, sub))
        per_layer.append(len(calls))
        sample_bytes += [float(getattr(n.meta.get("merak_value"), "nbytes", 0.0)) for n in calls]
    return MoECosts(
        expert_params=frozenset(canonical[id(p)] for p in params if id(p) in canonical),
        num_experts=min(int(b.num_experts) for _, b in [*blocks, *fused]),
        top_k=max(top_k),
        blocks_per_layer=tuple(per_layer),
        block_bytes_per_sample=max(sample_bytes, default=0.0),
    )


def all_to_all_bytes_per_sample(costs: Any, ep: int) -> float:
    """One all-to-all's off-rank bytes for one sample: a block's rows (tokens x hidden x bytes) times
    ``k (ep - 1) / ep``."""
    moe = moe_of(costs)
    if moe is None or ep <= 1:
        return 0.0
    return moe.block_bytes_per_sample * moe.top_k * (ep - 1) / ep


def model_step_all_to_all_bytes(
    costs: Any, ep: int, *, micro_batch_size: int, num_microbatches: int
) -> float:
    """Off-rank bytes one rank sends per step through the all-to-alls of ``costs``' MoE blocks (what the cluster
    model prices): four per block and microbatch of ``micro_batch_size`` samples."""
    moe = moe_of(costs)
    if moe is None:
        return 0.0
    per_microbatch = sum(moe.blocks_per_layer) * micro_batch_size * all_to_all_bytes_per_sample(costs, ep)
    return 4 * num_microbatches * per_microbatch
