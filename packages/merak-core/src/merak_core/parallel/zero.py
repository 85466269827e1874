"""ZeRO stage 1: optimizer states sharded over the data-parallel group.

:class:`ZeroOptimizer` wraps any standard torch optimizer. Every parameter is
owned by exactly one DP rank (whole parameters, assigned greedily by size so the
shards are balanced, deterministically on every rank); each rank builds the user's
optimizer, through a factory, over the parameters it owns only, so Adam moments
etc. exist once per DP group instead of once per rank. ``step()`` updates the
owned parameters and then sends them to the rest of the group:

- with ``grad_sync`` (a :class:`~merak_core.parallel.data_parallel.DataParallelGradSync` built with
  ``shard_gradients=True``, as the Trainer does): ownership is the sync's, whose buckets
  reduce-scattered each parameter's averaged gradient to its owner only; the updated
  parameters return by one ``all_gather_into_tensor`` per bucket and dtype, in the same
  owner-by-owner padded layout (:mod:`merak_core.parallel.zero_layout`). A rank sends
  ``2 (dp-1)/dp`` of the gradient bytes per step, half of an all-reduce plus broadcasts;
- without it (gradients all-reduced by the caller): one broadcast per owner and dtype of
  a flat buffer packing that owner's parameters.

The math is the unsharded optimizer's: an element-wise optimizer (SGD, Adam,
AdamW, ...) gives bit-identical parameters, because each parameter sees exactly
the same update as without sharding. Gradients must already be DP-averaged
(:class:`merak_core.parallel.data_parallel.DataParallelGradSync`) and clipped before
``step()``.

The wrapper is a ``torch.optim.Optimizer`` whose ``param_groups`` hold *all*
parameters with the inner optimizer's hyper-parameters, so learning-rate
schedulers and ``zero_grad`` work unchanged; hyper-parameters are copied to the
inner optimizer at each step.

Not done here: sharding gradients or parameters (ZeRO-2/3), and optimizers whose
update couples several parameters across shards (e.g. a global-norm based LAMB
trust ratio over all parameters is fine per parameter, but a cross-parameter
statistic would not be).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup
from torch.optim import Optimizer

from merak_core.parallel import _compat
from merak_core.parallel.data_parallel import DataParallelGradSync
from merak_core.parallel.zero_layout import (
    OwnerLayout,
    all_gather_dim0,
    lay_out_by_owner,
    partition_parameters,
)

if TYPE_CHECKING:
    from merak_core.parallel.expert_parallel import ExpertParallelGradSync

logger = logging.getLogger(__name__)

ParamGroups = list[dict[str, Any]]
OptimizerFactory = Callable[[ParamGroups], Optimizer]


class ZeroOptimizer(Optimizer):
    """ZeRO-1: ``optimizer_factory`` builds a torch optimizer over this rank's parameter shard.

    Args:
        params: parameters or parameter-group dicts, exactly as for a torch optimizer
            (group options such as ``weight_decay`` are kept).
        optimizer_factory: called once with this rank's parameter groups (same number
            and order of groups, only owned parameters, possibly empty), e.g.
            ``lambda groups: torch.optim.AdamW(groups, lr=1e-3)``.
        group: the DP process group (``layout.dp_group``); ``None`` = default group.
        grad_sync: the DP gradient sync over the same group built with ``shard_gradients=True``:
            its parameter ownership is used and the step all-gathers (see the module docstring). An
            expert-parallel sync (:class:`~merak_core.parallel.expert_parallel.ExpertParallelGradSync`) names
            its parts with ``zero_parts()``: dense parameters are owned and gathered over DP, experts over
            their expert-replica group.
    """

    def __init__(
        self,
        params: Iterable[nn.Parameter] | Iterable[dict[str, Any]],
        optimizer_factory: OptimizerFactory,
        *,
        group: ProcessGroup | None = None,
        grad_sync: DataParallelGradSync | ExpertParallelGradSync | None = None,
    ) -> None:
        groups = _normalise_groups(params)
        self.group = group
        self.dp_size = dist.get_world_size(group)
        self.dp_rank = dist.get_rank(group)
        self._all_params = [p for g in groups for p in g["params"]]
        if len({id(p) for p in self._all_params}) != len(self._all_params):
            raise ValueError("a parameter appears twice in the parameter groups given to ZeroOptimizer")
        self._sync = grad_sync if grad_sync is not None and grad_sync.shards_gradients else None
        self._parts = _sync_parts(self._sync, group)
        self.owners, self._mine = self._owners()
        mine = {id(p) for p, m in zip(self._all_params, self._mine, strict=True) if m}
        local_groups = [
            {
                **{k: v for k, v in g.items() if k != "params"},
                "params": [p for p in g["params"] if id(p) in mine],
            }
            for g in groups
        ]
        self.inner = optimizer_factory(local_groups)
        if len(self.inner.param_groups) != len(groups):
            raise ValueError(
                f"optimizer_factory returned an optimizer with {len(self.inner.param_groups)} parameter groups "
                f"for {len(groups)} given: build it from the groups it receives, e.g. "
                "lambda groups: torch.optim.AdamW(groups, lr=...)"
            )
        full_groups = [
            {**{k: v for k, v in inner_group.items() if k != "params"}, "params": g["params"]}
            for inner_group, g in zip(self.inner.param_groups, groups, strict=True)
        ]
        super().__init__(full_groups, dict(self.inner.defaults))
        self._buckets = self._plan_broadcast()
        self._gather = self._plan_gather()
        owned = sum(p.numel() for p, m in zip(self._all_params, self._mine, strict=True) if m)
        logger.debug(
            "ZeRO-1 rank %d/%d owns %d of %d elements",
            self.dp_rank,
            self.dp_size,
            owned,
            sum(p.numel() for p in self._all_params),
        )

    def _owners(self) -> tuple[list[int], list[bool]]:
        """Each parameter's owner (its rank in the group that shards it) and whether this rank owns it."""
        if self._sync is None:
            owners = partition_parameters([p.numel() for p in self._all_params], self.dp_size)
            return owners, [o == self.dp_rank for o in owners]
        dense = self._parts[0][0]
        if dense.world_size != self.dp_size:
            raise ValueError(
                f"grad_sync runs over {dense.world_size} ranks but the optimizer's group has {self.dp_size}: "
                "build both over the DP group"
            )
        owners, mine = [], []
        for p in self._all_params:
            part = next((part for part, _ in self._parts if part.synchronises(p)), None)
            if part is None:
                raise ValueError(
                    "a parameter given to ZeroOptimizer is not synchronised by grad_sync: build the sync over "
                    "the same (trainable) parameters"
                )
            owners.append(part.owner_of(p))
            mine.append(owners[-1] == part.dp_rank)
        return owners, mine

    # ------------------------------------------------------------------ step

    def _plan_gather(self) -> list[_Gather]:
        """Per sync part, bucket and parameter dtype: the parameters in owner-by-owner padded layout."""
        in_optimizer = {id(p) for p in self._all_params}
        plan = []
        for part, group in self._parts:
            if part.world_size == 1:
                continue  # an expert-replica group of one rank (dp == ep): nothing to gather
            for bucket in part.buckets:
                by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
                for p in bucket.params:
                    if id(p) in in_optimizer:
                        by_dtype.setdefault(p.dtype, []).append(p)
                for dtype in sorted(by_dtype, key=str):
                    ps = by_dtype[dtype]
                    placed = lay_out_by_owner(
                        [p.numel() for p in ps], part.world_size, [part.owner_of(p) for p in ps]
                    )
                    plan.append(
                        _Gather([ps[i] for i in placed.order], placed, group, part.dp_rank, part.world_size)
                    )
        return plan

    def _plan_broadcast(self) -> list[tuple[int, list[nn.Parameter]]]:
        """(owner, parameters) per flat broadcast buffer: one per owner, dtype and device."""
        buckets: dict[tuple[int, torch.dtype, torch.device], list[nn.Parameter]] = {}
        for p, owner in zip(self._all_params, self.owners, strict=True):
            buckets.setdefault((owner, p.dtype, p.device), []).append(p)
        return [
            (owner, params)
            for (owner, _, _), params in sorted(
                buckets.items(), key=lambda kv: (kv[0][0], str(kv[0][1]), str(kv[0][2]))
            )
        ]

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Step the owned shard with the inner optimizer, then broadcast updated parameters."""
        for full, local in zip(self.param_groups, self.inner.param_groups, strict=True):
            for key, value in full.items():
                if key != "params":
                    local[key] = value
        loss: float | None
        if closure is not None:
            with torch.enable_grad():
                loss = self.inner.step(closure)
        else:
            loss = self.inner.step()
        if self._sync is not None:
            self._all_gather_parameters()
        else:
            self._broadcast_parameters()
        return loss

    def _all_gather_parameters(self) -> None:
        pending = []
        for gather in self._gather:
            params, placed, rank = gather.params, gather.placed, gather.rank
            p0 = params[0]
            mine = torch.zeros(placed.segment_numel, dtype=p0.dtype, device=p0.device)  # zero padding
            start = rank * placed.segment_numel
            for p, offset, owner in zip(params, placed.offsets, placed.owners, strict=True):
                if owner == rank:
                    mine.narrow(0, offset - start, p.numel()).copy_(p.detach().reshape(-1))
            flat = torch.empty(placed.segment_numel * gather.size, dtype=p0.dtype, device=p0.device)
            pending.append((gather, flat, all_gather_dim0(flat, mine, gather.group)))
        for gather, flat, work in pending:
            assert work is not None
            try:
                work.wait()
            except Exception as err:
                raise RuntimeError(
                    f"rank {dist.get_rank()}: ZeRO-1 all-gather of {len(gather.params)} updated parameters failed: "
                    f"{err}. A peer probably died or skipped optimizer.step()"
                ) from err
            for p, offset, owner in zip(
                gather.params, gather.placed.offsets, gather.placed.owners, strict=True
            ):
                if owner != gather.rank:
                    p.detach().copy_(flat.narrow(0, offset, p.numel()).view_as(p))

    def _broadcast_parameters(self) -> None:
        if self.dp_size == 1:
            return
        pending = []
        for owner, params in self._buckets:
            if owner == self.dp_rank:
                flat = torch.cat([p.detach().reshape(-1) for p in params])
            else:
                flat = torch.empty(
                    sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device
                )
            work = _compat.broadcast_from_group_rank(flat, owner, self.group, async_op=True)
            pending.append((owner, params, flat, work))
        for owner, params, flat, work in pending:
            assert work is not None
            try:
                work.wait()
            except Exception as err:
                raise RuntimeError(
                    f"rank {dist.get_rank()}: ZeRO-1 broadcast of the parameters owned by DP rank {owner} "
                    f"({len(params)} tensors) failed: {err}. A peer probably died or skipped optimizer.step()"
                ) from err
            if owner == self.dp_rank:
                continue
            offset = 0
            for p in params:
                p.detach().copy_(flat[offset : offset + p.numel()].view_as(p))
                offset += p.numel()

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        """This rank's shard: the inner optimizer's state plus the partition it belongs to."""
        return {
            "zero_stage": 1,
            "dp_size": self.dp_size,
            "dp_rank": self.dp_rank,
            "owners": list(self.owners),
            "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups],
            "inner": self.inner.state_dict(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a shard saved by :meth:`state_dict` on the same DP rank of the same layout."""
        if state_dict.get("zero_stage") != 1:
            raise ValueError(
                f"not a ZeRO-1 shard (zero_stage={state_dict.get('zero_stage')!r}); for a plain optimizer "
                "state dict use load_full_state_dict"
            )
        for key, mine in (
            ("dp_size", self.dp_size),
            ("dp_rank", self.dp_rank),
            ("owners", list(self.owners)),
        ):
            if state_dict[key] != mine:
                raise ValueError(
                    f"ZeRO-1 shard was saved with {key}={state_dict[key]!r} but this optimizer has {key}={mine!r}: "
                    "load the shard of the same DP rank and parameter layout, or reshard through "
                    "consolidate_state_dict/load_full_state_dict"
                )
        self.inner.load_state_dict(state_dict["inner"])
        for group, saved in zip(self.param_groups, state_dict["param_groups"], strict=True):
            group.update(saved)

    def _global_indices_of_owned(self) -> list[int]:
        return [i for i, m in enumerate(self._mine) if m]

    def consolidate_state_dict(self) -> dict[str, Any]:
        """The unsharded state dict, as a plain optimizer over all parameters would save it.

        Collective over the DP group (``all_gather_object``); every rank gets the result, with
        its tensors on the CPU (object collectives pickle through host memory: a CUDA tensor
        would be unpickled onto the sender's GPU index on every rank).
        """
        if len(self._parts) > 1:
            raise ValueError(
                "consolidate_state_dict under expert parallelism: parameter indices name other experts on other "
                "EP ranks; save a checkpoint (states are kept by parameter name) instead"
            )
        local = self.inner.state_dict()
        mine = self._global_indices_of_owned()
        # Inner optimizer indices run over its groups in order: position k <-> mine[k].
        shard = {mine[k]: _to_cpu(state) for k, state in local["state"].items()}
        gathered: list[dict[int, Any]] = [{} for _ in range(self.dp_size)]
        dist.all_gather_object(gathered, shard, group=self.group)
        state: dict[int, Any] = {}
        for part in gathered:
            state.update(part)
        param_groups = []
        start = 0
        for group in self.param_groups:
            n = len(group["params"])
            param_groups.append(
                {**{k: v for k, v in group.items() if k != "params"}, "params": list(range(start, start + n))}
            )
            start += n
        return {"state": dict(sorted(state.items())), "param_groups": param_groups}

    def load_full_state_dict(self, full: dict[str, Any]) -> None:
        """Load an unsharded optimizer state dict (any DP size saved it); keep this rank's shard."""
        if len(full["param_groups"]) != len(self.param_groups):
            raise ValueError(
                f"state dict has {len(full['param_groups'])} parameter groups, this optimizer "
                f"{len(self.param_groups)}: build the optimizer with the same groups"
            )
        mine = self._global_indices_of_owned()
        local_state = {k: full["state"][g] for k, g in enumerate(mine) if g in full["state"]}
        local_groups = []
        k = 0
        owned = set(mine)
        start = 0
        for saved, group in zip(full["param_groups"], self.param_groups, strict=True):
            n = len(group["params"])
            count = sum(1 for i in range(start, start + n) if i in owned)
            local_groups.append(
                {
                    **{key: v for key, v in saved.items() if key != "params"},
                    "params": list(range(k, k + count)),
                }
            )
            k += count
            start += n
        self.inner.load_state_dict({"state": local_state, "param_groups": local_groups})
        for group, saved in zip(self.param_groups, full["param_groups"], strict=True):
            group.update({key: v for key, v in saved.items() if key != "params"})


@dataclass(frozen=True)
class _Gather:
    """One all-gather of updated parameters: a bucket's parameters of one dtype, over the group that shards them."""

    params: list[nn.Parameter]
    placed: OwnerLayout
    group: ProcessGroup | None
    rank: int
    size: int


def _sync_parts(
    grad_sync: DataParallelGradSync | ExpertParallelGradSync | None, group: ProcessGroup | None
) -> list[tuple[DataParallelGradSync, ProcessGroup | None]]:
    """The gradient syncs that shard the parameters, each with its group: the DP sync, or under expert
    parallelism its dense part (over DP) and its experts' part (over the expert-replica group)."""
    if grad_sync is None:
        return []
    if isinstance(grad_sync, DataParallelGradSync):
        return [(grad_sync, group)]
    return grad_sync.zero_parts()


def _to_cpu(state: dict[str, Any]) -> dict[str, Any]:
    return {k: v.detach().cpu() if isinstance(v, torch.Tensor) else v for k, v in state.items()}


def _normalise_groups(params: Iterable[nn.Parameter] | Iterable[dict[str, Any]]) -> ParamGroups:
    items = list(params)
    if not items:
        raise ValueError("ZeroOptimizer got an empty parameter list")
    if all(isinstance(item, dict) for item in items):
        groups: ParamGroups = [dict(item) for item in items if isinstance(item, dict)]
        for g in groups:
            ps = g["params"]
            g["params"] = [ps] if isinstance(ps, torch.Tensor) else list(ps)
        return groups
    if any(isinstance(item, dict) for item in items):
        raise ValueError("mix of parameters and parameter-group dicts: pass one kind")
    return [{"params": items}]


__all__ = ["OptimizerFactory", "ZeroOptimizer", "partition_parameters"]
