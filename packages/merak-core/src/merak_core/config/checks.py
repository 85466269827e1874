"""The checks of :class:`~merak_core.config.TrainingArguments`, section by section.

``TrainingArguments.__post_init__`` calls :func:`check_arguments`, which runs the sections in this
order (the first error wins): the run's own fields (sizes, steps, optimizer numbers, precision),
the pipeline (schedule, virtual stages, recomputation, memory budget), the planner (``layout``,
plan-check fields), sharding (ZeRO stages) and the TP plan. Every error names the field, the
value, what was expected and what to set. Some values are normalised on the way (floats, the schedule key, byte sizes).

Not done here: the fields themselves and reading them (``arguments.py``), the allowed values
(``values.py``), anything that needs the world size or a model.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from merak_core.config.report_to import check_report_to
from merak_core.config.values import (
    DTYPES,
    LABEL_CONVENTIONS,
    LAYOUTS,
    LR_SCHEDULER_TYPES,
    MAX_SEED,
    NONFINITE_POLICIES,
    parse_bytes,
    parse_recompute,
    schedule_choices,
    schedule_key,
)
from merak_core.parallel.virtual_stages import check_virtual_stages

__all__ = ["check_arguments"]


def check_arguments(args: Any) -> None:
    """ValueError naming the first invalid field of ``args`` (a ``TrainingArguments``); normalises some values."""
    _check_run(args)
    args.report_to = check_report_to(args.report_to)  # config/report_to.py: the names and the wandb extra
    _check_pipeline(args)
    _check_planner(args)
    _check_sharding(args)
    _check_tp_plan(args)
    from merak_core.parallel.context_parallel import check_cp_arguments

    check_cp_arguments(args)  # cp, cp_mode, and what cp > 1 refuses
    from merak_core.parallel.expert_parallel import check_ep_arguments

    check_ep_arguments(args)  # ep, and what ep > 1 refuses
    from merak_core.parallel.compile import check_compile_arguments

    check_compile_arguments(args)  # compile, compile_backend, and what compiled stages refuse


def _check_run(args: Any) -> None:
    """The run's own fields: paths, sizes, steps, the optimizer's numbers, flags and precision."""
    _check(
        isinstance(args.output_dir, str) and args.output_dir != "",
        "output_dir",
        args.output_dir,
        "a non-empty directory path",
    )
    _check(
        args.export_hf_dir is None or (isinstance(args.export_hf_dir, str) and args.export_hf_dir != ""),
        "export_hf_dir",
        args.export_hf_dir,
        "a directory path, or null for no export",
    )
    for name in (
        "per_device_train_batch_size",
        "per_device_eval_batch_size",
        "gradient_accumulation_steps",
        "logging_steps",
        "tp",
        "pp",
        "overlap_chunks",
    ):
        _check_int(args, name, minimum=1)
    for name in ("warmup_steps", "seed"):
        _check_int(args, name, minimum=0)
    if args.dataloader_num_workers is not None:
        _check_int(args, "dataloader_num_workers", minimum=0, hint="or null (2 on CUDA, 0 on CPU)")
    _check(args.seed <= MAX_SEED, "seed", args.seed, f"an integer in [0, {MAX_SEED}] (2**32 - 1)")
    _check_float(args, "comm_timeout_s", minimum=0.0)
    _check(
        args.comm_timeout_s > 0,
        "comm_timeout_s",
        args.comm_timeout_s,
        "a positive number of seconds such as 600",
    )
    _check_samples(args)
    for name in ("eval_steps", "save_steps", "save_total_limit", "dp"):
        if getattr(args, name) is not None:
            _check_int(args, name, minimum=1, hint="or null")
    _check_int(args, "max_steps", minimum=-1)
    _check(args.max_steps != 0, "max_steps", 0, "-1 (train num_train_epochs) or a positive step count")
    for name in ("learning_rate", "weight_decay", "max_grad_norm"):
        _check_float(args, name, minimum=0.0)
    _check_float(args, "adam_epsilon", minimum=0.0)
    _check(args.adam_epsilon > 0, "adam_epsilon", args.adam_epsilon, "a positive number such as 1e-8")
    for name in ("adam_beta1", "adam_beta2"):
        _check_float(args, name, minimum=0.0)
        _check(getattr(args, name) < 1.0, name, getattr(args, name), "a number in [0, 1)")
    _check_float(args, "num_train_epochs", minimum=0.0)
    _check(
        args.max_steps > 0 or args.num_train_epochs > 0,
        "num_train_epochs",
        args.num_train_epochs,
        "a positive number of epochs when max_steps is -1",
    )
    _check(
        args.lr_scheduler_type in LR_SCHEDULER_TYPES,
        "lr_scheduler_type",
        args.lr_scheduler_type,
        f"one of {LR_SCHEDULER_TYPES}",
    )
    _check(isinstance(args.bf16, bool), "bf16", args.bf16, "true or false")
    _check(isinstance(args.plan_probe_tp, bool), "plan_probe_tp", args.plan_probe_tp, "true or false")
    _check(isinstance(args.tp_check, bool), "tp_check", args.tp_check, "true or false")
    _check(args.labels in LABEL_CONVENTIONS, "labels", args.labels, f"one of {LABEL_CONVENTIONS}")
    _check(
        isinstance(args.sequence_parallel, bool),
        "sequence_parallel",
        args.sequence_parallel,
        "true or false",
    )
    _check(args.dtype in DTYPES, "dtype", args.dtype, f"one of {tuple(DTYPES)}")
    _check(args.nonfinite in NONFINITE_POLICIES, "nonfinite", args.nonfinite, f"one of {NONFINITE_POLICIES}")
    _check_int(args, "nonfinite_max_consecutive_skips", minimum=0, hint="(0: no limit)")
    if args.dtype == "float16":
        raise ValueError(
            "dtype='float16' trains without loss scaling, so small gradients underflow to 0 and large "
            "activations overflow to inf/NaN: use bf16: true (bfloat16 autocast over float32 parameters) "
            "or dtype: bfloat16"
        )
    if args.bf16 and args.dtype != "float32":
        raise ValueError(
            f"bf16=True with dtype={args.dtype!r}: mixed precision keeps float32 parameters, so set "
            "dtype='float32' (or bf16=False to train in a low-precision dtype directly)"
        )


def _check_pipeline(args: Any) -> None:
    """The schedule (normalised to its key), virtual stages, recomputation and the memory budget."""
    args.schedule = schedule_key(args.schedule)
    _check(args.schedule in schedule_choices(), "schedule", args.schedule, f"one of {schedule_choices()}")
    check_virtual_stages(args.schedule, args.pp, args.virtual_stages)
    parse_recompute(args.recompute)
    if args.memory_budget is not None:
        args.memory_budget = parse_bytes(args.memory_budget)
    if args.recompute.strip().lower() == "stage_aware" and (args.memory_budget is None or args.pp < 2):
        raise ValueError(
            f"recompute='stage_aware' chooses per-stage fractions from a memory budget, but pp={args.pp} and "
            f"memory_budget={args.memory_budget}: set pp >= 2 and memory_budget (e.g. '12GiB'), or use "
            "recompute='full' / 'uniform:<fraction>'"
        )


def _check_planner(args: Any) -> None:
    """``layout`` and the plan-check fields (degrees under ``layout: auto``: see [Note: layout auto])."""
    _check(args.layout in LAYOUTS, "layout", args.layout, f"one of {LAYOUTS}")
    if args.memory_per_device is not None:
        args.memory_per_device = parse_bytes(args.memory_per_device)
    if args.plan_check_steps is not None:
        _check_int(args, "plan_check_steps", minimum=0, hint="(0: off) or null")
        _check(
            args.plan_check_steps != 1,
            "plan_check_steps",
            1,
            "0 (off) or >= 2 (a warm-up step, then at least one measured step)",
        )
    _check_float(args, "plan_error_threshold", minimum=0.0)


def _check_sharding(args: Any) -> None:
    """``zero_stage``, and whether the schedule can run under it."""
    _check(
        args.zero_stage in (0, 1, 2, 3) and not isinstance(args.zero_stage, bool),
        "zero_stage",
        args.zero_stage,
        "0 (off), 1 (optimizer states sharded over DP), 2 (and gradients) or 3 (and "
        "parameters; ZeRO-2/3 run on torch's FSDP2)",
    )
    from merak_core.parallel.fsdp import check_sharding_supported

    check_sharding_supported(args.zero_stage, args.schedule)


def _check_tp_plan(args: Any) -> None:
    """``tp_plan``: the full plan vocabulary, a pattern -> style mapping, or a name (looked up later)."""
    if isinstance(args.tp_plan, Mapping) and ("layers" in args.tp_plan or "base" in args.tp_plan):
        import merak_tp

        try:  # the full plan vocabulary (merak_tp.plan_from_mapping); a base plan may come from the job
            merak_tp.plan_from_mapping(args.tp_plan, check_only=True)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"tp_plan={args.tp_plan!r} is invalid: {exc}") from None
    elif isinstance(args.tp_plan, Mapping):
        _check(
            all(isinstance(k, str) and isinstance(v, str) for k, v in args.tp_plan.items()),
            "tp_plan",
            args.tp_plan,
            "a mapping of module-name pattern to a style name (both strings)",
        )
        import merak_tp

        bad = {k: v for k, v in args.tp_plan.items() if v not in merak_tp.STYLES}
        _check(not bad, "tp_plan", args.tp_plan, f"styles from {merak_tp.STYLES} (unknown: {bad})")
    else:
        # A plan name is looked up once the job's modules are imported (they may register it):
        # by merak_core.job after the factories load, and by the Trainer.
        _check(
            args.tp_plan is None or isinstance(args.tp_plan, str),
            "tp_plan",
            args.tp_plan,
            "null, 'auto', a plan name or a mapping",
        )


def _check(ok: bool, name: str, value: Any, expected: str) -> None:
    if not ok:
        raise ValueError(f"{name}={value!r} is invalid: expected {expected}; set {name} accordingly")


def _check_int(args: Any, name: str, *, minimum: int, hint: str = "") -> None:
    value = getattr(args, name)
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= minimum
    _check(ok, name, value, f"an integer >= {minimum}{' ' + hint if hint else ''}")


def _check_float(args: Any, name: str, *, minimum: float) -> None:
    value = getattr(args, name)
    ok = (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value >= minimum
    )
    _check(ok, name, value, f"a number >= {minimum}")
    setattr(args, name, float(value))


def _check_samples(args: Any) -> None:
    """``sample_*``: the prompts are non-empty strings and the numbers in range."""
    prompts = args.sample_prompts
    if prompts is not None:
        _check(
            isinstance(prompts, list) and bool(prompts) and all(isinstance(p, str) and p for p in prompts),
            "sample_prompts",
            prompts,
            "a non-empty list of non-empty strings, or null for no samples",
        )
    if args.sample_steps is not None:
        _check_int(args, "sample_steps", minimum=1, hint="or null")
    _check_int(args, "sample_max_new_tokens", minimum=1)
    _check_float(args, "sample_temperature", minimum=0.0)
