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

[Note: layout auto] With ``layout: auto`` the planner chooses ``dp``, ``tp``, ``pp`` (``cp`` and ``ep``
too, among those the model and its batch allow: :func:`merak_core.autoplan.givens.model_cp_degrees`),
``schedule``, ``per_device_train_batch_size``, ``gradient_accumulation_steps``, ``recompute``
(and ``memory_budget`` for stage-aware recomputation) when the job starts
(:mod:`merak_core.autoplan`). ``layout: auto`` is one switch: a job that also writes ``dp``, ``tp`` or
``pp`` (a manual job switched to auto) keeps them only for its *global* batch and trains with the
plan's degrees, and one line at start-up (and in ``merak train --dry-run``) says so. The global batch
is the job's, ``per_device_train_batch_size * gradient_accumulation_steps * dp`` with ``dp`` as written;
``dp`` null is inferred as a manual layout would (``WORLD_SIZE / (cp*tp*pp)``: every rank when no
degree is written), and a null ``dp`` with a ``tp*pp`` that does not divide the ranks is refused by
name before torchrun. To plan for another global batch, change those fields (e.g.
``training.dp=null`` for every rank). The other parallel fields of the job are replaced by the plan
(:func:`merak_core.autoplan.givens.auto_global_batch`).

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

May import ``merak_core.parallel`` and ``merak_core.lora`` (the virtual-stage check); nothing above
them. The ``report_to`` names are checked here (``report_to.py``); opening the reporters is ``run``'s.
"""

from merak_core.config.arguments import TrainingArguments, override_value, parse_overrides
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
