"""``TrainingArguments``: the fields of a run, their checks, and building them from mappings and overrides.

See :mod:`merak_core.config` for [Note: batch sizes] and [Note: layout auto].
"""

from __future__ import annotations

import ast
import dataclasses
import datetime
import difflib
import inspect
import math
import textwrap
import typing
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from merak_core.config.values import (
    _NO,
    DTYPES,
    KEY_ALIASES,
    LAYOUTS,
    LR_SCHEDULER_TYPES,
    MAX_SEED,
    NONFINITE_POLICIES,
    _coerce,
    _convert,
    _members,
    _yaml,
    load_yaml,
    parse_bytes,
    parse_recompute,
    schedule_choices,
    schedule_key,
    split_override,
)
from merak_core.virtual_stages import check_virtual_stages


@dataclass(kw_only=True)
class TrainingArguments:
    """Everything a training run needs, Hugging Face ``TrainingArguments`` names plus 3D-parallel fields."""

    # ------------------------------------------------------------ Hugging Face fields
    output_dir: str = "merak_output"
    """Directory for metrics, the loss plot and checkpoints."""
    per_device_train_batch_size: int = 8
    """Microbatch size per DP replica (see [Note: batch sizes]); alias ``micro_batch_size``."""
    per_device_eval_batch_size: int = 8
    """Evaluation batch size per DP replica."""
    gradient_accumulation_steps: int = 1
    """Microbatches per optimizer step; Merak's ``num_microbatches`` (alias key)."""
    learning_rate: float = 5e-5
    """Peak learning rate of AdamW (reached after ``warmup_steps``)."""
    lr_scheduler_type: str = "linear"
    """Decay after warm-up: ``constant``, ``linear`` (to 0 at the last step) or ``cosine`` (to 0)."""
    warmup_steps: int = 0
    """Steps of linear warm-up from 0 to ``learning_rate`` (applies to every scheduler type)."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay (biases and norm weights are usually excluded by the trainer)."""
    adam_beta1: float = 0.9
    """AdamW beta1."""
    adam_beta2: float = 0.999
    """AdamW beta2."""
    adam_epsilon: float = 1e-8
    """AdamW epsilon."""
    max_grad_norm: float = 1.0
    """Global gradient-norm clip (over DP, TP and PP); 0 disables clipping."""
    max_steps: int = -1
    """Optimizer steps to run; -1 means ``num_train_epochs`` epochs."""
    num_train_epochs: float = 3.0
    """Epochs to run when ``max_steps`` is -1 (fractions allowed)."""
    logging_steps: int = 10
    """Log loss, tokens/s and step time every this many steps."""
    eval_steps: int | None = None
    """Evaluate every this many steps; None: only at the end (when an eval dataset is given)."""
    save_steps: int | None = None
    """Checkpoint every this many steps; None: no periodic checkpoints."""
    save_total_limit: int | None = None
    """Keep at most this many checkpoints (oldest deleted first); None: keep all."""
    export_hf_dir: str | None = None
    """At the end of training, write the model here as a Hugging Face folder (sharded safetensors, index,
    ``config.json``, tokenizer files; ``merak_core.hf.export_hf``), whether or not checkpoints are saved.
    Needs a run started from ``model.pretrained`` (its config and tokenizer are copied); None: no export."""
    seed: int = 42
    """Seed of parameter initialisation, data order and dropout."""
    bf16: bool = False
    """bfloat16 mixed precision: autocast compute over float32 parameters (needs dtype float32)."""
    dtype: str = "float32"
    """Parameter dtype: ``float32``, ``float64``, ``bfloat16`` or ``float16``."""
    dataloader_num_workers: int = 0
    """Worker processes of the data loader on the ranks that read data."""
    nonfinite: str = "stop"
    """A step whose loss or gradient norm is NaN or infinite: ``stop`` raises an error naming the step, the
    loss, the gradient norm and the first non-finite gradient; ``skip`` drops the step (no optimizer update,
    the learning-rate schedule does not advance) and counts it in the metrics (``skipped_steps``)."""
    comm_timeout_s: float = 600.0
    """Seconds a collective or pipeline transfer may wait for a peer before the step fails
    (every process group of the layout); ``merak train --timeout`` sets it too."""

    # ------------------------------------------------------------ Merak's parallel fields
    dp: int | None = None
    """Data-parallel degree; None: WORLD_SIZE // (tp * pp)."""
    tp: int = 1
    """Tensor-parallel degree."""
    pp: int = 1
    """Pipeline-parallel degree (stages)."""
    virtual_stages: int = 1
    """Pipeline stages per pipeline rank: the model is cut into ``pp * virtual_stages`` stages, placed by the
    schedule (``interleaved_1f1b``: round-robin, any v; ``zb_v``: in a V, v = 2). 1: one stage per rank."""
    schedule: str = "auto"
    """Pipeline schedule: ``auto`` (shifted critical path with a memory budget, else 1F1B), ``gpipe``,
    ``1f1b``, ``zb_h1``, ``shifted_critical_path``, ... (any ``merak_pipe.schedule_infos()`` key; hyphens accepted)."""
    recompute: str = "none"
    """Activation recomputation: ``none``, ``full``, ``uniform:<fraction>`` or ``stage_aware``."""
    memory_budget: int | str | None = None
    """Activation memory budget per rank, bytes or e.g. ``"12GiB"``; stored as bytes. None: no limit."""
    overlap_chunks: int = 1
    """Sub-microbatches for sub-pipelined TP (communication overlapped with compute); 1: off."""
    sequence_parallel: bool = False
    """With tp > 1, shard the activations between the TP blocks (norms, dropout, residual adds) along the
    sequence, Megatron-style (the plan's sequence-parallel regions); a plan without them is refused
    before training. No effect at tp=1."""
    zero_stage: int = 0
    """0: replicated optimizer states; 1: ZeRO-1, optimizer states sharded over DP; 2: ZeRO-2, gradients
    too; 3: ZeRO-3, parameters too (2 and 3 with torch's FSDP2 over the DP axis, see merak_core.fsdp)."""
    tp_plan: str | dict[str, Any] | None = None
    """TP plan: None/``auto`` for known model types, a plan name (built in, or registered by the job's
    modules), a mapping module pattern -> style, or the full plan vocabulary (``layers``, ``sections``,
    ``attributes``, ``regions``, ... see ``merak_tp.plan_from_mapping``)."""
    tp_check: bool = False
    """Before training (tp > 1), run one batch through every module the TP plan shards and through the
    unsharded module (float64 copies, on the TP group) and stop with an error naming the modules that
    differ (relative difference above 1e-9, or 1e-5 when the sharded modules compute in float32 inside);
    ``merak check`` does the same before launch."""

    # ------------------------------------------------------------ the planner (see [Note: layout auto])
    layout: str = "manual"
    """``manual``: the job's dp/tp/pp and the other parallel fields; ``auto``: the planner chooses dp, tp,
    pp, schedule, microbatches and recomputation at start-up (dp/tp/pp must then be left out)."""
    memory_per_device: int | str | None = None
    """Memory one rank may use, bytes or e.g. ``"2GiB"``, for ``layout: auto`` and the plan check; None: the
    device's memory (CUDA: its total memory; CPU: the machine's RAM divided by the ranks on this node)."""
    plan_check_steps: int | None = None
    """Compare the planner's prediction with the measured step time, per-stage F/B times and peak memory
    after this many steps (the first 1-2 are warm-up) and re-plan when the error is large; 0: off;
    None: 5 with ``layout: auto``, else 0. Needs a profile (``Trainer(plan_context=...)`` or auto)."""
    plan_error_threshold: float = 0.25
    """Relative step-time error above which the plan check re-plans from the measured costs."""
    plan_probe_tp: bool = True
    """With ``layout: auto``: before planning, train a few steps of each pure DP x TP layout the world
    allows to measure how much slower TP shards run than modelled (``merak_core.tp_probe``; a few
    seconds per TP degree)."""

    def __post_init__(self) -> None:
        _check(
            isinstance(self.output_dir, str) and self.output_dir != "",
            "output_dir",
            self.output_dir,
            "a non-empty directory path",
        )
        _check(
            self.export_hf_dir is None or (isinstance(self.export_hf_dir, str) and self.export_hf_dir != ""),
            "export_hf_dir",
            self.export_hf_dir,
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
            _check_int(self, name, minimum=1)
        for name in ("warmup_steps", "seed", "dataloader_num_workers"):
            _check_int(self, name, minimum=0)
        _check(self.seed <= MAX_SEED, "seed", self.seed, f"an integer in [0, {MAX_SEED}] (2**32 - 1)")
        _check_float(self, "comm_timeout_s", minimum=0.0)
        _check(
            self.comm_timeout_s > 0,
            "comm_timeout_s",
            self.comm_timeout_s,
            "a positive number of seconds such as 600",
        )
        for name in ("eval_steps", "save_steps", "save_total_limit", "dp"):
            if getattr(self, name) is not None:
                _check_int(self, name, minimum=1, hint="or null")
        _check_int(self, "max_steps", minimum=-1)
        _check(self.max_steps != 0, "max_steps", 0, "-1 (train num_train_epochs) or a positive step count")
        for name in ("learning_rate", "weight_decay", "max_grad_norm"):
            _check_float(self, name, minimum=0.0)
        _check_float(self, "adam_epsilon", minimum=0.0)
        _check(self.adam_epsilon > 0, "adam_epsilon", self.adam_epsilon, "a positive number such as 1e-8")
        for name in ("adam_beta1", "adam_beta2"):
            _check_float(self, name, minimum=0.0)
            _check(getattr(self, name) < 1.0, name, getattr(self, name), "a number in [0, 1)")
        _check_float(self, "num_train_epochs", minimum=0.0)
        _check(
            self.max_steps > 0 or self.num_train_epochs > 0,
            "num_train_epochs",
            self.num_train_epochs,
            "a positive number of epochs when max_steps is -1",
        )
        _check(
            self.lr_scheduler_type in LR_SCHEDULER_TYPES,
            "lr_scheduler_type",
            self.lr_scheduler_type,
            f"one of {LR_SCHEDULER_TYPES}",
        )
        _check(isinstance(self.bf16, bool), "bf16", self.bf16, "true or false")
        _check(isinstance(self.plan_probe_tp, bool), "plan_probe_tp", self.plan_probe_tp, "true or false")
        _check(isinstance(self.tp_check, bool), "tp_check", self.tp_check, "true or false")
        _check(
            isinstance(self.sequence_parallel, bool),
            "sequence_parallel",
            self.sequence_parallel,
            "true or false",
        )
        _check(self.dtype in DTYPES, "dtype", self.dtype, f"one of {tuple(DTYPES)}")
        _check(
            self.nonfinite in NONFINITE_POLICIES, "nonfinite", self.nonfinite, f"one of {NONFINITE_POLICIES}"
        )
        if self.dtype == "float16":
            raise ValueError(
                "dtype='float16' trains without loss scaling, so small gradients underflow to 0 and large "
                "activations overflow to inf/NaN: use bf16: true (bfloat16 autocast over float32 parameters) "
                "or dtype: bfloat16"
            )
        if self.bf16 and self.dtype != "float32":
            raise ValueError(
                f"bf16=True with dtype={self.dtype!r}: mixed precision keeps float32 parameters, so set "
                "dtype='float32' (or bf16=False to train in a low-precision dtype directly)"
            )
        self.schedule = schedule_key(self.schedule)
        _check(self.schedule in schedule_choices(), "schedule", self.schedule, f"one of {schedule_choices()}")
        check_virtual_stages(self.schedule, self.pp, self.virtual_stages)
        parse_recompute(self.recompute)
        if self.memory_budget is not None:
            self.memory_budget = parse_bytes(self.memory_budget)
        if self.recompute.strip().lower() == "stage_aware" and (self.memory_budget is None or self.pp < 2):
            raise ValueError(
                f"recompute='stage_aware' chooses per-stage fractions from a memory budget, but pp={self.pp} and "
                f"memory_budget={self.memory_budget}: set pp >= 2 and memory_budget (e.g. '12GiB'), or use "
                "recompute='full' / 'uniform:<fraction>'"
            )
        self._check_planner_fields()
        _check(
            self.zero_stage in (0, 1, 2, 3) and not isinstance(self.zero_stage, bool),
            "zero_stage",
            self.zero_stage,
            "0 (off), 1 (optimizer states sharded over DP), 2 (and gradients) or 3 (and "
            "parameters; ZeRO-2/3 run on torch's FSDP2)",
        )
        from merak_core.fsdp import check_sharding_supported

        check_sharding_supported(self.zero_stage, self.schedule)
        if isinstance(self.tp_plan, Mapping) and ("layers" in self.tp_plan or "base" in self.tp_plan):
            import merak_tp

            try:  # the full plan vocabulary (merak_tp.plan_from_mapping); a base plan may come from the job
                merak_tp.plan_from_mapping(self.tp_plan, check_only=True)
            except (ValueError, TypeError) as exc:
                raise ValueError(f"tp_plan={self.tp_plan!r} is invalid: {exc}") from None
        elif isinstance(self.tp_plan, Mapping):
            _check(
                all(isinstance(k, str) and isinstance(v, str) for k, v in self.tp_plan.items()),
                "tp_plan",
                self.tp_plan,
                "a mapping of module-name pattern to a style name (both strings)",
            )
            import merak_tp

            bad = {k: v for k, v in self.tp_plan.items() if v not in merak_tp.STYLES}
            _check(not bad, "tp_plan", self.tp_plan, f"styles from {merak_tp.STYLES} (unknown: {bad})")
        else:
            # A plan name is looked up once the job's modules are imported (they may register it):
            # by merak_core.job after the factories load, and by the Trainer.
            _check(
                self.tp_plan is None or isinstance(self.tp_plan, str),
                "tp_plan",
                self.tp_plan,
                "null, 'auto', a plan name or a mapping",
            )

    def _check_planner_fields(self) -> None:
        _check(self.layout in LAYOUTS, "layout", self.layout, f"one of {LAYOUTS}")
        if self.memory_per_device is not None:
            self.memory_per_device = parse_bytes(self.memory_per_device)
        if self.plan_check_steps is not None:
            _check_int(self, "plan_check_steps", minimum=0, hint="(0: off) or null")
            _check(
                self.plan_check_steps != 1,
                "plan_check_steps",
                1,
                "0 (off) or >= 2 (a warm-up step, then at least one measured step)",
            )
        _check_float(self, "plan_error_threshold", minimum=0.0)
        if self.layout == "auto":
            explicit = {
                n: v
                for n, v in (("dp", self.dp), ("tp", self.tp), ("pp", self.pp))
                if v != (None if n == "dp" else 1)
            }
            if explicit:
                raise ValueError(auto_conflict_message(sorted(explicit), explicit))

    # ------------------------------------------------------------ derived values

    @property
    def num_microbatches(self) -> int:
        """Microbatches per optimizer step (= ``gradient_accumulation_steps``)."""
        return self.gradient_accumulation_steps

    @property
    def micro_batch_size(self) -> int:
        """Samples per microbatch per DP replica (= ``per_device_train_batch_size``)."""
        return self.per_device_train_batch_size

    def global_batch_size(self, dp: int | None = None) -> int:
        """Samples per optimizer step over all DP replicas (``dp`` defaults to the field)."""
        degree = self.dp if dp is None else dp
        if degree is None:
            raise ValueError("dp is None (inferred at init): pass the actual dp, e.g. layout.dp")
        return self.per_device_train_batch_size * self.gradient_accumulation_steps * degree

    @property
    def torch_dtype(self) -> torch.dtype:
        """``dtype`` as a ``torch.dtype``."""
        return DTYPES[self.dtype]

    @property
    def comm_timeout(self) -> datetime.timedelta:
        """``comm_timeout_s`` as the ``timedelta`` that process groups take."""
        return datetime.timedelta(seconds=self.comm_timeout_s)

    @property
    def recompute_mode(self) -> tuple[str, float | None]:
        """``recompute`` parsed by :func:`parse_recompute`."""
        return parse_recompute(self.recompute)

    # ------------------------------------------------------------ (de)serialisation

    @classmethod
    def field_names(cls) -> list[str]:
        """Every configurable key."""
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def field_help(cls) -> dict[str, str]:
        """Field docstrings by name (for ``--help`` texts and error messages)."""
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
        except (OSError, TypeError):
            return {}
        body = tree.body[0].body  # type: ignore[attr-defined]
        out = {}
        for node, after in zip(body, body[1:], strict=False):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)
            ):
                out[node.target.id] = " ".join(after.value.value.split())
        return out

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], *, source: str = "config") -> TrainingArguments:
        """Build from a mapping of field names (aliases allowed); values are type-checked."""
        hints = typing.get_type_hints(cls)
        kwargs: dict[str, Any] = {}
        for key, value in values.items():
            name = _canonical_key(str(key), source)
            if name in kwargs:
                raise ValueError(f"{source}: {name!r} is given twice (directly and through an alias)")
            kwargs[name] = _coerce(name, value, hints[name], source=source)
        try:
            return cls(**kwargs)
        except ValueError as exc:
            if kwargs.get("layout") == "auto" and str(exc).startswith("layout='auto'"):
                raise ValueError(f"{source}: {exc}") from None
            raise

    @classmethod
    def from_yaml(cls, path: str | Path, overrides: Iterable[str] = ()) -> TrainingArguments:
        """Load a YAML mapping of field names, then apply ``key=value`` overrides (later wins)."""
        text = Path(path).read_text()
        loaded = load_yaml(text, str(path))
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, Mapping):
            raise ValueError(
                f"{path}: expected a mapping of TrainingArguments fields, got {type(loaded).__name__}"
            )
        values: dict[str, Any] = {}
        for key, value in loaded.items():
            values[_canonical_key(str(key), str(path))] = value
        values.update(parse_overrides(overrides))
        return cls.from_dict(values, source=str(path))

    def with_overrides(self, overrides: Iterable[str]) -> TrainingArguments:
        """A copy with ``key=value`` overrides applied (validated like a fresh config)."""
        return type(self).from_dict({**self.to_dict(), **parse_overrides(overrides)}, source="overrides")

    def to_dict(self) -> dict[str, Any]:
        """Plain data (YAML/JSON-serialisable); without dp/tp/pp under ``layout: auto`` (the plan sets them)."""
        out = dataclasses.asdict(self)
        if self.layout == "auto":
            for name in ("dp", "tp", "pp"):
                out.pop(name)
        return out

    def to_yaml(self, path: str | Path | None = None) -> str:
        """The config as YAML (written to ``path`` when given); ``from_yaml`` reads it back."""
        text = str(_yaml().safe_dump(self.to_dict(), sort_keys=False))
        if path is not None:
            Path(path).write_text(text)
        return text


# ---------------------------------------------------------------------------- helpers


def auto_conflict_message(names: Sequence[str], values: Mapping[str, Any]) -> str:
    """The error for ``layout: auto`` together with explicit degrees (see [Note: layout auto])."""
    given = ", ".join(f"{n}={values[n]!r}" for n in names)
    unset = " ".join(f"training.{n}={'null' if n == 'dp' else 1}" for n in names)
    return (
        f"layout='auto' lets the planner choose dp, tp and pp, but the job also sets {given}: remove "
        f"{'/'.join(names)} from the training section (on the command line: {unset}), or set "
        "layout: manual to keep your degrees"
    )


def _check(ok: bool, name: str, value: Any, expected: str) -> None:
    if not ok:
        raise ValueError(f"{name}={value!r} is invalid: expected {expected}; set {name} accordingly")


def _check_int(args: TrainingArguments, name: str, *, minimum: int, hint: str = "") -> None:
    value = getattr(args, name)
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= minimum
    _check(ok, name, value, f"an integer >= {minimum}{' ' + hint if hint else ''}")


def _check_float(args: TrainingArguments, name: str, *, minimum: float) -> None:
    value = getattr(args, name)
    ok = (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value >= minimum
    )
    _check(ok, name, value, f"a number >= {minimum}")
    setattr(args, name, float(value))


def _canonical_key(key: str, source: str) -> str:
    name = KEY_ALIASES.get(key, key)
    valid = TrainingArguments.field_names()
    if name not in valid:
        close = difflib.get_close_matches(key, valid + list(KEY_ALIASES), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(
            f"{source}: unknown TrainingArguments key {key!r}{hint}. Valid keys: {', '.join(valid)}; "
            f"aliases: {', '.join(f'{a} -> {b}' for a, b in KEY_ALIASES.items())}"
        )
    return name


def parse_overrides(overrides: Iterable[str]) -> dict[str, Any]:
    """``["lr_scheduler_type=cosine", "--tp=2"]`` -> ``{"lr_scheduler_type": "cosine", "tp": 2}`` (YAML scalars)."""
    if isinstance(overrides, str):
        overrides = [overrides]
    out: dict[str, Any] = {}
    for item in overrides:
        key, raw = split_override(item, "of the form key=value (e.g. learning_rate=3e-4)")
        name = _canonical_key(key, "override")
        out[name] = override_value(name, raw, source=f"override {item!r}")
    return out


def override_value(name: str, raw: str, *, source: str = "override") -> Any:
    """The value of the override ``name=raw`` for the field ``name``: a YAML scalar, or the typed text for a
    string field (``output_dir=2024`` stays ``"2024"``). Used for flat overrides and a job's ``training.*``;
    text that is not YAML is a ValueError naming ``source``."""
    parsed = load_yaml(raw, source) if raw.strip() else ""
    members = _members(typing.get_type_hints(TrainingArguments)[name])
    if isinstance(parsed, str) or (
        str in members
        and isinstance(parsed, (int, float, bool))
        and not any(_convert(parsed, m) is not _NO for m in members if m is not str)
    ):
        parsed = raw.strip()  # e.g. output_dir=2024 stays the text the user typed
    return parsed
