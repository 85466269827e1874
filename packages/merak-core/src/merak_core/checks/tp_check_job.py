"""``merak check JOB.yaml``: the job's TP plan checked on its model, or on a tiny config of its family.

The real model is built on the meta device and its plan resolved there as one rank
of a fake group (patterns, sizes and head counts at the real sizes, as ``merak
train`` checks before launch); then the module-by-module comparison of
:mod:`merak_core.checks.tp_check` runs on the model itself when it fits, or on a tiny
config of the same family (:mod:`merak_core.checks.tp_check_tiny`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from merak_core.checks.tp_check import ModuleDifference, check_plan_numerics, check_sequence_parallel

__all__ = ["check_job"]


def _job_inputs(job: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``(args, kwargs)`` of one forward: the first training batch, labels left out."""
    from torch.utils.data import default_collate

    from merak_core.job import load_callable

    train, _ = job.build_datasets()
    collate = (
        load_callable(job.collate, base_dir=job.base_dir, what="collate") if job.collate else default_collate
    )
    batch = collate([train[i] for i in range(min(len(train), job.training.per_device_train_batch_size))])
    if isinstance(batch, dict):
        return (), {k: v for k, v in batch.items() if k != "labels"}
    if isinstance(batch, (tuple, list)):
        return (batch[0],), {}
    return (batch,), {}


def check_job(
    job: Any, *, tp: int | None = None, tiny: bool | None = None, max_params: int | None = None
) -> tuple[list[ModuleDifference], str]:
    """``merak check``: the job's plan on its model, or on a tiny config of its family; (rows, what was checked).

    ``tiny``: True always, False never, None when the model does not fit or has more than
    ``max_params`` parameters (:func:`merak_core.checks.tp_check_tiny.choose_check_model`). The real
    model is first built on the meta device and its plan resolved there as one rank of a fake
    group of ``tp`` (patterns, sizes, head counts at the real sizes), like ``merak train``'s check.
    """
    from merak_core.checks import build_meta_model, check_tp_plan
    from merak_core.checks import tp_check_tiny as tiny_mod

    t = job.training
    tp = tp or max(2, t.tp)
    plan = t.tp_plan
    meta = build_meta_model(job)
    check_tp_plan(meta, plan, tp, t.overlap_chunks)
    if getattr(t, "sequence_parallel", False):
        check_sequence_parallel(meta, plan)
    use_tiny, why = tiny_mod.choose_check_model(
        meta, tp=tp, tiny=tiny, max_params=tiny_mod.DEFAULT_MAX_PARAMS if max_params is None else max_params
    )
    inputs = _job_inputs(job)
    build: Callable[[], nn.Module] = job.build_model
    if use_tiny:
        config = tiny_mod.tiny_config(meta.config, tp=tp)  # type: ignore[union-attr]
        build = tiny_mod.tiny_builder(type(meta), config)
        inputs = tiny_mod.tiny_inputs(inputs, config)
        why += (
            f"\n  real: {tiny_mod.describe_config(meta.config)}\n  tiny: {tiny_mod.describe_config(config)}"
        )
    del meta
    if plan in (None, "auto"):
        plan = None  # the built-in plan of the model each rank builds
    elif isinstance(plan, dict):
        import merak_tp

        plan = merak_tp.plan_from_mapping(plan)
    rows = check_plan_numerics(build, inputs, plan=plan, tp=tp)
    return rows, f"{why}\nat tp={tp}, float64, one batch"
