"""``TrainingArguments``: the training configuration, Hugging Face style, plus the parallel fields.

A Hugging Face ``Trainer`` user recognises the names and defaults
(``per_device_train_batch_size``, ``gradient_accumulation_steps``,
``learning_rate``, ``lr_scheduler_type``, ``warmup_steps``, ...). Merak adds the
3D-parallel fields (``dp``, ``tp``, ``pp``, ``schedule``, ``recompute``,
``memory_budget``, ``overlap_chunks``, ``zero_stage``, ``tp_plan``).

[Note: batch sizes] ``per_device_train_batch_size`` is the *microbatch* size of
one data-parallel replica (a DP rank; all TP ranks and pipeline stages of a
replica share it). ``gradient_accumulation_steps`` is the number of microbatches
per optimizer step, which Merak's pipeline calls ``num_microbatches`` (the
property and the YAML key ``num_microbatches`` are aliases). So one optimizer
step consumes ``per_device_train_batch_size * gradient_accumulation_steps``
samples per DP replica and ``global_batch_size(dp)`` samples in total, exactly
as with Hugging Face gradient accumulation on ``dp`` GPUs.

[Note: layout auto] With ``layout: auto`` the planner chooses ``dp``, ``tp``, ``pp``,
``schedule``, ``per_device_train_batch_size``, ``gradient_accumulation_steps``, ``recompute``
(and ``memory_budget`` for stage-aware recomputation) when the job starts
(:mod:`merak_core.autoplan`). It keeps the job's *global* batch, read as if the job were plain
data parallelism over every rank: ``per_device_train_batch_size * gradient_accumulation_steps *
WORLD_SIZE``. ``dp``, ``tp`` and ``pp`` must then be left out (a ValueError says so before any
collective); the other parallel fields of the job are replaced by the plan.

Configs load from YAML (a flat mapping of field names) with ``key=value``
overrides from the command line, type-checked against the field types; an
unknown key is an error that lists the valid keys and suggests the closest one.
:func:`build_lr_scheduler` turns the schedule fields into a
``torch.optim.lr_scheduler.LambdaLR`` with Hugging Face's formulas.

Not done here: the per-component configs of the libraries (the trainer derives
them from these fields) and any check against the world size (``init`` does that).

Modules: ``values`` (allowed values, reading YAML, sizes and recompute specs, type coercion),
``arguments`` (the dataclass, reading it from mappings and overrides), ``checks`` (its fields'
checks, section by section), ``lr`` (learning-rate schedules).
"""

from merak_core.config.arguments import TrainingArguments, override_value, parse_overrides
from merak_core.config.checks import auto_conflict_message
from merak_core.config.lr import build_lr_scheduler, lr_lambda
from merak_core.config.values import (
    DTYPES,
    KEY_ALIASES,
    LABEL_CONVENTIONS,
    LAYOUTS,
    LR_SCHEDULER_TYPES,
    MAX_SEED,
    NONFINITE_POLICIES,
    load_yaml,
    parse_bytes,
    parse_recompute,
    schedule_choices,
    schedule_key,
    split_override,
)

__all__ = [
    "DTYPES",
    "KEY_ALIASES",
    "LABEL_CONVENTIONS",
    "LAYOUTS",
    "LR_SCHEDULER_TYPES",
    "TrainingArguments",
    "build_lr_scheduler",
    "MAX_SEED",
    "NONFINITE_POLICIES",
    "auto_conflict_message",
    "load_yaml",
    "lr_lambda",
    "parse_bytes",
    "parse_overrides",
    "parse_recompute",
    "schedule_choices",
    "schedule_key",
    "override_value",
    "split_override",
]
