"""Expert parallelism (``training.ep``): whole experts on the ranks of an EP group, tokens sent to them.

The rank grid: EP ranks are DP ranks of one stage (:mod:`merak_core.parallel.layout`, [Note: expert-parallel
groups]). Rank ``ep_rank`` of an EP group holds experts ``[ep_rank * E / ep, (ep_rank + 1) * E / ep)``
of every MoE block; the dense parameters stay replicated over DP.

[Note: the MoE block protocol] A model's MoE block is any module with

- ``num_experts: int`` and ``experts: nn.ModuleList`` (``num_experts`` modules, each ``y_nh = e(x_nh)``);
- ``run_experts(x_nh, weights_nk, experts_nk) -> y_nh``: the sum over each token's ``k`` chosen experts of
  ``weight * expert(x)``, every token kept (dropless);
- optionally ``router_aux_loss_coef``: non-zero, the block has a load-balancing loss and sets
  ``router_stats = (probs_ne, experts_nk)`` in each forward; Merak adds it over the global microbatch at any
  ep ([Note: a protocol block's router aux loss] in :mod:`merak_core.parallel.router_aux`). The block's
  ``forward`` routes as the model defines it (top-k, scoring, normalisation, shared experts) and calls
  ``run_experts``.

:func:`apply_expert_parallel` keeps this rank's experts (an ``nn.ModuleDict`` keyed by the global expert
index, so parameter names are the one-process names, ``experts.5.w1.weight``) and swaps the block's class
for a subclass whose ``run_experts`` is :func:`dispatch`: the routing and everything else are the
model's own code.

[Note: dropless dispatch] Per block and microbatch: the ``n * k`` (token, expert) pairs are sorted by
expert (stable); the per-expert counts are exchanged over the EP group (``all_to_all_single`` of
``E`` integers); the rows are sent with an uneven ``all_to_all_single`` (merak_tp.all_to_all,
backward = the reverse exchange); the received rows are regrouped by local expert, each local expert
runs once over all its rows, the results go back in received order, return by the reverse
all-to-all, and are summed into their tokens with the routing weights. No row is dropped; an expert
that receives no rows runs on none (its gradient is zero, as on one process).

[Note: expert gradient normalisation] Each rank's loss is its share of the global loss, and the DP
sync averages the dense gradients: ``g = (1/dp) * sum over DP ranks r of grad L_r``. After backward an
expert's owner holds ``sum over the r of its EP group of grad_expert L_r`` (the reverse all-to-all
brings each rank's token gradients home). The expert-replica groups hold the other EP blocks' sums,
so the expert gradient is summed over the replica group (dp / ep ranks) and divided by dp: each
expert's gradient is the one-process gradient over every token of the global batch that visited it.

[Note: ZeRO-1 with experts] Under ZeRO-1 each part shards over its own group: the dense buckets are
reduce-scattered to their owners in the DP group, the expert buckets to their owners in the
expert-replica group (dp / ep ranks; at dp == ep a group of one, nothing to shard), and
:class:`merak_core.parallel.zero.ZeroOptimizer` all-gathers each part's updated parameters over that
part's group (:meth:`ExpertParallelGradSync.zero_parts`). Every expert's gradient then sits on exactly
one rank of the DP group (the DP group is the EP group times the replica group), like every dense one,
so the gradient norm sums both over DP alone.

ZeRO-2/3 (FSDP2) shards the experts by their own ``fully_shard`` over the replica group, the dense
parameters over DP: [Note: ZeRO-2/3 with experts] in :mod:`merak_core.parallel.zero_experts`.

Gradient clipping counts each expert once: its term of the norm is summed over the EP group
(:func:`merak_core.parallel.clip.global_grad_norm`, ``expert_params``). Refused (before any process group:
:func:`check_ep_arguments`, :func:`check_ep_model`): ep with virtual stages, LoRA, cp > 1,
and a model without a block following [Note: the MoE block protocol].
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn
from torch.distributed import ProcessGroup

from merak_core.parallel.data_parallel import DataParallelGradSync
from merak_core.parallel.fused_experts import (
    check_fused_experts,
    expert_shard,
    fused_experts,
    fused_forward_problem,
    is_fused_experts,
)
from merak_core.parallel.layout import ParallelLayout
from merak_core.parallel.moe_blocks import is_moe_block, moe_blocks
from merak_core.parallel.moe_capacity import check_capacity_factor, expert_capacity, run_with_capacity
from merak_core.parallel.rank_grid import check_ep
from merak_tp.all_to_all import all_to_all_uneven, exchange_counts

__all__ = [
    "ExpertDispatch",
    "ExpertParallelGradSync",
    "apply_expert_parallel",
    "check_ep_arguments",
    "check_ep_model",
    "dispatch",
    "expert_parameters",
    "is_moe_block",
    "moe_blocks",
    "set_moe_capacity",
    "swapped_block_classes",
]

_PROTOCOL = (
    "a module with num_experts, experts (an nn.ModuleList) and run_experts(x_nh, weights_nk, experts_nk) "
    "(docs/expert_parallel.md, 'the MoE block protocol')"
)


def check_ep_arguments(args: Any) -> None:
    """``ep`` of a ``TrainingArguments``; ValueError for a combination not made exact at ep > 1 (pure)."""
    ep = args.ep
    if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1:
        raise ValueError(f"ep={ep!r} is invalid: expected an integer >= 1 (1: no expert parallelism)")
    check_capacity_factor(getattr(args, "moe_capacity_factor", None))  # [Note: expert capacity]
    if ep == 1:
        return
    if getattr(args, "layout", "manual") == "auto":
        # the planner keeps or replaces the job's ep with the dp, cp and virtual stages it chooses, each
        # layout checked here as manual (merak_core.planner.search.ep_refusal): the job's own are replaced
        return
    if args.dp is not None:
        check_ep(args.dp, ep)
    refusals = (
        (args.virtual_stages > 1, f"virtual_stages={args.virtual_stages}", "set virtual_stages: 1"),
        (args.cp > 1, f"cp={args.cp}", "set cp: 1"),
    )
    for refused, what, fix in refusals:
        if refused:
            raise ValueError(f"ep={ep} with {what} is not supported (not proved exact): {fix}, or set ep: 1")


def check_ep_model(model: nn.Module, args: Any, *, lora: Any = None) -> None:
    """ValueError when ``model`` cannot run at ``args.ep`` (pure: before any process group)."""
    ep = args.ep
    _check_capacity_model(model, args)
    if ep == 1:
        return
    check_ep_arguments(args)
    if lora is not None:
        raise ValueError(
            f"ep={ep} with LoRA (model.lora) is not supported (not proved exact): train the adapters with ep: 1"
        )
    fused = check_fused_experts(model, args)  # transformers' fused experts (merak_core.parallel.expert_hf)
    _refuse_foreign_moe(model, ep)
    blocks = moe_blocks(model)
    if not blocks and not fused:
        raise ValueError(
            f"ep={ep} but {type(model).__name__} has no mixture-of-experts block Merak can shard: it needs "
            f"{_PROTOCOL}. Set ep: 1"
        )
    for name, block in blocks:
        if len(block.experts) != block.num_experts:
            raise ValueError(
                f"ep={ep}: {name!r} says num_experts={block.num_experts} but holds {len(block.experts)} experts: "
                "make them agree (one module per expert)"
            )
        if block.num_experts % ep:
            raise ValueError(
                f"ep={ep} does not divide the {block.num_experts} experts of {name!r}: choose an ep dividing "
                f"{block.num_experts}"
            )


def _check_capacity_model(model: nn.Module, args: Any) -> None:
    """ValueError for ``moe_capacity_factor`` on a model whose MoE blocks cannot apply it."""
    factor = getattr(args, "moe_capacity_factor", None)
    if factor is None:
        return
    check_capacity_factor(factor)
    fused = fused_experts(model)  # transformers' fused experts: merak_core.parallel.expert_hf
    if not moe_blocks(model) and not fused:
        raise ValueError(
            f"moe_capacity_factor={factor} but {type(model).__name__} has no mixture-of-experts block that applies "
            f"a capacity: it needs {_PROTOCOL}, or transformers' fused experts (gate_up_proj [E, 2I, H], "
            "down_proj [E, H, I]). Set moe_capacity_factor: null"
        )
    for name, module in fused:
        problem = fused_forward_problem(module)
        if problem is not None:
            raise ValueError(
                f"moe_capacity_factor={factor}: {type(module).__name__} at {name!r} cannot apply a capacity (Merak's "
                f"dispatch replaces its forward): {problem}. Set moe_capacity_factor: null"
            )
    tp = getattr(args, "tp", 1)
    if fused and args.ep == 1 and tp > 1:
        raise ValueError(
            f"moe_capacity_factor={factor} with tp={tp} at ep=1: the TP plan splits every fused expert over TP, "
            "where no capacity applies. Set ep > 1 (whole experts per EP rank), tp: 1, or moe_capacity_factor: null"
        )
    _refuse_foreign_moe(model, args.ep, capacity=factor)  # a block that would run dropless


def _refuse_foreign_moe(model: nn.Module, ep: int, *, capacity: float | None = None) -> None:
    """ValueError naming the first MoE block that does not follow the protocol (e.g. a transformers one):
    at ``ep`` > 1, or with a ``capacity`` factor that block would not apply."""
    for name, module in model.named_modules():
        cls = type(module).__name__
        if ("moe" in cls.lower() or cls.endswith("Experts")) and not is_moe_block(module):
            if any(is_moe_block(m) or is_fused_experts(m) for m in module.modules()):
                continue  # a layer holding a protocol block or fused experts
            if not hasattr(module, "experts") and not any(p.ndim == 3 for p in module.parameters()):
                continue  # a family's other modules (Qwen3MoeAttention, ...): no experts
            what, fix = (
                (f"moe_capacity_factor={capacity}", "set moe_capacity_factor: null")
                if capacity is not None and ep == 1
                else (f"ep={ep}", "set ep: 1 and split the experts over TP (tp > 1)")
            )
            raise ValueError(
                f"{what}: {cls} at {name!r} is a mixture-of-experts block Merak cannot replace (neither the "
                f"protocol nor fused experts gate_up_proj [E, 2I, H] / down_proj [E, H, I]): {fix}, or give the "
                f"model blocks following the protocol ({_PROTOCOL})"
            )


# ---------------------------------------------------------------------------- dispatch


def _regroup_order(recv_counts_pl: torch.Tensor) -> torch.Tensor:
    """Row order that turns received rows (by source rank, then local expert) into (local expert, source)."""
    num_src, num_local = recv_counts_pl.shape
    starts = torch.cumsum(recv_counts_pl.reshape(-1), 0) - recv_counts_pl.reshape(-1)
    pieces = [
        torch.arange(int(starts[s * num_local + e]), int(starts[s * num_local + e] + recv_counts_pl[s, e]))
        for e in range(num_local)
        for s in range(num_src)
    ]
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long)


def dispatch(
    x_nh: torch.Tensor,
    weights_nk: torch.Tensor,
    experts_nk: torch.Tensor,
    local_experts: nn.ModuleDict,
    num_experts: int,
    group: ProcessGroup | None,
    *,
    capacity_factor: float | None = None,
) -> torch.Tensor:
    """``sum_k weights[n, k] * expert[experts[n, k]](x[n])`` with the experts spread over ``group``.

    ``local_experts`` holds this rank's ``num_experts / ep`` experts keyed by global index (consecutive,
    starting at ``ep_rank * num_experts / ep``). Collective over ``group`` (see [Note: dropless dispatch]);
    ``group`` None: every expert is local (ep=1). ``capacity_factor``: each expert's capacity of
    [Note: expert capacity] (:mod:`merak_core.parallel.moe_capacity`); None: dropless.
    """
    ep = 1 if group is None else torch.distributed.get_world_size(group)
    num_local = num_experts // ep
    n, k = experts_nk.shape
    expert_f = experts_nk.reshape(-1)
    order = torch.argsort(expert_f, stable=True)
    token_of_row = torch.div(order, k, rounding_mode="floor")
    rows_sh = x_nh.index_select(0, token_of_row)
    counts_e = torch.bincount(expert_f, minlength=num_experts).to(x_nh.device)
    if group is None:
        recv_counts_pl, send_splits, recv_splits = counts_e.reshape(1, num_local).cpu(), [n * k], [n * k]
        recv_sh = rows_sh
    else:
        recv_counts_pl = exchange_counts(counts_e, group).reshape(ep, num_local).cpu()
        send_splits = counts_e.reshape(ep, num_local).sum(1).tolist()
        recv_splits = recv_counts_pl.sum(1).tolist()
        recv_sh = all_to_all_uneven(rows_sh, recv_splits, send_splits, group)
    capacity = _capacity(n, k, num_experts, capacity_factor, group, x_nh.device)
    regroup = _regroup_order(recv_counts_pl).to(x_nh.device)
    grouped_sh = recv_sh.index_select(0, regroup)
    per_expert = recv_counts_pl.sum(0).tolist()
    first = min(int(key) for key in local_experts.keys())
    outs = [  # each expert's rows in position order: the capacity keeps the first ones
        run_with_capacity(local_experts[str(first + e)], chunk, capacity)
        for e, chunk in enumerate(torch.split(grouped_sh, per_expert, dim=0))
    ]
    done_sh = torch.cat(outs, 0) if outs else grouped_sh
    back_sh = done_sh.index_select(0, torch.argsort(regroup))  # received order again
    home_sh = back_sh if group is None else all_to_all_uneven(back_sh, send_splits, recv_splits, group)
    weighted_sh = home_sh * weights_nk.reshape(-1).index_select(0, order).unsqueeze(-1).to(home_sh.dtype)
    out_nh = torch.zeros((n, home_sh.size(-1)), dtype=home_sh.dtype, device=home_sh.device)
    return out_nh.index_add(0, token_of_row, weighted_sh)


def _capacity(
    n: int, k: int, num_experts: int, factor: float | None, group: ProcessGroup | None, device: torch.device
) -> int | None:
    """Each expert's capacity for this dispatch ([Note: expert capacity]): T = the EP group's tokens."""
    if factor is None:
        return None
    tokens = n
    if group is not None:
        total = torch.tensor([n], dtype=torch.long, device=device)
        torch.distributed.all_reduce(total, group=group)
        tokens = int(total.item())
    return expert_capacity(tokens, k, num_experts, factor)


@dataclasses.dataclass(frozen=True)
class ExpertDispatch:
    """How a swapped MoE block dispatches its tokens: the record Merak keeps on the block (one typed
    attribute, :data:`DISPATCH_ATTR`), set by :func:`apply_expert_parallel` and :func:`set_moe_capacity`."""

    group: ProcessGroup | None = None
    """The EP group; None: every expert is local (a capacity at ep=1)."""
    capacity_factor: float | None = None
    """``training.moe_capacity_factor`` (None: dropless)."""


DISPATCH_ATTR = "merak_expert_dispatch"


def expert_dispatch(block: nn.Module) -> ExpertDispatch:
    """The block's dispatch record (the default, dropless and local, when none was set)."""
    record = getattr(block, DISPATCH_ATTR, None)
    return record if isinstance(record, ExpertDispatch) else ExpertDispatch()


def _set_dispatch(block: nn.Module, **changes: Any) -> None:
    setattr(block, DISPATCH_ATTR, dataclasses.replace(expert_dispatch(block), **changes))


class ExpertParallelBlock:
    """Mixin put in front of an MoE block's class: ``run_experts`` dispatches as the block's
    :class:`ExpertDispatch` says (over the EP group, or every expert local with a capacity at ep=1)."""

    experts: nn.ModuleDict
    num_experts: int

    def run_experts(
        self, x_nh: torch.Tensor, weights_nk: torch.Tensor, experts_nk: torch.Tensor
    ) -> torch.Tensor:
        record = expert_dispatch(self)  # type: ignore[arg-type]
        return dispatch(
            x_nh,
            weights_nk,
            experts_nk,
            self.experts,
            self.num_experts,
            record.group,
            capacity_factor=record.capacity_factor,
        )


_SUBCLASSES: dict[tuple[type, type], type] = {}


def ep_class(mixin: type, cls: type) -> type:
    """``cls`` with ``mixin`` in front (``EP<name>``, one class per pair), or ``cls`` when it has it already."""
    if issubclass(cls, mixin):
        return cls
    if (mixin, cls) not in _SUBCLASSES:
        _SUBCLASSES[mixin, cls] = type(f"EP{cls.__name__}", (mixin, cls), {"__module__": cls.__module__})
    return _SUBCLASSES[mixin, cls]


def apply_expert_parallel(model: nn.Module, layout: ParallelLayout) -> list[type]:
    """Keep this rank's experts in every MoE block (in place); the blocks' new classes (trace leaves).

    Expert parameters keep their one-process names (the ``ModuleDict`` keys are global indices); the
    swapped class is what :func:`expert_parameters` recognises.
    """
    assert layout.ep_group is not None, "apply_expert_parallel needs a layout with ep > 1"
    classes: list[type] = []
    for _name, block in moe_blocks(model):
        moe: Any = block  # follows the protocol (is_moe_block)
        num_local = moe.num_experts // layout.ep
        first = layout.ep_rank * num_local
        experts = list(moe.experts.values() if isinstance(moe.experts, nn.ModuleDict) else moe.experts)
        moe.experts = nn.ModuleDict({str(first + i): experts[first + i] for i in range(num_local)})
        moe.__class__ = ep_class(ExpertParallelBlock, type(moe))
        _set_dispatch(moe, group=layout.ep_group)
        classes.append(type(moe))
    return classes


def set_moe_capacity(model: nn.Module, capacity_factor: float, *, ep: int) -> None:
    """Give every protocol MoE block the capacity of [Note: expert capacity] (in place, before composing).

    At ep > 1 :func:`apply_expert_parallel` swaps the class later; at ep=1 the class is swapped here for the
    dispatching subclass with every expert local (no group), so the block drops like an EP block.
    transformers' fused experts: :func:`merak_core.parallel.expert_hf.set_fused_capacity`.
    """
    for _name, block in moe_blocks(model):
        moe: Any = block  # follows the protocol (is_moe_block)
        _set_dispatch(moe, capacity_factor=capacity_factor)
        if ep == 1:
            experts = list(moe.experts.values() if isinstance(moe.experts, nn.ModuleDict) else moe.experts)
            moe.experts = nn.ModuleDict({str(i): expert for i, expert in enumerate(experts)})
            moe.__class__ = ep_class(ExpertParallelBlock, type(moe))


def swapped_block_classes(model: nn.Module) -> list[type]:
    """The dispatching classes of ``model``'s blocks (trace leaves: the dispatch is data-dependent)."""
    return list(dict.fromkeys(type(m) for m in model.modules() if isinstance(m, ExpertParallelBlock)))


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters of the experts :func:`apply_expert_parallel` kept (sharded over EP)."""
    return [
        p
        for block in model.modules()
        if isinstance(block, ExpertParallelBlock)
        for p in block.experts.parameters()
    ] + [p for p in model.parameters() if expert_shard(p) is not None]  # fused experts (expert_hf)


# ---------------------------------------------------------------------------- gradient sync


class ExpertParallelGradSync:
    """The DP gradient sync of an EP model: dense gradients averaged over DP, experts' summed over their
    replica group and divided by dp (see [Note: expert gradient normalisation]).

    The same interface as :class:`merak_core.parallel.data_parallel.DataParallelGradSync` (what the engine calls).
    """

    def __init__(
        self,
        module: nn.Module,
        layout: ParallelLayout,
        *,
        deferred_params: list[nn.Parameter],
        shard_gradients: bool = False,
    ) -> None:
        assert layout.expert_replica_group is not None
        experts = {id(p): p for p in expert_parameters(module) if p.requires_grad}
        dense = [p for p in module.parameters() if p.requires_grad and id(p) not in experts]
        self.dp = layout.dp
        self.ep = layout.ep
        self.dense = DataParallelGradSync(
            dense, layout.grad_sync_group, deferred_params=deferred_params, shard_gradients=shard_gradients
        )
        self.experts = (
            DataParallelGradSync(
                list(experts.values()), layout.expert_replica_group, shard_gradients=shard_gradients
            )
            if experts
            else None
        )
        self._expert_params = list(experts.values())

    @property
    def shards_gradients(self) -> bool:
        """ZeRO-1 (see [Note: ZeRO-1 with experts]): each gradient reaches one rank of the group that shards it."""
        return self.dense.shards_gradients

    def zero_parts(self) -> list[tuple[DataParallelGradSync, ProcessGroup | None]]:
        """The syncs that shard the parameters for ZeRO-1, each with its group (dense: DP; experts: replicas)."""
        parts = [(self.dense, self.dense.group)]
        if self.experts is not None:
            parts.append((self.experts, self.experts.group))
        return parts

    def _parts(self) -> list[DataParallelGradSync]:
        return [self.dense] if self.experts is None else [self.dense, self.experts]

    @property
    def armed(self) -> bool:
        return self.dense.armed

    def prepare_step(self, num_backwards: int) -> None:
        for part in self._parts():
            part.prepare_step(num_backwards)

    def prepare_last_microbatch(self) -> None:
        self.prepare_step(1)

    def notify_grad_ready(self, params: Any) -> None:
        experts = {id(p) for p in self._expert_params}
        params = list(params)
        self.dense.notify_grad_ready([p for p in params if id(p) not in experts])
        if self.experts is not None:
            self.experts.notify_grad_ready([p for p in params if id(p) in experts])

    def finish(self) -> None:
        for part in self._parts():
            part.finish()
        # The replica average divided by dp / ep; the one-process gradient needs 1 / dp.
        for p in self._expert_params:
            if p.grad is not None:
                p.grad.div_(self.ep)

    def sync(self) -> None:
        self.prepare_last_microbatch()
        self.finish()

    def remove_hooks(self) -> None:
        for part in self._parts():
            part.remove_hooks()
