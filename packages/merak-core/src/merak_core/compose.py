"""Composition: turn a user's model into this rank's share of a 3D-parallel model.

The data flow (see the project README):

1. tensor parallelism: ``merak_tp.parallelize`` shards the model's linears and
   embeddings over the TP group in place (a built-in plan for known model types,
   the user's plan otherwise);
2. pipeline parallelism: ``merak_graph.partition`` traces the TP-sharded model
   (TP layers stay opaque leaves), cuts it into a chain of shards and assigns
   contiguous shards to ``pp`` stages; only this rank's stage is kept (and, for a
   model built under ``merak_graph.empty_init()``, only it is materialised);
3. parameters held by several stages (tied embeddings) get one process group per
   copy set, so the pipeline runtime sums their gradients over exactly those ranks.

[Note: logical names] Every local parameter maps to its *logical* name: the name
it has in the user's unsharded model (``model.named_parameters()``; a tied
parameter has the name it is first reached by). Checkpoints, gradient
comparisons and the full state dict use logical names; a TP-sharded parameter
carries ``_merak_tp_dim`` (see merak-tp's README) so it can be reassembled.

Not done here: running steps, data parallelism and optimizers (``trainer.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from merak_core.layout import ParallelLayout

logger = logging.getLogger(__name__)


@dataclass
class ParallelModel:
    """This rank's part of the model, with the names and groups needed to train it."""

    module: nn.Module
    """The stage module (``pp > 1``) or the whole (TP-sharded) model (``pp == 1``)."""
    layout: ParallelLayout
    logical_names: dict[str, str]
    """Local parameter name -> logical name (see [Note: logical names])."""
    input_keys: list[str] | None
    """For dict batches: the keys in the order the model (stage 0) takes them positionally."""
    by_keyword: bool = False
    """Dict batches whose keys are all ``forward`` parameters go in by keyword when ``pp == 1``
    (so ``forward(input_ids, past, attention_mask)`` gets its mask right)."""
    shared_parameters: list[tuple[nn.Parameter, dist.ProcessGroup]] = field(default_factory=list)
    """Local copies of parameters held by several stages, with the group of ranks holding a copy."""
    shared_owner: dict[nn.Parameter, int] = field(default_factory=dict)
    """For gradient-norm counting: shared parameter -> the stage whose copy counts."""
    partition: Any = None
    """The ``merak_graph.Partition`` (``pp > 1``), for summaries and estimates."""

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """(logical name, parameter) for every distinct local parameter."""
        by_local = dict(self.module.named_parameters())
        return [(self.logical_names[name], p) for name, p in by_local.items()]


def input_order(model: nn.Module, example_inputs: Mapping[str, Any] | Sequence[Any]) -> list[str] | None:
    """The keys of dict inputs in the order the model takes them positionally (None for a tuple).

    Keys that are ``forward`` parameters are ordered by the signature; otherwise the
    dict's own order is kept (e.g. a dataset's ``input_ids`` for ``forward(self, tokens)``).
    """
    if not isinstance(example_inputs, Mapping):
        return None
    import inspect

    params = [p.name for p in inspect.signature(model.forward).parameters.values()
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    keys = list(example_inputs)
    if all(k in params for k in keys):
        return sorted(keys, key=params.index)
    return keys


def _all_forward_params(model: nn.Module, keys: list[str]) -> bool:
    import inspect

    params = inspect.signature(model.forward).parameters
    return bool(keys) and all(k in params for k in keys)


def apply_tensor_parallel(model: nn.Module, layout: ParallelLayout, *, plan: Any = None,
                          overlap_chunks: int = 1, rng_tracker: Any = None) -> nn.Module:
    """Shard ``model`` over ``layout.tp_group`` (no-op when ``tp == 1``).

    ``plan``: None/"auto", a registered plan name, a ``TPPlan`` or a job-file mapping
    (``merak_tp.plan_from_mapping``). ``rng_tracker``: the TP random stream for the plan's
    regions of sharded dropout (``merak_tp.parallelize``).
    """
    if layout.tp == 1:
        return model
    import merak_tp

    if plan in (None, "auto"):
        plan = None
    elif isinstance(plan, Mapping):
        plan = merak_tp.plan_from_mapping(plan)
    return merak_tp.parallelize(model, plan, group=layout.tp_group, overlap_chunks=overlap_chunks,
                                rng_tracker=rng_tracker)


def build_parallel_model(
    model: nn.Module,
    layout: ParallelLayout,
    *,
    example_inputs: Mapping[str, Any] | Sequence[Any],
    tp_plan: Any = None,
    overlap_chunks: int = 1,
    device: torch.device | str = "cpu",
    init_fn: Callable[[nn.Module], Any] | None = None,
    partition_method: str = "cost",
    split_points: Sequence[str] | None = None,
    rng_tracker: Any = None,
) -> ParallelModel:
    """Apply TP, partition into ``layout.pp`` stages and keep this rank's stage.

    ``example_inputs`` holds one microbatch's inputs (a dict by name or a tuple in
    ``forward``'s order); meta tensors are fine. Every rank must call this with the
    same model (same seed) and inputs: the partition is computed on every rank and
    must agree, and the shared-parameter groups are created collectively.
    """
    canonical = _canonical_names(model)
    keys = input_order(model, example_inputs)
    by_keyword = isinstance(example_inputs, Mapping) and _all_forward_params(model, list(example_inputs))
    named_inputs = dict(example_inputs) if isinstance(example_inputs, Mapping) else None
    if isinstance(example_inputs, Mapping):
        example_inputs = tuple(example_inputs[k] for k in keys or ())
    elif isinstance(example_inputs, torch.Tensor):  # one input (e.g. an (inputs, labels) dataset), not a sequence
        example_inputs = (example_inputs,)
    model = apply_tensor_parallel(model, layout, plan=tp_plan, overlap_chunks=overlap_chunks, rng_tracker=rng_tracker)
    if layout.pp == 1:
        from merak_graph import is_meta_module, materialize

        if is_meta_module(model):
            materialize(model, device=device, init_fn=init_fn)
        model.to(device)
        logical = {name: canonical.get(id(p), name) for name, p in model.named_parameters()}
        return ParallelModel(module=model, layout=layout, logical_names=logical, input_keys=keys,
                             by_keyword=by_keyword)

    import merak_graph
    from merak_graph import is_meta_module
    from merak_pipe.shared import shared_parameter_groups

    leaves: tuple[type, ...] = ()
    if layout.tp > 1:
        import merak_tp

        leaves = merak_tp.TP_LEAF_MODULES
    # Inputs named like forward's parameters are traced by keyword (stage 0 then takes them
    # positionally in ``part.input_names`` order); others by position.
    part = merak_graph.partition(
        model, layout.pp, example_inputs=named_inputs if by_keyword else tuple(example_inputs),
        method=partition_method,
        leaf_modules=leaves, split_points=split_points, trace_method="auto",
    )
    stage_index = layout.pp_rank
    if is_meta_module(model):
        stage = part.build_stage(stage_index, device=device, init_fn=init_fn)
    else:  # real tensors already: keep this stage's modules as they are (no copy)
        stage = place_stage(part.stages[stage_index], device)
    logical = part.stage_parameter_names(stage_index)
    # Drop the other stages: their tensors must not stay alive on this rank.
    part.stages = [stage if i == stage_index else merak_graph.StageModule() for i in range(len(part.stages))]
    part.model = None
    local_params = dict(stage.named_parameters(remove_duplicate=False))
    copies = {sp.name: [s for s, _ in sp.stages] for sp in part.shared_parameters}
    groups = shared_parameter_groups(copies, group=layout.pp_group, timeout=layout.timeout) \
        if copies else {}
    shared: list[tuple[nn.Parameter, dist.ProcessGroup]] = []
    owner: dict[nn.Parameter, int] = {}
    for sp in part.shared_parameters:
        for s, local_name in sp.stages:
            if s == stage_index:
                param = local_params[local_name]
                group = groups.get(sp.name)
                if group is not None:
                    shared.append((param, group))
                owner[param] = min(st for st, _ in sp.stages)
    logger.info("stage %d/%d: %d parameters, %d shared across stages", stage_index, layout.pp,
                len(logical), len(shared))
    if by_keyword:
        keys = list(part.input_names)
    return ParallelModel(module=stage, layout=layout, logical_names=logical, input_keys=keys,
                         shared_parameters=shared, shared_owner=owner, partition=part)


_M = TypeVar("_M", bound=nn.Module)


def place_stage(stage: _M, device: torch.device | str) -> _M:
    """Move a traced stage to ``device``, with the ``device=`` constants its graphs recorded.

    Tracing (torch.export in particular) bakes the device of tensor factories such as
    ``arange`` or ``zeros`` into the graph as a constant; ``.to(device)`` moves parameters and
    buffers but not those, so the stage would create them on the tracing device. Every path
    that moves a stage goes through here (``merak_graph.retarget_devices`` then ``.to``).
    """
    from merak_graph import retarget_devices

    retarget_devices(stage, device)
    return stage.to(device)


def _canonical_names(model: nn.Module) -> dict[int, str]:
    """id(parameter) -> the first name ``named_parameters`` reaches it by."""
    out: dict[int, str] = {}
    for name, p in model.named_parameters():
        out.setdefault(id(p), name)
    return out


def gather_full_state_dict(pm: ParallelModel, *, dst: int = 0) -> dict[str, torch.Tensor] | None:
    """The logical (unsharded, single-device) parameters, assembled on global rank ``dst``.

    Collective over the world. TP shards are all-gathered along their ``_merak_tp_dim``;
    stages are gathered from the DP-rank-0 replica of each pipeline. Returns the
    state dict on ``dst`` and None elsewhere. Meant for export and tests: it moves
    every parameter through one rank.
    """
    layout = pm.layout
    local: dict[str, torch.Tensor] = {}
    for name, p in pm.named_parameters():
        if name in local:
            continue
        tensor = p.detach()
        if layout.tp > 1 and getattr(p, "_merak_tp_dim", None) is not None:
            import merak_tp

            tensor = merak_tp.gather_tensor(p.detach(), like=p, group=layout.tp_group)
        if getattr(p, "_merak_tp_transposed", False):
            tensor = tensor.t()  # stored in Linear layout (e.g. transformers Conv1D): give the original back
        local[name] = tensor.cpu().contiguous()
    contribute = layout.dp_rank == 0 and layout.tp_rank == 0
    gathered: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == dst else None
    dist.gather_object(local if contribute else {}, gathered, dst=dst)
    if gathered is None:
        return None
    full: dict[str, torch.Tensor] = {}
    for part in gathered:
        for name, tensor in part.items():
            full.setdefault(name, tensor)
    return dict(sorted(full.items()))
