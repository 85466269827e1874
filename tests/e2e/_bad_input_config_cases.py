"""The configuration rows of the bad-input table: TrainingArguments fields, YAML files, job files.

The other rows are in ``_bad_input_cases.py`` and ``_bad_input_ckpt_cases.py``.
"""

from __future__ import annotations

import torch
from torch import nn

from tests.e2e._bad_input_cases import _args, _Pairs, _write_job
from tests.e2e._bad_input_support import CaseContext

# ----------------------------------------------------------------------------- configuration files


def args_from_dict_unknown_key(ctx: CaseContext) -> None:
    from merak_core import TrainingArguments

    with ctx.guard():
        TrainingArguments.from_dict({"learning_rat": 1e-3})


def args_from_yaml_unknown_key(ctx: CaseContext) -> None:
    from merak_core import TrainingArguments

    path = ctx.tmp / "train.yaml"
    path.write_text("max_steps: 10\ngradient_accumulation: 4\n")
    with ctx.guard():
        TrainingArguments.from_yaml(path)


def args_override_without_equals(ctx: CaseContext) -> None:
    from merak_core import TrainingArguments

    path = ctx.tmp / "train.yaml"
    path.write_text("max_steps: 10\n")
    with ctx.guard():
        TrainingArguments.from_yaml(path, ["max_steps", "20"])


def args_override_bad_type(ctx: CaseContext) -> None:
    from merak_core import TrainingArguments

    path = ctx.tmp / "train.yaml"
    path.write_text("max_steps: 10\n")
    with ctx.guard():
        TrainingArguments.from_yaml(path, ["tp=two"])


def job_unknown_section(ctx: CaseContext) -> None:
    from merak_core.job import JobConfig

    job = _write_job(ctx, extra="trainig:\n  max_steps: 3\n")
    with ctx.guard():
        JobConfig.from_yaml(job)


def job_override_without_equals(ctx: CaseContext) -> None:
    from merak_core.job import JobConfig

    job = _write_job(ctx)
    with ctx.guard():
        JobConfig.from_yaml(job, ["training.max_steps"])


def job_override_bad_type(ctx: CaseContext) -> None:
    from merak_core.job import JobConfig

    job = _write_job(ctx)
    with ctx.guard():
        JobConfig.from_yaml(job, ["training.max_steps=many"])


def job_factory_missing_file(ctx: CaseContext) -> None:
    from merak_core.job import JobConfig

    job = _write_job(ctx, model="modle.py:build_model")
    with ctx.guard():
        JobConfig.from_yaml(job)


def job_factory_missing_function(ctx: CaseContext) -> None:
    from merak_core.job import JobConfig

    job = _write_job(ctx, model="model.py:buld_model")
    with ctx.guard():
        JobConfig.from_yaml(job)


def job_factory_not_a_spec(ctx: CaseContext) -> None:
    from merak_core.job import JobConfig

    job = _write_job(ctx, model="model.build_model")
    with ctx.guard():
        JobConfig.from_yaml(job)


def job_data_labels_unknown_value(ctx: CaseContext) -> None:
    from merak_core.job import JobConfig

    job = _write_job(ctx)
    with ctx.guard():
        JobConfig.from_yaml(job, ["data.labels=hf"])


def trainer_unshifted_labels_on_class_ids(ctx: CaseContext) -> None:
    # labels: unshifted shifts token labels [batch, seq]; class ids [batch] cannot be shifted.
    from merak_core import Trainer, init

    layout = init(device="cpu")
    args = _args(ctx, labels="unshifted")
    torch.manual_seed(0)
    with ctx.guard():
        Trainer(nn.Linear(4, 3).double(), args, _Pairs(16), layout=layout)


# ----------------------------------------------------------------------------- training fields


def args_negative_learning_rate(ctx: CaseContext) -> None:
    with ctx.guard():
        _args(ctx, learning_rate=-3e-4)


def args_nonfinite_skip_limit_negative(ctx: CaseContext) -> None:
    with ctx.guard():
        _args(ctx, nonfinite="skip", nonfinite_max_consecutive_skips=-1)


def args_bf16_with_float64(ctx: CaseContext) -> None:
    with ctx.guard():
        _args(ctx, bf16=True, dtype="float64")


def args_zero_stage_4(ctx: CaseContext) -> None:
    with ctx.guard():
        _args(ctx, zero_stage=4)


def args_unknown_dtype(ctx: CaseContext) -> None:
    with ctx.guard():
        _args(ctx, dtype="fp16")


def lr_decay_without_total_steps(ctx: CaseContext) -> None:
    from merak_core import build_lr_scheduler

    args = _args(ctx, max_steps=-1, lr_scheduler_type="cosine")
    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    with ctx.guard():
        build_lr_scheduler(optimizer, args)
