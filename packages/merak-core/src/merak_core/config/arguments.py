"""``TrainingArguments``: the fields of a run, and building them from mappings and overrides.

See :mod:`merak_core.config` for [Note: batch sizes] and [Note: layout auto]; the fields' checks
are in ``checks.py`` (run by ``__post_init__``).
"""

from __future__ import annotations

import ast
import dataclasses
import datetime
import difflib
import inspect
import textwrap
import typing
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from merak_core.config.checks import check_arguments
from merak_core.config.values import (
    _NO,
    DTYPES,
    KEY_ALIASES,
    _coerce,
    _convert,
    _members,
    _yaml,
    load_yaml,
    parse_recompute,
    read_utf8,
    split_override,
)

__all__ = ["TrainingArguments", "override_value", "parse_overrides"]


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
    report_to: str | list[str] | None = None
    """Where the logged scalars go besides ``metrics.jsonl``: ``tensorboard``, ``wandb``, ``mlflow`` (a name or a
    list), ``all`` (every one installed) or ``none``; None: TensorBoard when installed, else a warning at start
    (see [Note: report_to] in :mod:`merak_core.run.reporting`). Rank 0 only; W&B honours ``WANDB_MODE``, MLflow
    ``MLFLOW_TRACKING_URI`` (default: its file store under ``output_dir/mlruns``)."""
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
    sample_prompts: list[str] | None = None
    """Prompts the model continues during training (collective, on the training layout), every
    ``sample_steps`` steps: rank 0 appends ``{"step", "prompt", "text"}`` lines to ``output_dir/samples.jsonl``
    and, with TensorBoard, to its text tab (``samples/<i>``). Needs a tokenizer (``sample_tokenizer``) and a
    layout that generation supports (docs/generation.md). None: no samples."""
    sample_steps: int | None = None
    """Generate the samples after every this many steps; None: after the last step only."""
    sample_max_new_tokens: int = 32
    """Tokens each sample adds at most (it stops earlier at the tokenizer's end-of-sequence token)."""
    sample_temperature: float = 0.0
    """0: greedy samples; > 0: sampled at this temperature, seeded from ``seed`` and the step."""
    sample_tokenizer: str | None = None
    """The samples' tokenizer (a ``tokenizer.json`` or a tokenizer folder); a job file fills it from its text
    data's ``data.tokenizer``, else its ``model.pretrained`` folder; ``Trainer(pretrained=...)`` from the folder."""
    seed: int = 42
    """Seed of parameter initialisation, data order and dropout."""
    bf16: bool = False
    """bfloat16 mixed precision: autocast compute over float32 parameters (needs dtype float32)."""
    dtype: str = "float32"
    """Parameter dtype: ``float32``, ``float64``, ``bfloat16`` or ``float16``."""
    dataloader_num_workers: int | None = None
    """Worker processes of the data loader on the ranks that read data; None: 2 on CUDA (with pinned
    memory), 0 on CPU. The batches are the same with any number (the order is the sampler's)."""
    labels: str = "shifted"
    """How the labels line up with the inputs (a job file sets it as ``data.labels``): ``shifted``, label t is
    the target of output t (the loss compares them position by position); ``unshifted``, the transformers
    convention (``labels = input_ids``, the model's loss shifts): Merak shifts the labels as it reads them,
    ``labels[..., 1:]`` padded with -100, so output t predicts label t + 1 as in transformers' causal-LM loss."""
    nonfinite: str = "stop"
    """A step whose loss or gradient norm is NaN or infinite: ``stop`` raises an error naming the step, the
    loss, the gradient norm and the first non-finite gradient; ``skip`` drops the step (no optimizer update,
    the learning-rate schedule does not advance) and counts it in the metrics (``skipped_steps``)."""
    nonfinite_max_consecutive_skips: int = 5
    """With ``nonfinite: skip``: at most this many steps in a row are skipped; the next non-finite step stops the
    run as ``nonfinite: stop`` would, and a run whose every step was skipped fails at its end. 0: no limit."""
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
    cp: int = 1
    """Context-parallel degree: each rank holds ``seq_len / cp`` tokens of every sample and attention runs over
    the cp group (``cp_mode``); 1: off. See docs/context_parallel.md for what it composes with."""
    cp_mode: str = "ring"
    """Attention over the cp group: ``ring`` (key/value blocks passed round the group, causal load balance by
    ``2 * cp`` chunks) or ``ulysses`` (all-to-all between sequence and heads; cp must divide the heads per TP
    rank)."""
    ep: int = 1
    """Expert-parallel degree, carved out of dp (ep must divide dp): each MoE block's experts are split over ep
    ranks (``experts / ep`` each) and tokens travel to them by all-to-all; 1: off. See docs/expert_parallel.md."""
    moe_capacity_factor: float | None = None
    """Each expert of an MoE block takes at most ``ceil(factor * tokens * top_k / experts)`` (token, expert) pairs
    per forward (tokens: the microbatch's on every rank of the EP group); later pairs in token order are dropped
    (zero expert output, the residual kept). None: dropless. [Note: expert capacity] in
    merak_core.parallel.moe_capacity."""
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
    too; 3: ZeRO-3, parameters too (2 and 3 with torch's FSDP2 over the DP axis, see merak_core.parallel.fsdp)."""
    tp_plan: str | dict[str, Any] | None = None
    """TP plan: None/``auto`` for known model types, a plan name (built in, or registered by the job's
    modules), a mapping module pattern -> style, or the full plan vocabulary (``layers``, ``sections``,
    ``attributes``, ``regions``, ... see ``merak_tp.plan_from_mapping``)."""
    tp_check: bool = False
    """Before training (tp > 1), run one batch through every module the TP plan shards and through the
    unsharded module (float64 copies, on the TP group) and stop with an error naming the modules that
    differ (relative difference above 1e-9, or 1e-5 when the sharded modules compute in float32 inside);
    ``merak check`` does the same before launch."""
    compile: bool | str = False
    """``torch.compile`` the stages: ``true`` each pipeline stage (the whole model at pp=1), ``regional`` each
    repeated block (traced shards at pp > 1), ``false`` eager ([Note: compiled stages] in
    merak_core.parallel.compile; split-backward schedules are refused)."""
    compile_backend: str = "inductor"
    """The ``torch.compile`` backend with ``compile``: ``inductor`` (generates kernels; needs a C compiler on
    CPU), ``aot_eager`` (no code generation; bit-identical to eager), or any ``torch.compiler.list_backends()``."""

    # ------------------------------------------------------------ the planner (see [Note: layout auto])
    layout: str = "manual"
    """``manual``: the job's dp/tp/pp and the other parallel fields; ``auto``: the planner chooses dp, tp,
    pp (cp and ep too, where the model allows them), schedule, microbatches and recomputation at start-up
    (dp/tp/pp, when written, only fix the global batch: see [Note: layout auto])."""
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
    allows to measure how much slower TP shards run than modelled (``merak_core.autoplan.probe``; a few
    seconds per TP degree)."""

    def __post_init__(self) -> None:
        check_arguments(self)  # config/checks.py, section by section

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
        return cls(**kwargs)

    @classmethod
    def from_yaml(cls, path: str | Path, overrides: Iterable[str] = ()) -> TrainingArguments:
        """Load a YAML mapping of field names, then apply ``key=value`` overrides (later wins)."""
        text = read_utf8(path, "config file")
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
        """Plain data (YAML/JSON-serialisable)."""
        return dataclasses.asdict(self)

    def to_yaml(self, path: str | Path | None = None) -> str:
        """The config as YAML (written to ``path`` when given); ``from_yaml`` reads it back."""
        text = str(_yaml().safe_dump(self.to_dict(), sort_keys=False))
        if path is not None:
            Path(path).write_text(text)
        return text


# ---------------------------------------------------------------------------- helpers


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
