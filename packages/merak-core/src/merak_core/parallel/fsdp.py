"""ZeRO stages 2 and 3: gradients and parameters sharded over the DP axis with torch's FSDP2.

:class:`ShardedDataParallel` applies ``torch.distributed.fsdp.fully_shard`` to this rank's
part of the model over a 1-D device mesh of the rank's DP group. The parameters it shards
are whatever the model holds locally: after merak-tp, a TP layer's weight is a plain
``nn.Parameter`` with this TP rank's block, so FSDP2 shards the TP shard over DP (dim 0,
``torch.chunk`` sizes) and the TP math is untouched. A parameter becomes a ``DTensor``
sharded over the DP mesh; merak-tp's ``ShardSpec`` is copied onto it.

The object mirrors :class:`merak_core.parallel.data_parallel.DataParallelGradSync`:
:meth:`~ShardedDataParallel.prepare_step` before the step's backwards (no gradient sync,
see [Note: one gradient sync per step]), :meth:`~ShardedDataParallel.finish` after them
(reduce-scatter of the accumulated gradients; then the gradients of parameters held by
several pipeline stages are summed over their copies, on the shards).

[Note: ZeRO-2 and ZeRO-3 in FSDP2] FSDP2 always keeps the parameters sharded between
steps (the optimizer updates the shards; the next forward all-gathers them), so the two
stages differ in when parameters are gathered *during* a step:

- ZeRO-2: ``reshard_after_forward=False`` and no resharding between microbatches: each
  unit is all-gathered once per step, at its first forward, and stays gathered until the
  step's gradient reduce-scatter. Communication per step: one all-gather and one
  reduce-scatter of the parameters, exactly ZeRO-2's (DeepSpeed's all-gather of updated
  parameters after the step is this all-gather, moved to the next forward).
- ZeRO-3: parameters are gathered only around the computation that needs them:
  resharded after every forward and every backward, gathered again for the next (see
  [Note: reshard after forward per stage] for the one exception).

[Note: one gradient sync per step] As in torch.distributed.pipelining (its REDUCE_GRAD
action): every microbatch's backward runs with ``set_requires_gradient_sync(False)``, so
FSDP2 accumulates unsharded gradients; after the last backward, :meth:`finish` runs each
parameter group's post-backward with the sync on (one reduce-scatter per unit per step)
and FSDP2's end-of-backward callback. A pipeline schedule drives the backwards of its
microbatches itself, so this does not depend on which backward is the last. The price:
unsharded gradients are held during the step (a reduce-scatter per microbatch would keep
them sharded for ``num_microbatches`` times the communication). Running the post-backward
on demand reads FSDP2's private state (``_compat.fsdp_reduce_gradients``); on a torch
where that state is laid out otherwise (``_compat.fsdp_can_defer_reduce`` False) every
backward syncs instead, through the public API: one reduce-scatter per unit per
backward, accumulated into the sharded gradients (the same sum, in another order: equal
within float rounding), and :meth:`finish` only reshards.

[Note: reshard after forward per stage] Under 1F1B stage ``s`` of ``S`` holds ``S - s``
microbatches of activations at its peak, so the first stage's peak is the pipeline's.
ZeRO-3 reshards after forward on every stage except the last one when ``pp > 1``: the last
stage runs each backward right after its forward and holds one microbatch of activations,
the fewest of the pipeline, so keeping its units gathered from forward to backward leaves
the step's peak (set by the first stage) unchanged and saves one all-gather per unit per
microbatch. At ``pp == 1`` the only stage's peak is the end of its forward, so it reshards.
``reshard_after_forward=`` overrides the rule.

[Note: FSDP units] A pipeline stage (``nn.Sequential`` of traced shards) is run unit by
unit by merak-pipe, never through the container's ``forward``, so each unit is its own
FSDP2 root (``fully_shard(unit)``); a whole model (``pp == 1``) is sharded per transformer
block (each element of an ``nn.ModuleList``) and then at the root. A parameter used by two
units of one stage cannot be sharded per unit and is refused.

[Note: bf16 parameter gathers] Training in bf16 (autocast) with float32 master weights,
``param_dtype=torch.bfloat16`` gives every unit FSDP2's
``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)``: the shards are cast
to bf16 before the all-gather (half the bytes of a float32 gather, and no float32 copy of
the unsharded parameters), forward and backward use the bf16 parameters, gradients are
accumulated and reduce-scattered in float32 and the optimizer updates float32 shards. The
matmuls see the same bf16 weights autocast would have made; other ops (embeddings,
hand-written norms, additions) now see bf16 weights and may produce bf16 activations
where autocast kept float32: the results differ from the float32-gather path within bf16
rounding. Inputs are not cast (``cast_forward_inputs=False``): what flows between stages
is what the stage computes.

[Note: frozen parameters under ZeRO-2/3] A parameter with ``requires_grad=False`` (a LoRA
run's base weights) is given to ``fully_shard`` as an ``ignored_params`` entry: it stays a plain
tensor, whole on every DP rank, and FSDP2 neither all-gathers it, nor reduce-scatters a gradient
for it (it has none), nor holds optimizer state for it. Only the trainable parameters (the
adapters) are sharded over DP, gathered around their units' compute and reduce-scattered; a unit
(or block) with no trainable parameter is not made an FSDP2 unit at all. A frozen shared (tied)
parameter gets no cross-stage gradient sum.

[Note: ZeRO-2/3 at cp > 1] The CP ranks of a DP rank hold the same parameters (each computes on its
own tokens of the same samples), so the parameters are sharded over the DP x CP ranks of a stage and
TP rank (``layout.grad_sync_group``, a 1-D mesh of ``dp * cp`` ranks): the reduce-scatter averages
the gradients over them, exactly as the unsharded sync does (merak_core.parallel.context_parallel
[Note: cp loss]); the all-gathers and the global norm run over the same mesh.

At ep > 1 the experts are sharded first, by their own ``fully_shard`` over their expert-replica group, and
the dense units over DP: [Note: ZeRO-2/3 with experts] in :mod:`merak_core.parallel.zero_experts`.

Not done here: ZeRO-1 (:mod:`merak_core.parallel.zero`), the replicated all-reduce
(:mod:`merak_core.parallel.data_parallel`), CPU offload.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

from merak_core.parallel import _compat
from merak_core.parallel.fused_experts import expert_shard, set_expert_shard
from merak_core.parallel.zero_experts import ExpertSharding, finish_expert_gradients, shard_experts
from merak_core.parallel.zero_tensors import (
    copy_into_shard_,
    full_local_tensor,
    is_sharded,
    local_tensor,
    shard_like,
)
from merak_tp.parallelize import grad_sum_groups
from merak_tp.shard_spec import get_shard_spec, has_shard_spec, set_shard_spec

logger = logging.getLogger(__name__)

SHARDED_ZERO_STAGES = (2, 3)


def default_reshard_after_forward(zero_stage: int, *, stage_index: int, num_stages: int) -> bool:
    """The rule of [Note: reshard after forward per stage] (pure)."""
    if zero_stage not in SHARDED_ZERO_STAGES:
        raise ValueError(f"zero_stage={zero_stage!r}: FSDP2 sharding is ZeRO stage 2 or 3")
    if zero_stage == 2:
        return False
    return num_stages == 1 or stage_index < num_stages - 1


_WARNED_NOTHING_TO_SHARD: set[int] = set()


def nothing_to_shard_message(zero_stage: int, dp: int) -> str | None:
    """The warning for a ZeRO stage that has no DP axis to shard over (``dp == 1``), else None (pure).

    ZeRO-1/2/3 shard over the DP ranks; with one there is nothing to shard, so the run holds and
    computes exactly what ZeRO-0 does (same numbers, same memory). That is allowed (one job file can
    serve several layouts, and ``layout: auto`` may choose dp=1), but not silently.
    """
    if zero_stage in (0, None) or dp != 1:
        return None
    return (
        f"zero_stage={zero_stage} with dp=1: there is only one data-parallel rank, so nothing is sharded "
        "and the run holds whole parameters, gradients and optimizer states, exactly as zero_stage 0 "
        "(the numbers are the same). Set dp >= 2 to shard, or zero_stage: 0 to say what runs"
    )


def warn_nothing_to_shard(zero_stage: int, dp: int) -> None:
    """Log :func:`nothing_to_shard_message` once per process and ZeRO stage (on global rank 0 when a
    process group exists); nothing when there is something to shard."""
    message = nothing_to_shard_message(zero_stage, dp)
    if message is None or zero_stage in _WARNED_NOTHING_TO_SHARD:
        return
    _WARNED_NOTHING_TO_SHARD.add(zero_stage)
    if not dist.is_initialized() or dist.get_rank() == 0:
        logger.warning("%s", message)


def check_sharding_supported(zero_stage: int, schedule_name: str) -> None:
    """Refuse what ZeRO-2/3 cannot run exactly, before any collective (pure; the config check calls it).

    ``schedule_name``: a merak-pipe schedule name or spelling (``auto`` is accepted). A schedule
    that splits the backward (``I`` then ``W`` actions: its ``split_backward`` capability) computes
    weight gradients with ``torch.autograd.grad`` against the registered (sharded) parameters,
    which FSDP2 swaps for gathered ones during compute: those gradients would be lost.
    """
    if zero_stage not in SHARDED_ZERO_STAGES or schedule_name == "auto":
        return
    from merak_pipe import schedule_info

    if schedule_info(schedule_name).split_backward:
        raise ValueError(
            f"zero_stage={zero_stage} with schedule={schedule_name!r}: the schedule splits the backward into "
            "input- and weight-gradient actions (I/W), which FSDP2-sharded parameters do not support (the "
            "weight gradients would be lost); expected a schedule with full backwards. Use schedule 1f1b, "
            "gpipe or shifted_critical_path with ZeRO-2/3, or zero_stage 0/1 with this schedule"
        )


def fsdp_units(module: nn.Module) -> list[nn.Module]:
    """The modules that become FSDP2 roots (see [Note: FSDP units])."""
    if isinstance(module, nn.Sequential):
        return [unit for unit in module if any(True for _ in unit.parameters())]
    return [module]


def _blocks(root: nn.Module) -> list[nn.Module]:
    """Elements of ``nn.ModuleList`` containers below ``root`` (transformer blocks), outermost lists only."""
    blocks: list[nn.Module] = []
    inside: set[int] = set()
    for _, sub in root.named_modules():
        if id(sub) in inside or not isinstance(sub, nn.ModuleList):
            continue
        for child in sub:
            if any(True for _ in child.parameters()):
                blocks.append(child)
            inside.update(id(m) for m in child.modules())
    return blocks


class ShardedDataParallel:
    """ZeRO-2/3 for this rank's stage modules over the DP group (see the module docstring).

    Args:
        stages: pipeline stage index -> this rank's module of that stage (``nn.Sequential`` of
            units, or the whole model at ``pp == 1``: ``{0: model}``), on its device.
        dp_group: the ranks that hold the same parameters: ``layout.grad_sync_group`` (the DP group, or
            the DP x CP ranks of this stage and TP rank at cp > 1: [Note: ZeRO-2/3 at cp > 1]).
        zero_stage: 2 or 3.
        device_type: ``"cpu"`` or ``"cuda"`` (the mesh's device type).
        num_stages: the pipeline's number of stages (virtual stages included), for the reshard rule.
        shared_parameters: ``[(param, group)]`` parameters held by several stages, summed over
            ``group`` after the reduce-scatter (the pipeline runner must then not sum them).
        reshard_after_forward: override [Note: reshard after forward per stage].
        param_dtype: the dtype parameters are all-gathered and computed in (``torch.bfloat16`` under
            bf16 training, see [Note: bf16 parameter gathers]); ``None``: the parameters' own dtype.
        experts: at ep > 1, the experts' replica group: the experts are sharded over it, apart from the
            dense parameters ([Note: ZeRO-2/3 with experts] in merak_core.parallel.zero_experts).
    """

    def __init__(
        self,
        stages: Mapping[int, nn.Module],
        dp_group: ProcessGroup,
        *,
        zero_stage: int,
        device_type: str,
        num_stages: int = 1,
        shared_parameters: Sequence[tuple[nn.Parameter, ProcessGroup | None]] = (),
        reshard_after_forward: bool | None = None,
        param_dtype: torch.dtype | None = None,
        experts: ExpertSharding | None = None,
    ) -> None:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        if zero_stage not in SHARDED_ZERO_STAGES:
            raise ValueError(
                f"zero_stage={zero_stage!r}: ShardedDataParallel implements ZeRO stage 2 or 3 "
                "(use merak_core.parallel.zero.ZeroOptimizer for stage 1)"
            )
        if not stages:
            raise ValueError("ShardedDataParallel needs at least one stage module")
        if param_dtype is not None and not param_dtype.is_floating_point:
            raise ValueError(f"param_dtype must be a floating dtype (e.g. torch.bfloat16), got {param_dtype}")
        # [Note: bf16 parameter gathers]
        policy = (
            MixedPrecisionPolicy(
                param_dtype=param_dtype, reduce_dtype=torch.float32, cast_forward_inputs=False
            )
            if param_dtype is not None
            else MixedPrecisionPolicy()
        )
        self.param_dtype = param_dtype
        self.zero_stage = zero_stage
        self.dp_group = dp_group
        self.dp_size = dist.get_world_size(dp_group)
        # The axis name carries the group's name: DTensor caches sharding results by mesh, and meshes
        # compare equal by their ranks, so a mesh over a later group of the same ranks (a second
        # layout in one process) would otherwise be answered with the first group's mesh.
        self.mesh = DeviceMesh.from_group(
            dp_group, device_type, mesh_dim_names=(f"dp:{dp_group.group_name}",)
        )
        self.reshard_after_forward = {
            index: (
                default_reshard_after_forward(zero_stage, stage_index=index, num_stages=num_stages)
                if reshard_after_forward is None
                else bool(reshard_after_forward)
            )
            for index in stages
        }
        """Stage index -> whether its units reshard after forward."""
        # [Note: frozen parameters under ZeRO-2/3]
        frozen = {p for module in stages.values() for p in module.parameters() if not p.requires_grad}
        units = {index: fsdp_units(module) for index, module in stages.items()}
        _check_units_disjoint([u for index in sorted(units) for u in units[index]])
        before = {id(p): p for module in stages.values() for p in module.parameters() if p.requires_grad}
        names_before = [dict(module.named_parameters(remove_duplicate=False)) for module in stages.values()]
        expert_params = (
            shard_experts(
                stages,
                experts,
                device_type=device_type,
                reshard_after_forward=self.reshard_after_forward,
                mp_policy=policy,
                frozen=frozen,
            )
            if experts is not None
            else []
        )
        self.roots: list[Any] = []
        self.root_stages: list[int] = []
        """The pipeline stage index of each of :attr:`roots`."""
        self._reshard_between: list[bool] = []
        for index in sorted(units):
            reshard = self.reshard_after_forward[index]
            for unit in units[index]:
                if not _trains(unit):
                    continue  # every parameter frozen: nothing to shard, gather or reduce
                blocks = _blocks(unit) if not isinstance(stages[index], nn.Sequential) else []
                for module in [*(b for b in blocks if _trains(b)), unit]:
                    fully_shard(
                        module,
                        mesh=self.mesh,
                        reshard_after_forward=reshard,
                        mp_policy=policy,
                        ignored_params=frozen or None,
                    )
                self.roots.append(unit)
                self.root_stages.append(index)
                # Between microbatches ZeRO-3 gives the memory back; ZeRO-2 keeps the gather for the step.
                self._reshard_between.append(zero_stage == 3 and reshard)
        self.param_map: dict[int, nn.Parameter] = {}
        """id(parameter before sharding) -> the sharded parameter that replaced it."""
        for module, names in zip(stages.values(), names_before, strict=True):
            self.param_map.update(_new_parameters(module, names))
        assert all(key in self.param_map for key in before), "a parameter was not sharded"
        self.frozen = frozen
        """Parameters left whole and unsharded ([Note: frozen parameters under ZeRO-2/3])."""
        self.experts = experts
        self.expert_params = self.remap(expert_params)
        """The trainable expert parameters, sharded over their replica group ([Note: ZeRO-2/3 with experts])."""
        self.shared_parameters = [
            (self.param_map.get(id(p), p), g) for p, g in shared_parameters if p.requires_grad
        ]
        self.tp_summed = [(self.param_map[key], g) for key, p in before.items() for g in grad_sum_groups(p)]
        """Sharded parameters whose gradient is summed over a TP group after the reduce-scatter: merak-tp's
        hooks on the originals never run under FSDP2 ([Note: gradient sum hooks] in merak_tp.parallelize)."""
        self.deferred_reduce = all(_compat.fsdp_can_defer_reduce(root) for root in self.roots)
        """True: one reduce-scatter per unit per step (see [Note: one gradient sync per step]);
        False (a torch whose FSDP2 state merak cannot drive): one per unit per backward."""
        self._armed = False
        logger.debug(
            "ZeRO-%d over %d DP ranks: %d FSDP units, reshard_after_forward=%s",
            zero_stage,
            self.dp_size,
            len(self.roots),
            self.reshard_after_forward,
        )

    def remap(self, params: Iterable[nn.Parameter]) -> list[nn.Parameter]:
        """The sharded parameters that replaced ``params`` (others unchanged)."""
        return [self.param_map.get(id(p), p) for p in params]

    # ------------------------------------------------------------------ a step

    @property
    def armed(self) -> bool:
        """True between :meth:`prepare_step` and :meth:`finish`."""
        return self._armed

    def prepare_step(self, num_backwards: int = 1) -> None:
        """Before the step's backwards: accumulate without syncing ([Note: one gradient sync per step])."""
        if isinstance(num_backwards, bool) or not isinstance(num_backwards, int) or num_backwards < 1:
            raise ValueError(f"num_backwards must be a positive integer, got {num_backwards!r}")
        if self._armed:
            raise RuntimeError(
                "the sharded gradient sync is already armed: call finish() before arming it again"
            )
        for root, reshard in zip(self.roots, self._reshard_between, strict=True):
            # Without the deferred reduce, every backward syncs and waits for its own reduce-scatter.
            root.set_is_last_backward(not self.deferred_reduce)
            root.set_requires_gradient_sync(not self.deferred_reduce)
            root.set_reshard_after_backward(reshard)
        self._armed = True

    def finish(self) -> None:
        """After the last backward: reduce-scatter the accumulated gradients, reshard, sum shared copies."""
        if not self._armed:
            raise RuntimeError("finish() without prepare_step(): nothing is being synchronised")
        try:
            for root in self.roots:
                root.set_is_last_backward(True)
                root.set_requires_gradient_sync(True)
                root.set_reshard_after_backward(True)
                if self.deferred_reduce:
                    _compat.fsdp_reduce_gradients(root)
                else:
                    root.reshard()  # the gradients were reduced by each backward
        finally:
            self._armed = False
        if self.experts is not None:
            finish_expert_gradients(self.expert_params, self.experts.ep)
        self._sum_shared_gradients()

    def _sum_shared_gradients(self) -> None:
        """Each copy is sharded the same way over DP, so the sum of the shards is the shard of the sum (the
        same for the TP ranks' partial gradients of :attr:`tp_summed`)."""
        pending = []
        for param, group in [*self.shared_parameters, *self.tp_summed]:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            local = local_tensor(param.grad)
            pending.append((param, dist.all_reduce(local, op=dist.ReduceOp.SUM, group=group, async_op=True)))
        for param, work in pending:
            assert work is not None
            try:
                work.wait()
            except Exception as err:
                raise RuntimeError(
                    f"rank {dist.get_rank()}: all-reduce of a shared parameter's gradient shard "
                    f"{tuple(local_tensor(param).shape)} failed: {err}. A peer probably died"
                ) from err

    def unsharded_bytes(self) -> tuple[int, int]:
        """(gathered parameter bytes, unsharded gradient bytes) held now, beyond the shards.

        Zero between steps; during a step it is what [Note: ZeRO-2 and ZeRO-3 in FSDP2] and
        [Note: one gradient sync per step] describe (read it right before :meth:`finish` for the
        step's largest value). For memory measurements (``benchmarks/bench_core_memory.py``).
        """
        by_stage = self.unsharded_bytes_by_stage()
        return sum(p for p, _ in by_stage.values()), sum(g for _, g in by_stage.values())

    def unsharded_bytes_by_stage(self) -> dict[int, tuple[int, int]]:
        """:meth:`unsharded_bytes` per pipeline stage index of this rank."""
        out = dict.fromkeys(sorted(set(self.root_stages)), (0, 0))
        for root, stage in zip(self.roots, self.root_stages, strict=True):
            p, g = _compat.fsdp_unsharded_bytes(root)
            out[stage] = (out[stage][0] + p, out[stage][1] + g)
        return out

    def reshard(self) -> None:
        """Free gathered parameters (e.g. after an evaluation that ran forwards only)."""
        for root in self.roots:
            root.reshard()


def _trains(module: nn.Module) -> bool:
    """Whether ``module`` holds a parameter that trains."""
    return any(p.requires_grad for p in module.parameters())


def _check_units_disjoint(units: Sequence[nn.Module]) -> None:
    owner: dict[int, int] = {}
    for index, unit in enumerate(units):
        for name, p in unit.named_parameters():
            if p.requires_grad and owner.setdefault(id(p), index) != index:  # a frozen one is not sharded
                raise ValueError(
                    f"parameter {name!r} is used by units {owner[id(p)]} and {index} of one pipeline stage, which "
                    "FSDP2 cannot shard unit by unit: use zero_stage 0 or 1 for this model and layout, or a "
                    "layout whose stages do not cut between the two uses"
                )


def _new_parameters(module: nn.Module, before: dict[str, nn.Parameter]) -> dict[int, nn.Parameter]:
    """Map the parameters before sharding to the ones FSDP2 registered under the same names, with merak's tags."""
    mapping: dict[int, nn.Parameter] = {}
    for name, new in module.named_parameters(remove_duplicate=False):
        original = before.get(name)
        if original is None or original is new:
            continue
        mapping[id(original)] = new
        if has_shard_spec(original):
            set_shard_spec(new, get_shard_spec(original))
        record = expert_shard(original)  # a fused experts slice ([Note: expert shard record])
        if record is not None:
            set_expert_shard(new, record)
    return mapping


__all__ = [
    "SHARDED_ZERO_STAGES",
    "ShardedDataParallel",
    "check_sharding_supported",
    "copy_into_shard_",
    "default_reshard_after_forward",
    "fsdp_units",
    "full_local_tensor",
    "is_sharded",
    "local_tensor",
    "nothing_to_shard_message",
    "shard_like",
    "warn_nothing_to_shard",
]
