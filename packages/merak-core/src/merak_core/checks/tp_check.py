"""``merak check``: does a TP plan shard a model exactly? Every sharded module against the unsharded one.

The job's model is built twice on ``tp`` CPU processes (gloo, forked here, no
torchrun): once unsharded, once through ``merak_tp.parallelize`` with the job's
plan, with the same weights (same seed) in float64. One batch of the training
data goes through both; a forward hook on every module the plan replaces (and on
every region) records its output, sharded outputs are gathered over the TP ranks,
and the largest difference to the unsharded module's output is reported per
module, relative to the largest magnitude of that output. The loss's gradient
with respect to the inputs of the model is not compared; the parameters are the
same by construction.

A module that is wrong (a fused projection split as one block, a scale dropped, a
head count not divided) shows a difference of the order of its output; an exact
plan shows rounding only (~1e-15 in float64). It runs on the real model, so it
needs the model to fit ``tp`` times in this machine's memory.

``check_before_training`` is the same comparison on a running job's TP group
(``training.tp_check: true``: the Trainer runs it once before sharding its model).
``check_sequence_parallel`` refuses ``training.sequence_parallel: true`` for a plan
without sequence parallelism, from the model alone (no process group needed).
``merak check`` itself (a job's model, or a tiny config of its family when it is too big)
is :mod:`merak_core.checks.tp_check_job`.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = [
    "FLOAT32_TOLERANCE",
    "FLOAT64_TOLERANCE",
    "ModuleDifference",
    "check_before_training",
    "check_plan_numerics",
    "check_sequence_parallel",
    "compare_sharded_modules",
    "default_tolerance",
    "format_report",
    "resolve_plan",
]


@dataclass(frozen=True)
class ModuleDifference:
    """One sharded module's output against the unsharded module's."""

    name: str
    kind: str
    """Class of the parallel module (``ColumnParallelLinear``, ``TPRegion[...]``...)."""
    max_abs: float
    """Largest absolute difference."""
    scale: float
    """Largest magnitude of the unsharded output."""
    float32_inside: bool = False
    """The model computed some values in float32 although it ran in float64 (norms or routers that
    upcast to float32 by design): differences up to float32 rounding are exact for it."""

    @property
    def relative(self) -> float:
        return self.max_abs / self.scale if self.scale > 0 else self.max_abs


def _first_tensor(out: Any) -> torch.Tensor | None:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    return None


def _gather_output(module: nn.Module, out: torch.Tensor, group: Any) -> torch.Tensor:
    """The full output of a module whose output features are split over the TP ranks."""
    import merak_tp

    weight = getattr(module, "weight", None)
    sharded = (isinstance(module, merak_tp.ColumnParallelLinear) and not module.gather_output) or isinstance(
        module, merak_tp.ShardedRMSNorm
    )
    if not sharded or weight is None or dist.get_world_size(group) == 1:
        return out
    t = out.detach().movedim(-1, 0).contiguous()
    spec = merak_tp.ShardSpec(0, merak_tp.get_shard_spec(weight).sections)  # the weight's dim-0 sections
    return spec.gather(t, group).movedim(0, -1)


def _record(model: nn.Module, names: list[str], into: dict[str, torch.Tensor]) -> list[Any]:
    handles = []
    modules = dict(model.named_modules())
    for name in names:

        def hook(_m: nn.Module, _args: Any, out: Any, name: str = name) -> None:
            t = _first_tensor(out)
            if t is not None and name not in into:  # the first call (a module may run once per layer)
                into[name] = t

        handles.append(modules[name].register_forward_hook(hook))
    return handles


def _call(model: nn.Module, inputs: Any) -> None:
    if isinstance(inputs, dict):
        model(**inputs)
    elif (
        isinstance(inputs, tuple)
        and len(inputs) == 2
        and isinstance(inputs[1], dict)
        and isinstance(inputs[0], tuple)
    ):
        model(*inputs[0], **inputs[1])
    elif isinstance(inputs, (tuple, list)):
        model(*inputs)
    else:
        model(inputs)


def _as_double(inputs: Any) -> Any:
    if isinstance(inputs, torch.Tensor):
        return inputs.double() if inputs.is_floating_point() else inputs
    if isinstance(inputs, dict):
        return {k: _as_double(v) for k, v in inputs.items()}
    if isinstance(inputs, (tuple, list)):
        return type(inputs)(_as_double(v) for v in inputs)
    return inputs


FLOAT64_TOLERANCE = 1e-9
FLOAT32_TOLERANCE = 1e-5
"""Relative tolerances of the check: rounding in float64, or in float32 for a model that computes some values
in float32 whatever its dtype (OLMo 2's and Gemma's norms, Mixtral's router)."""


def default_tolerance(rows: list[ModuleDifference]) -> float:
    """``FLOAT32_TOLERANCE`` when the model computes in float32 inside, ``FLOAT64_TOLERANCE`` otherwise."""
    return FLOAT32_TOLERANCE if any(r.float32_inside for r in rows) else FLOAT64_TOLERANCE


class _Float32Watch(torch.overrides.TorchFunctionMode):
    """Notes whether a torch function inside one of ``modules`` returns a float32 tensor (the model runs in
    float64). Only the compared modules count: replicated code (rotary tables in float32...) computes the
    same on both sides."""

    def __init__(self, modules: list[nn.Module]) -> None:
        super().__init__()
        self.seen = False
        self.depth = 0
        self.handles = [
            h
            for m in modules
            for h in (m.register_forward_pre_hook(self._enter), m.register_forward_hook(self._leave))
        ]

    def _enter(self, *_: Any) -> None:
        self.depth += 1

    def _leave(self, *_: Any) -> None:
        self.depth -= 1

    def remove(self) -> None:
        for h in self.handles:
            h.remove()

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        if self.depth and isinstance(out, torch.Tensor) and out.dtype == torch.float32:
            self.seen = True
        return out


def compare_sharded_modules(
    model: nn.Module, inputs: Any, *, plan: Any, group: Any
) -> list[ModuleDifference]:
    """On the ranks of TP ``group`` (collective): ``model`` unsharded against a sharded copy, per module.

    ``model`` is not changed (both runs use float64 copies, in eval mode); ``inputs`` is a dict of
    keyword inputs, a tuple of positional ones, ``(args, kwargs)`` or one tensor.
    """
    import merak_tp

    ref = copy.deepcopy(model).double().eval()
    sharded_model = merak_tp.parallelize(copy.deepcopy(ref), plan, group=group)
    names = [
        n
        for n, m in sharded_model.named_modules()
        if n
        and (
            isinstance(m, merak_tp.TP_LEAF_MODULES)
            and not isinstance(m, (merak_tp.SequenceScatter, merak_tp.SequenceGather))
        )
    ]
    got: dict[str, torch.Tensor] = {}
    want: dict[str, torch.Tensor] = {}
    handles = _record(sharded_model, names, got) + _record(ref, names, want)
    inputs = _as_double(inputs)
    ref_modules = dict(ref.named_modules())
    watch = _Float32Watch([ref_modules[n] for n in names if n in ref_modules])
    try:
        with torch.no_grad():
            _call(sharded_model, inputs)
            with watch:
                _call(ref, inputs)
    finally:
        watch.remove()
        for h in handles:
            h.remove()
    modules = dict(sharded_model.named_modules())
    rows = []
    for name in names:
        if name not in got or name not in want:
            continue
        full = _gather_output(modules[name], got[name], group)
        expected = want[name].detach().to(full.dtype)
        diff = float((full - expected).abs().max()) if full.shape == expected.shape else float("inf")
        rows.append(
            ModuleDifference(
                name=name,
                kind=type(modules[name]).__name__,
                max_abs=diff,
                scale=float(expected.abs().max()),
                float32_inside=watch.seen,
            )
        )
    return rows


def resolve_plan(model: nn.Module, tp_plan: Any) -> Any:
    """The ``merak_tp.TPPlan`` a job's ``tp_plan`` (None/"auto", a name, a mapping or a plan) means for ``model``."""
    import merak_tp

    if tp_plan in (None, "auto"):
        return merak_tp.plan_for_model(model)
    if isinstance(tp_plan, str):
        return merak_tp.get_plan(tp_plan)
    if isinstance(tp_plan, dict):
        return merak_tp.plan_from_mapping(tp_plan)
    return tp_plan


def check_sequence_parallel(model: nn.Module, tp_plan: Any) -> None:
    """``ValueError`` naming the family, the reason and the fix when the plan has no sequence parallelism.

    Runs on the model alone (meta is fine), before any process group or collective.
    """
    plan = resolve_plan(model, tp_plan)
    if plan.sequence_parallel:
        _refuse_sequence_sharded_dropout(model, plan)
        return
    family = getattr(getattr(model, "config", None), "model_type", None)
    what = f"{type(model).__name__} (model_type {family!r})" if family else type(model).__name__
    why = f": {plan.sequence_parallel_note}" if plan.sequence_parallel_note else ""
    raise ValueError(
        f"training.sequence_parallel=true: the TP plan {plan.name!r} of {what} does not support "
        f"sequence parallelism{why}. Set training.sequence_parallel: false (tensor parallelism "
        "without it is exact), or give a training.tp_plan with sequence_scatter/sequence_full "
        "patterns and sequence_parallel: true"
    )


def _refuse_sequence_sharded_dropout(model: nn.Module, plan: Any) -> None:
    """Under sequence parallelism, dropout outside the plan's ``rng_regions`` acts on a rank's block of
    the sequence but draws from the generator every TP rank shares: each block would get the same
    mask. Refused (before any process group) rather than trained with correlated masks."""
    import fnmatch

    def in_rng_region(name: str) -> bool:
        parts = name.split(".")
        prefixes = (".".join(parts[:i]) for i in range(1, len(parts)))
        return any(
            fnmatch.fnmatchcase(prefix, pattern) for prefix in prefixes for pattern in plan.rng_regions
        )

    bad = [
        name
        for name, module in model.named_modules()
        if isinstance(module, nn.Dropout) and module.p > 0 and not in_rng_region(name)
    ]
    if bad:
        shown = ", ".join(repr(n) for n in bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")
        raise ValueError(
            f"training.sequence_parallel=true with dropout on sequence-sharded activations ({shown}, "
            f"outside the TP plan {plan.name!r}'s rng_regions): every TP rank would draw the same mask "
            "for its block of the sequence. Set those dropout probabilities to 0 (e.g. the model "
            "config's resid_pdrop / hidden_dropout) or training.sequence_parallel: false"
        )


def check_before_training(
    model: nn.Module, inputs: Any, *, plan: Any, group: Any, tolerance: float | None = None
) -> None:
    """``compare_sharded_modules`` on the job's TP group; ``ValueError`` naming the modules above ``tolerance``
    (default: :func:`default_tolerance`)."""
    rows = compare_sharded_modules(model, inputs, plan=plan, group=group)
    tolerance = default_tolerance(rows) if tolerance is None else tolerance
    bad = [r for r in rows if r.relative > tolerance]
    if bad:
        raise ValueError(
            "the TP plan does not shard the model exactly (training.tp_check):\n"
            + format_report(rows, tolerance=tolerance)
            + "\nfix the plan's styles or sections for these modules (merak check JOB.yaml prints "
            "the same table before launch)"
        )


def _rank_main(
    rank: int,
    world: int,
    store_path: str,
    out_path: str,
    build: Callable[[], nn.Module],
    inputs: Any,
    plan: Any,
) -> None:
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        rows = compare_sharded_modules(build(), inputs, plan=plan, group=dist.group.WORLD)
        if rank == 0:
            with open(out_path, "w") as f:
                json.dump([dataclasses.asdict(r) for r in rows], f)
    finally:
        dist.destroy_process_group()


def check_plan_numerics(
    build: Callable[[], nn.Module],
    inputs: tuple[tuple[Any, ...], dict[str, Any]],
    *,
    plan: Any = None,
    tp: int = 2,
) -> list[ModuleDifference]:
    """Run the unsharded and the TP-sharded model on ``tp`` forked gloo processes; one row per sharded module.

    ``build()`` returns the model (called with the same seed on every rank); ``inputs`` are
    ``(args, kwargs)`` of one forward; ``plan`` is what ``merak_tp.parallelize`` takes.
    """
    import torch.multiprocessing as mp

    if tp < 2:
        raise ValueError(f"tp={tp}: a plan check needs at least 2 TP ranks")
    with tempfile.TemporaryDirectory(prefix="merak-check-") as tmp:
        store, out = os.path.join(tmp, "store"), os.path.join(tmp, "report.json")
        mp.start_processes(
            _rank_main, args=(tp, store, out, build, inputs, plan), nprocs=tp, join=True, start_method="fork"
        )
        with open(out) as f:
            rows = json.load(f)
    return [ModuleDifference(**row) for row in rows]


def format_report(rows: list[ModuleDifference], *, tolerance: float | None = None) -> str:
    """A table: module, parallel class, largest difference (absolute and relative), and the verdict."""
    tolerance = default_tolerance(rows) if tolerance is None else tolerance
    width = max([len(r.name) for r in rows] + [6])
    lines = [f"{'module':<{width}}  {'kind':<28}  {'max |diff|':>11}  {'relative':>9}  ok"]
    for r in rows:
        ok = "yes" if r.relative <= tolerance else "NO"
        lines.append(f"{r.name:<{width}}  {r.kind[:28]:<28}  {r.max_abs:>11.3e}  {r.relative:>9.2e}  {ok}")
    bad = [r for r in rows if r.relative > tolerance]
    inside = " (the model computes in float32 inside)" if any(r.float32_inside for r in rows) else ""
    lines.append(
        f"{len(rows)} sharded modules, {len(bad)} above the tolerance {tolerance:g}{inside}"
        + (f": {', '.join(r.name for r in bad[:5])}" if bad else "")
    )
    return "\n".join(lines)
