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
carries a ``merak_tp.ShardSpec`` (see merak-tp's README) so it can be reassembled.

Not done here: the TP shard itself and the trace leaves (``tensor_parallel.py``), running steps, data
parallelism and optimizers (``trainer.py``).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from merak_core.lora import LoraConfig
from merak_core.parallel.forward_inputs import _all_forward_params, input_order, untraceable_message
from merak_core.parallel.fsdp import full_local_tensor
from merak_core.parallel.layout import ParallelLayout
from merak_core.parallel.tensor_parallel import apply_tensor_parallel, ep_tp_plan, trace_leaves
from merak_core.parallel.virtual_stages import check_layer_count

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelSource:
    """What the composed model was built from, for rebuilding a stage's eager layers (generation
    under pipeline parallelism, :mod:`merak_core.generation`): the model's class and config (a
    transformers model's ``config``, else None) and the TP options it was sharded with."""

    model_class: type
    config: Any
    tp_plan: Any
    sequence_parallel: bool


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
    shared_parameters: list[tuple[nn.Parameter, dist.ProcessGroup | None]] = field(default_factory=list)
    """Local copies of parameters held by several stages, with the group of ranks holding a copy
    (None when every copy is on this rank, [Note: local ties])."""
    shared_owner: dict[nn.Parameter, int] = field(default_factory=dict)
    """For gradient-norm counting: shared parameter -> the stage whose copy counts."""
    partition: Any = None
    """The ``merak_graph.Partition`` (``pp > 1``), for summaries and estimates."""
    stage_to_rank: tuple[int, ...] | None = None
    """Pipeline rank of every stage (``pp > 1``): ``pp * v`` entries with virtual stages."""
    stage_modules: dict[int, nn.Module] = field(default_factory=dict)
    """Stage index -> this rank's module of that stage (``pp > 1``)."""
    lora: LoraConfig | None = None
    """The LoRA adapters' config when only adapters train (:mod:`merak_core.lora`)."""
    source: ModelSource | None = None
    """The model's class, config and TP options (:class:`ModelSource`)."""

    @property
    def num_stages(self) -> int:
        """Pipeline stages of the whole model (1 without pipelining)."""
        return len(self.stage_to_rank) if self.stage_to_rank is not None else 1

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """(logical name, parameter) for every distinct local parameter."""
        by_local = dict(self.module.named_parameters())
        return [(self.logical_names[name], p) for name, p in by_local.items()]


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
    stage_to_rank: Sequence[int] | None = None,
    sequence_parallel: bool = False,
    lora: LoraConfig | None = None,
) -> ParallelModel:
    """Apply TP, partition into ``layout.pp`` stages and keep this rank's stage.

    ``lora``: wrap its target modules with adapters after TP and before tracing, and freeze every
    other parameter (:mod:`merak_core.lora`; the adapters are left for the caller to fill).

    ``stage_to_rank``: virtual stages, e.g. a schedule's ``stage_to_rank`` (``pp * v`` entries,
    ``v`` per pipeline rank: round-robin for interleaved-1F1B, a V for ZB-V); the model is cut
    into that many stages and this rank keeps its ``v`` of them in a :class:`StageSet`.

    ``example_inputs`` holds one microbatch's inputs (a dict by name or a tuple in
    ``forward``'s order); meta tensors are fine. Every rank must call this with the
    same model (same seed) and inputs: the partition is computed on every rank and
    must agree, and the shared-parameter groups are created collectively.
    """
    canonical = _canonical_names(model)
    source = ModelSource(type(model), getattr(model, "config", None), tp_plan, sequence_parallel)
    keys = input_order(model, example_inputs)
    by_keyword = isinstance(example_inputs, Mapping) and _all_forward_params(model, list(example_inputs))
    named_inputs = dict(example_inputs) if isinstance(example_inputs, Mapping) else None
    if isinstance(example_inputs, Mapping):
        example_inputs = tuple(example_inputs[k] for k in keys or ())
    elif isinstance(
        example_inputs, torch.Tensor
    ):  # one input (e.g. an (inputs, labels) dataset), not a sequence
        example_inputs = (example_inputs,)
    ep_leaves: list[type] = []
    if layout.ep > 1:  # this rank's experts only, before TP (merak_core.parallel.expert_parallel)
        from merak_core.parallel.expert_hf import apply_fused_expert_parallel
        from merak_core.parallel.expert_parallel import apply_expert_parallel

        ep_leaves = apply_expert_parallel(model, layout) + apply_fused_expert_parallel(model, layout)
    else:  # blocks given a capacity at ep=1 dispatch too (merak_core.parallel.expert_parallel.set_moe_capacity)
        from merak_core.parallel.expert_hf import fused_expert_leaves
        from merak_core.parallel.expert_parallel import swapped_block_classes

        ep_leaves = swapped_block_classes(model)
        if layout.pp > 1:  # transformers' fused experts run whole, their own forward, inside one stage
            ep_leaves += fused_expert_leaves(model)
    model = apply_tensor_parallel(
        model,
        layout,
        plan=ep_tp_plan(model, layout, tp_plan),
        overlap_chunks=overlap_chunks,
        rng_tracker=rng_tracker,
        sequence_parallel=sequence_parallel,
    )
    if lora is not None:
        from merak_core.lora.apply import apply_lora

        apply_lora(model, lora)
    if layout.pp == 1:
        from merak_graph import is_meta_module, materialize

        if is_meta_module(model):
            materialize(model, device=device, init_fn=init_fn)
        model.to(device)
        logical = {name: _canonical_name(canonical, p, name) for name, p in model.named_parameters()}
        pm = ParallelModel(
            module=model,
            layout=layout,
            logical_names=logical,
            input_keys=keys,
            by_keyword=by_keyword,
            source=source,
        )
        return _with_lora(pm, lora)

    import merak_graph

    leaves = (*trace_leaves(model, layout, tp_plan), *ep_leaves)  # an EP block's dispatch stays whole
    leaf_functions: tuple[Callable[..., Any], ...] = ()
    hook_trace: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
    if layout.cp > 1:  # attention runs over the cp group at run time (merak_core.parallel.context_parallel)
        from merak_core.parallel.context_parallel import attention_leaf_classes, hook_functions, hook_tracing

        leaves = (*leaves, *attention_leaf_classes(model))
        leaf_functions, hook_trace = hook_functions(model), hook_tracing(model, layout.cp_group)
    if lora is not None:
        from merak_core.lora.layer import LoraLinear

        leaves = (*leaves, LoraLinear)  # opaque: its TP collectives stay inside (merak_core.lora.layer)
    placement = tuple(stage_to_rank) if stage_to_rank is not None else tuple(range(layout.pp))
    _check_placement(placement, layout.pp)
    check_layer_count(model, layout.pp, len(placement) // layout.pp)
    # Inputs named like forward's parameters are traced by keyword (stage 0 then takes them
    # positionally in ``part.input_names`` order); others by position.
    from merak_core.parallel.active_experts import active_expert_blocks

    # An MoE block is costed as its active experts, k of E, without its dispatch ([Note: active-expert cost]).
    moe_cost = active_expert_blocks(model) if ep_leaves else contextlib.nullcontext()
    try:
        with moe_cost, hook_trace:
            part = merak_graph.partition(
                model,
                len(placement),
                example_inputs=named_inputs if by_keyword else tuple(example_inputs),
                method=partition_method,
                leaf_modules=leaves,
                leaf_functions=leaf_functions,
                split_points=split_points,
                trace_method="auto",
            )
    except merak_graph.TraceError as exc:
        raise ValueError(untraceable_message(model, exc, layout.pp)) from None
    except merak_graph.PartitionError as exc:
        if len(placement) == layout.pp:
            raise
        raise ValueError(
            f"virtual_stages={len(placement) // layout.pp} at pp={layout.pp} needs the model cut into "
            f"{len(placement)} stages, which it cannot be: {exc}. Use fewer virtual_stages (or a smaller pp)"
        ) from exc
    pm = _this_rank_stages(part, placement, layout, device=device, init_fn=init_fn)
    del part  # the whole model's stages: pm.partition holds this rank's only
    if by_keyword:
        keys = list(pm.partition.input_names)
    pm.input_keys = keys
    pm.source = source
    return _with_lora(pm, lora)


def _with_lora(pm: ParallelModel, lora: LoraConfig | None) -> ParallelModel:
    """With LoRA: logical names without the wrappers' ``base_layer`` ([Note: LoRA logical names]),
    only adapters trainable, and shared (tied) parameters left out of the cross-stage gradient sum
    when frozen (they get no gradient)."""
    if lora is None:
        return pm
    from merak_core.lora.apply import freeze_base, logical_name

    pm.logical_names = {local: logical_name(name) for local, name in pm.logical_names.items()}
    pm.lora = lora
    freeze_base(pm.named_parameters())
    pm.shared_parameters = [(p, g) for p, g in pm.shared_parameters if p.requires_grad]
    pm.shared_owner = {p: s for p, s in pm.shared_owner.items() if p.requires_grad}
    return pm


def _check_placement(placement: tuple[int, ...], pp: int) -> None:
    counts = [placement.count(r) for r in range(pp)]
    if len(placement) % pp or any(c != len(placement) // pp for c in counts):
        raise ValueError(
            f"stage_to_rank={list(placement)} must put the same number of stages on each of the pp={pp} "
            f"pipeline ranks (got {counts}); use a schedule's stage_to_rank (merak_pipe.build_schedule)"
        )


class StageSet(nn.Module):
    """The pipeline stages one rank holds (virtual stages): ``stage{i}`` for each stage index ``i``.

    Parameters tied across two of these stages are one ``nn.Parameter`` object (see
    [Note: local ties]), so ``named_parameters()`` lists each once.
    """

    def __init__(self, stages: Mapping[int, nn.Module]) -> None:
        super().__init__()
        self.stage_indices = sorted(stages)
        for index in self.stage_indices:
            self.add_module(f"stage{index}", stages[index])

    def stage(self, index: int) -> nn.Module:
        return self.get_submodule(f"stage{index}")


def _this_rank_stages(
    part: Any,
    placement: tuple[int, ...],
    layout: ParallelLayout,
    *,
    device: torch.device | str,
    init_fn: Callable[[nn.Module], Any] | None,
) -> ParallelModel:
    """Keep the stages ``placement`` puts on this rank; drop the others (their tensors must not stay alive)."""
    from merak_graph import is_meta_module

    mine = [s for s, r in enumerate(placement) if r == layout.pp_rank]
    meta = is_meta_module(part.model) if part.model is not None else False
    modules: dict[int, nn.Module] = {}
    for s in mine:
        if meta or is_meta_module(part.stages[s]):
            modules[s] = part.build_stage(s, device=device, init_fn=init_fn)
        else:  # real tensors already: keep this stage's modules as they are (no copy)
            modules[s] = place_stage(part.stages[s], device)
    _tie_local_copies(part, modules)
    if len(mine) == 1:
        module: nn.Module = modules[mine[0]]
        logical = dict(part.stage_parameter_names(mine[0]))
    else:
        module = StageSet(modules)
        logical = {
            f"stage{s}.{local}": name for s in mine for local, name in part.stage_parameter_names(s).items()
        }
    part = part.keeping_only(modules)  # the other stages' tensors must not stay alive
    shared, owner = _shared_groups(part, placement, modules, layout)
    logger.info(
        "pipeline rank %d/%d holds stages %s: %d parameters, %d shared across stages",
        layout.pp_rank,
        layout.pp,
        mine,
        len(logical),
        len(shared),
    )
    return ParallelModel(
        module=module,
        layout=layout,
        logical_names=logical,
        input_keys=None,
        shared_parameters=shared,
        shared_owner=owner,
        partition=part,
        stage_to_rank=placement,
        stage_modules=modules,
    )


def _local_param(module: nn.Module, local_name: str) -> nn.Parameter:
    return dict(module.named_parameters(remove_duplicate=False))[local_name]


def _tie_local_copies(part: Any, modules: Mapping[int, nn.Module]) -> None:
    """[Note: local ties] Copies of one shared parameter on two stages of this rank become one object.

    Their gradients then accumulate into one ``.grad`` (the sum over the stages), as in the
    unpartitioned model; only copies on other ranks need an all-reduce.
    """
    for sp in part.shared_parameters:
        here = [(s, local) for s, local in sp.stages if s in modules]
        if len(here) < 2:
            continue
        keep = _local_param(modules[here[0][0]], here[0][1])
        for s, local in here[1:]:
            owner_name, _, leaf = local.rpartition(".")
            owner = modules[s].get_submodule(owner_name) if owner_name else modules[s]
            if getattr(owner, leaf) is not keep:
                setattr(owner, leaf, keep)


def _shared_groups(
    part: Any, placement: tuple[int, ...], modules: Mapping[int, nn.Module], layout: ParallelLayout
) -> tuple[list[tuple[nn.Parameter, Any]], dict[nn.Parameter, int]]:
    """Per shared parameter held here: (this rank's copy, the group of ranks holding one, or None), and the
    pipeline rank whose copy the gradient norm counts."""
    from merak_pipe.shared import shared_parameter_groups

    copies = {sp.name: sorted({placement[s] for s, _ in sp.stages}) for sp in part.shared_parameters}
    groups = shared_parameter_groups(copies, group=layout.pp_group, timeout=layout.timeout) if copies else {}
    shared: list[tuple[nn.Parameter, Any]] = []
    owner: dict[nn.Parameter, int] = {}
    for sp in part.shared_parameters:
        here = [(s, local) for s, local in sp.stages if s in modules]
        if not here:
            continue
        param = _local_param(modules[here[0][0]], here[0][1])
        # A copy with no group (every copy on this rank, [Note: local ties]) still gets its
        # gradient from several backwards per microbatch: it is listed so DP reduces it last.
        shared.append((param, groups.get(sp.name)))
        owner[param] = placement[min(s for s, _ in sp.stages)]
    return shared, owner


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


def _canonical_names(model: nn.Module) -> dict[int, tuple[nn.Parameter, str]]:
    """id(parameter) -> (the parameter, the first name ``named_parameters`` reaches it by).

    The parameter is kept so that the entry cannot match a new tensor that reuses the id of
    a replaced one (TP layers and meta materialisation create new parameters).
    """
    out: dict[int, tuple[nn.Parameter, str]] = {}
    for name, p in model.named_parameters():
        out.setdefault(id(p), (p, name))
    return out


def _canonical_name(canonical: dict[int, tuple[nn.Parameter, str]], param: nn.Parameter, name: str) -> str:
    """The logical name of ``param``: its original first name if it is an original parameter, else ``name``."""
    entry = canonical.get(id(param))
    return entry[1] if entry is not None and entry[0] is param else name


def gather_full_state_dict(pm: ParallelModel, *, dst: int = 0) -> dict[str, torch.Tensor] | None:
    """The logical (unsharded, single-device) parameters, assembled on global rank ``dst``.

    Collective over the world. TP shards are all-gathered along their ``ShardSpec.dim``;
    stages are gathered from the DP-rank-0 replica of each pipeline. Returns the
    state dict on ``dst`` and None elsewhere. Meant for export and tests: it moves
    every parameter through one rank.
    """
    from merak_core.parallel.expert_hf import full_expert_tensor
    from merak_tp.shard_spec import get_shard_spec

    layout = pm.layout
    local: dict[str, torch.Tensor] = {}
    for name, p in pm.named_parameters():
        if name in local:
            continue
        tensor = full_local_tensor(p.detach())  # ZeRO-2/3: gathered over DP (every DP rank takes part)
        tensor = full_expert_tensor(p, tensor)  # fused experts: gathered over EP (expert_hf)
        spec = get_shard_spec(p)
        if layout.tp > 1 and spec.sharded:
            tensor = spec.gather(tensor, layout.tp_group)
        if spec.transposed:
            tensor = tensor.t()  # stored in Linear layout (e.g. transformers Conv1D): give the original back
        local[name] = tensor.cpu().contiguous()
    # Experts are sharded over the first EP group's DP ranks (dense parameters: the same on each).
    contribute = layout.dp_rank < layout.ep and layout.tp_rank == 0
    gathered: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == dst else None
    dist.gather_object(local if contribute else {}, gathered, dst=dst)
    if gathered is None:
        return None
    full: dict[str, torch.Tensor] = {}
    for part in gathered:
        for name, tensor in part.items():
            full.setdefault(name, tensor)
    return dict(sorted(full.items()))
