"""Checks of a job that ``merak train`` runs once, in the launching process, before torchrun starts.

A mistake in a job file found on the ranks is reported once per rank, after every rank has
started, imported torch and joined the process group (and sometimes only at step 1). Here it is
found in one process, in seconds, and reported once with the key, the value and the fix:

- ``output_dir`` is a directory (or can be created) and writable, and ``--resume`` finds a checkpoint;
- the model factory's keyword arguments fit its signature (names and annotated or default
  types, each named ``model.kwargs.<key>``), and the model builds on the meta device
  (``merak_graph.empty_init``: no parameter memory);
- the TP plan resolves against the model: every pattern matches a module and every sharded
  size (and head count) divides by ``tp``; then ``merak_tp.parallelize`` itself shards a copy of
  the meta model as TP rank 0 of a fake group (:func:`check_tp_plan`);
- the data factory returns datasets (not an int or a dict), a first batch collates (ragged
  samples are named by index, with a collator hint), and on that batch the input ids lie inside
  the input embedding's vocabulary, the labels of the default cross-entropy loss are int64 class
  ids (or -100) inside the model's output size, and ``input_ids``-like inputs are integers.

Not checked here: anything that needs the process group or the real weights (the loss on real
values, memory), samples after the first few batches, and layouts chosen by ``layout: auto``
(their degrees are known only on the ranks; patterns are still checked).
"""

from __future__ import annotations

import inspect
import logging
import os
import tempfile
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from merak_core.job import JobConfig, _suggest

logger = logging.getLogger(__name__)

SHAPE_SCAN_SAMPLES = 64
"""Samples whose tensor shapes are compared with the first one (ragged data), beyond the first batch."""

__all__ = ["PreflightError", "PreflightReport", "check_batch", "check_dataset", "check_model_kwargs",
           "check_output_dir", "check_resume", "check_tp_plan", "first_batch", "preflight"]


class PreflightError(ValueError):
    """A mistake in the job found before launch (the message names the key, the value and the fix)."""


@dataclass
class PreflightReport:
    """What :func:`preflight` checked (for the launch log)."""

    checks: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        return "; ".join(self.checks)


# ---------------------------------------------------------------------------- output_dir


def check_output_dir(output_dir: str) -> None:
    """``output_dir`` is a writable directory, or can be created under a writable directory."""
    path = Path(output_dir)
    if path.exists() and not path.is_dir():
        raise PreflightError(f"training.output_dir={output_dir!r} exists and is not a directory; choose a directory "
                             "path (training.output_dir=...)")
    probe = path
    while not probe.exists():
        if probe.parent == probe:
            break
        probe = probe.parent
    if probe.exists() and not probe.is_dir():
        raise PreflightError(f"training.output_dir={output_dir!r}: {str(probe)!r} is a file, so the directory cannot "
                             "be created; choose another path")
    try:  # a real write: permission bits say nothing for root or on read-only and special file systems
        os.rmdir(tempfile.mkdtemp(prefix=".merak-write-check-", dir=probe))
    except OSError as exc:
        what = "is not writable" if probe == path else f"cannot be created: {str(probe)!r} is not writable"
        raise PreflightError(f"training.output_dir={output_dir!r} {what} ({exc.strerror}); choose a writable "
                             "directory (training.output_dir=...) or fix its permissions") from None


def check_resume(resume: str | None, output_dir: str) -> None:
    """``--resume latest`` needs a checkpoint in ``output_dir``; ``--resume PATH`` needs PATH to exist."""
    from merak_core.checkpoint.files import latest_candidates, pointer_root

    if resume in (None, "auto"):
        return
    root = Path(output_dir) / "checkpoints"
    if resume == "latest":
        if not latest_candidates(root):
            raise PreflightError(f"--resume latest: {str(root)!r} holds no checkpoint; start without --resume, or "
                                 "use --resume auto (the latest checkpoint when there is one, else a fresh start)")
        return
    assert resume is not None
    if pointer_root(resume) is None and not Path(resume).exists() and not (root / resume).exists():
        raise PreflightError(f"--resume {resume!r}: no such checkpoint (neither that path nor {str(root / resume)!r} "
                             "exists); pass a step_<N> directory, 'latest' or 'auto'")


# ---------------------------------------------------------------------------- the model


def _members(annotation: Any) -> tuple[Any, ...]:
    origin = typing.get_origin(annotation)
    return typing.get_args(annotation) if origin in (typing.Union, types.UnionType) else (annotation,)


def _fits(value: Any, annotation: Any) -> bool | None:
    """Whether ``value`` fits a simple annotation (None: cannot tell)."""
    checks: list[bool] = []
    for member in _members(annotation):
        if member is type(None):
            checks.append(value is None)
        elif member is bool:
            checks.append(isinstance(value, bool))
        elif member is int:
            checks.append(isinstance(value, int) and not isinstance(value, bool))
        elif member is float:
            checks.append(isinstance(value, (int, float)) and not isinstance(value, bool))
        elif member is str:
            checks.append(isinstance(value, str))
        elif typing.get_origin(member) in (list, tuple, Sequence) or member in (list, tuple):
            checks.append(isinstance(value, (list, tuple)))
        elif typing.get_origin(member) in (dict, Mapping) or member is dict:
            checks.append(isinstance(value, Mapping))
        else:
            return None
    return any(checks)


def _type_text(annotation: Any) -> str:
    return " or ".join("null" if m is type(None) else getattr(m, "__name__", str(m)) for m in _members(annotation))


def check_model_kwargs(fn: Callable[..., Any], kwargs: Mapping[str, Any], section: str = "model") -> None:
    """Every keyword is a parameter of ``fn`` and fits its annotation (or its default's type)."""
    try:
        sig = inspect.signature(fn)
        hints = typing.get_type_hints(fn)
    except (TypeError, ValueError, NameError):
        return
    params = sig.parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    named = [n for n, p in params.items() if p.kind in (inspect.Parameter.KEYWORD_ONLY,
                                                        inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    name = getattr(fn, "__qualname__", repr(fn))
    for key, value in kwargs.items():
        if key not in params:
            if takes_any:
                continue
            raise PreflightError(f"{section}.kwargs.{key}: {name}() takes no argument {key!r}"
                                 f"{_suggest(str(key), named)}; its arguments are {named}")
        param = params[key]
        if key in hints:
            ok, expected = _fits(value, hints[key]), _type_text(hints[key])
        elif param.default is not inspect.Parameter.empty and param.default is not None:
            default_type = type(param.default)
            ok = _fits(value, default_type) if default_type in (int, float, bool, str) else None
            expected = f"{default_type.__name__} (like its default {param.default!r})"
        else:
            ok = None
        if ok is False:
            raise PreflightError(f"{section}.kwargs.{key}={value!r} has the wrong type for {name}(): expected "
                                 f"{expected}, got {type(value).__name__}; fix {section}.kwargs.{key} in the job file")


def build_meta_model(job: JobConfig) -> nn.Module:
    """The job's model built under ``merak_graph.empty_init`` (parameters on the meta device)."""
    import merak_graph

    fn = job.model.load(job.base_dir, "model.factory")
    check_model_kwargs(fn, job.model.kwargs)
    try:
        with merak_graph.empty_init():
            model = fn(**job.model.kwargs)
    except Exception as exc:  # noqa: BLE001 - reported with the factory and the kwargs
        culprit = _culprit(fn, job.model.kwargs)
        if culprit is not None:
            raise PreflightError(f"model.kwargs.{culprit}={job.model.kwargs[culprit]!r} breaks model.factory "
                                 f"{job.model.spec!r} (it builds with the factory's default for {culprit!r}): "
                                 f"{type(exc).__name__}: {exc}{_where(exc)}; fix model.kwargs.{culprit}") from None
        raise PreflightError(f"model.factory {job.model.spec!r} failed with kwargs {job.model.kwargs}: "
                             f"{type(exc).__name__}: {exc}{_where(exc)}") from None
    if not isinstance(model, nn.Module):
        raise PreflightError(f"model.factory {job.model.spec!r} returned {type(model).__name__}, not a torch.nn.Module; "
                             "return the model")
    return model


def _culprit(fn: Callable[..., Any], kwargs: Mapping[str, Any], limit: int = 16) -> str | None:
    """The one keyword argument without which the factory builds (tried on the meta device), if there is one."""
    import merak_graph

    if not 0 < len(kwargs) <= limit:
        return None
    found = []
    for key in kwargs:
        try:
            with merak_graph.empty_init():
                fn(**{k: v for k, v in kwargs.items() if k != key})
        except Exception:  # noqa: BLE001 - still failing (or the key has no default): not this key alone
            continue
        found.append(key)
    return found[0] if len(found) == 1 else None


def _where(exc: BaseException) -> str:
    tb = exc.__traceback__
    last = None
    while tb is not None:
        last = tb
        tb = tb.tb_next
    if last is None:
        return ""
    return f" (at {last.tb_frame.f_code.co_filename}:{last.tb_lineno})"


# ---------------------------------------------------------------------------- the TP plan


def _resolve_plan(model: nn.Module, tp_plan: Any) -> Any:
    import merak_tp

    if tp_plan in (None, "auto"):
        return merak_tp.plan_for_model(model)
    if isinstance(tp_plan, str):
        return merak_tp.get_plan(tp_plan)
    from_mapping = getattr(merak_tp, "plan_from_mapping", None)
    if from_mapping is not None:
        return from_mapping(tp_plan)
    return merak_tp.TPPlan(name="user", layers=dict(tp_plan))


def _match(name: str, patterns: Any) -> str | None:
    import fnmatch

    return next((p for p in patterns if fnmatch.fnmatchcase(name, p)), None)


def _section_sizes(plan: Any, pattern: str, style: str, model: nn.Module, name: str, size: int) -> list[int]:
    if style == "column_qkv":
        return [size // 3] * 3
    spec = getattr(plan, "sections", {}).get(pattern)
    if spec is None:
        return [size]
    import merak_tp.plans as plans

    resolved = plans.resolve_sections(spec, model, name)
    return [size // resolved] * resolved if isinstance(resolved, int) else list(resolved)


def _sharded_sizes(module: nn.Module, style: str) -> tuple[str, int] | None:
    """The size a style splits (its name and value), or None for styles not checked here."""
    if style == "vocab" and isinstance(module, nn.Embedding):
        return "num_embeddings", module.num_embeddings
    transposed = type(module).__name__ == "Conv1D" and hasattr(module, "nf")
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        return None
    out_features, in_features = (weight.shape[1], weight.shape[0]) if transposed else weight.shape
    if style in ("column", "column_qkv", "lm_head"):
        return "out_features", int(out_features)
    if style == "row":
        return "in_features", int(in_features)
    return None


def check_tp_plan(model: nn.Module, tp_plan: Any, tp: int | None, overlap_chunks: int = 1) -> str | None:
    """Resolve the TP plan against ``model``: patterns match modules, sizes divide by ``tp``.

    Returns the plan's name, or None when the job uses no TP plan (``tp == 1`` and no
    ``tp_plan``). ``tp=None`` (the planner chooses it) checks the patterns only.
    """
    if (tp is None or tp == 1) and tp_plan in (None, "auto"):
        return None
    try:
        plan = _resolve_plan(model, tp_plan)
    except ValueError as exc:
        raise PreflightError(f"training.tp_plan={tp_plan!r}: {exc}") from None
    named = dict(model.named_modules())
    optional = tuple(getattr(plan, "optional", ()))
    for where in ("layers", "attributes", "regions"):
        for pattern in getattr(plan, where, ()):
            if pattern in optional or any(_match(n, [pattern]) for n in named if n):
                continue
            import difflib

            close = difflib.get_close_matches(pattern, [n for n in named if n], n=3, cutoff=0.5)
            raise PreflightError(
                f"training.tp_plan: {where} pattern {pattern!r} matches no module of {type(model).__name__} "
                f"(closest module names: {close or 'none'}); fix the pattern against model.named_modules() "
                "('*' matches any text, dots included)")
    if tp is None or tp == 1:
        return str(plan.name)
    check = getattr(plan, "check", None)
    if check is not None:
        try:
            check(model, tp)
        except ValueError as exc:
            raise PreflightError(f"training.tp={tp} with TP plan {plan.name!r}: {exc}") from None
    for name, module in named.items():
        pattern = _match(name, plan.layers) if name else None
        if pattern is not None:
            style = plan.layers[pattern]
            sized = _sharded_sizes(module, style)
            if sized is not None:
                what, size = sized
                for part in _section_sizes(plan, pattern, style, model, name, size):
                    if part % tp:
                        raise PreflightError(
                            f"training.tp={tp} does not divide {name}.{what}={size}"
                            f"{f' (a section of {part})' if part != size else ''}, sharded by style {style!r} of "
                            f"tp_plan pattern {pattern!r}; choose a TP degree that divides {part}, or leave "
                            f"{name!r} replicated")
        attr_pattern = _match(name, getattr(plan, "attributes", {}))
        for attr in getattr(plan, "attributes", {}).get(attr_pattern, ()) if attr_pattern else ():
            value = getattr(module, attr, None)
            if isinstance(value, int) and not isinstance(value, bool) and value % tp:
                raise PreflightError(f"training.tp={tp} does not divide {name}.{attr}={value} (TP plan "
                                     f"{plan.name!r}); choose a TP degree that divides {value}")
    _parallelize_on_fake_group(model, plan, tp, overlap_chunks)
    return str(plan.name)


def _parallelize_on_fake_group(model: nn.Module, plan: Any, tp: int, overlap_chunks: int) -> None:
    """Run ``merak_tp.parallelize`` itself on a copy of the meta model, as TP rank 0 of a fake group of ``tp``.

    [Note: the plan as the ranks apply it] The checks above speak in job-file terms; this one
    runs the very code every rank runs (module kinds, fused sections, head counts, the plan's own
    checks), over torch's fake process group (its collectives do nothing), in this process. It
    is skipped when torch does not ship the fake backend or a process group already exists here.
    """
    import copy

    import torch.distributed as dist

    import merak_tp
    from merak_core import _compat

    store = _compat.fake_process_group_store()
    if store is None or not dist.is_available() or dist.is_initialized():
        return
    dist.init_process_group("fake", rank=0, world_size=tp, store=store())
    try:
        merak_tp.parallelize(copy.deepcopy(model), plan, group=dist.group.WORLD, overlap_chunks=overlap_chunks)
    except ValueError as exc:
        raise PreflightError(f"training.tp={tp}, tp_plan {plan.name!r}: {exc}") from None
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------- data


def check_dataset(dataset: Any, what: str) -> int | None:
    """A map-style dataset (``__len__`` + ``__getitem__``) or an iterable one; returns its length."""
    from torch.utils.data import IterableDataset

    if isinstance(dataset, IterableDataset):
        return None
    if isinstance(dataset, Mapping):
        raise PreflightError(f"data.factory returned a dict with keys {sorted(map(str, dataset))} as the {what} set: "
                             "return a dataset, or the pair (train_dataset, eval_dataset)")
    if isinstance(dataset, (str, bytes)) or not (hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")):
        raise PreflightError(f"data.factory returned {type(dataset).__name__} ({_short(dataset)}) as the {what} set: "
                             "return a dataset (a torch.utils.data.Dataset, a list of samples, or an "
                             "IterableDataset), or the pair (train_dataset, eval_dataset)")
    size = len(dataset)
    if size == 0:
        raise PreflightError(f"the {what} set from data.factory is empty: it needs at least one sample")
    return int(size)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _shapes(sample: Any, prefix: str = "") -> dict[str, tuple[int, ...]]:
    """Tensor shapes inside one sample by path (``['input_ids']``, ``[0]``)."""
    if isinstance(sample, torch.Tensor):
        return {prefix or "sample": tuple(sample.shape)}
    out: dict[str, tuple[int, ...]] = {}
    if isinstance(sample, Mapping):
        for k, v in sample.items():
            out.update(_shapes(v, f"{prefix}[{k!r}]"))
    elif isinstance(sample, (list, tuple)) and not isinstance(sample, str):
        if sample and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in sample) and prefix:
            return {prefix: (len(sample),)}
        for i, v in enumerate(sample):
            out.update(_shapes(v, f"{prefix}[{i}]"))
    return out


def _ragged(dataset: Any, count: int, what: str) -> str | None:
    first = _shapes(dataset[0])
    for index in range(1, count):
        shapes = _shapes(dataset[index])
        for path, shape in first.items():
            if path in shapes and shapes[path] != shape:
                return (f"samples 0 and {index} of the {what} set have different shapes at {path}: "
                        f"{list(shape)} vs {list(shapes[path])}, so they cannot be stacked into a batch. Pad the "
                        "samples to one length in the dataset, or give the job a collate function that pads "
                        "(collate: file.py:function, e.g. with torch.nn.utils.rnn.pad_sequence)")
    return None


def first_batch(dataset: Any, collate: Callable[[list[Any]], Any] | None, batch_size: int, what: str) -> Any:
    """The first ``batch_size`` samples collated (ragged samples named when the default collate is used)."""
    from torch.utils.data import IterableDataset, default_collate

    if isinstance(dataset, IterableDataset):
        samples = []
        for sample in dataset:
            samples.append(sample)
            if len(samples) == batch_size:
                break
        if not samples:
            raise PreflightError(f"the {what} set from data.factory yields no sample")
    else:
        n = len(dataset)
        if collate is None:
            message = _ragged(dataset, min(n, max(batch_size, SHAPE_SCAN_SAMPLES)), what)
            if message is not None:
                raise PreflightError(message)
        samples = [dataset[i] for i in range(min(n, batch_size))]
    try:
        return (collate or default_collate)(samples)
    except Exception as exc:  # noqa: BLE001 - named with the data set and the fix
        who = "the job's collate function" if collate is not None else "the default collate (torch default_collate)"
        raise PreflightError(f"{who} cannot build a batch from the first {len(samples)} samples of the {what} set: "
                             f"{type(exc).__name__}: {exc}. Fix the samples or the collate function") from None


def _input_embedding(model: nn.Module) -> nn.Embedding | None:
    get = getattr(model, "get_input_embeddings", None)
    if callable(get):
        try:
            emb = get()
        except Exception:  # noqa: BLE001 - a model without one: look for the first embedding
            emb = None
        if isinstance(emb, nn.Embedding):
            return emb
    return next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)


def _id_tensors(inputs: Any) -> dict[str, torch.Tensor]:
    """Inputs that feed an embedding: ``input_ids`` of a dict, or a lone integer tensor."""
    if isinstance(inputs, Mapping):
        return {k: v for k, v in inputs.items() if k == "input_ids" and isinstance(v, torch.Tensor)}
    if isinstance(inputs, torch.Tensor):
        return {"inputs": inputs}
    return {}


def _bad_row(t: torch.Tensor, bad: torch.Tensor) -> int:
    return int(bad.reshape(t.shape[0], -1).any(dim=1).nonzero()[0, 0]) if t.dim() else 0


def check_batch(model: nn.Module, inputs: Any, labels: Any, *, default_loss: bool) -> None:
    """Dtypes and id ranges of the first batch against the model (see the module docstring)."""
    emb = _input_embedding(model)
    for key, ids in _id_tensors(inputs).items():
        if emb is None:
            break
        if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
            raise PreflightError(f"batch {key} has dtype {ids.dtype}, but the model looks them up in an embedding "
                                 f"(num_embeddings={emb.num_embeddings}): return integer token ids (torch.long) "
                                 "from the dataset or the collate function")
        if ids.numel():
            top, low = int(ids.max()), int(ids.min())
            if top >= emb.num_embeddings or low < 0:
                bad = (ids >= emb.num_embeddings) | (ids < 0)
                value = top if top >= emb.num_embeddings else low
                raise PreflightError(
                    f"batch {key} holds token id {value} (sample {_bad_row(ids, bad)} of the first batch), outside "
                    f"the model's vocabulary of {emb.num_embeddings} (ids 0..{emb.num_embeddings - 1}); fix the "
                    "tokenizer or the data, or build the model with a vocabulary that covers every id")
    if not default_loss or not isinstance(labels, torch.Tensor):
        return
    if labels.is_floating_point() or labels.dtype == torch.bool:
        raise PreflightError(f"labels have dtype {labels.dtype}, but the default loss (cross-entropy) needs integer "
                             "class ids (torch.long): convert them in the dataset or the collate function, or set "
                             "'loss: file.py:function' for another loss (e.g. mean squared error)")
    if labels.dtype != torch.long:
        raise PreflightError(f"labels have dtype {labels.dtype}, but the default loss (cross-entropy) needs torch.long "
                             "(int64) class ids: convert them with .long() in the dataset or the collate function")
    classes = _output_classes(model, inputs)
    if classes is not None and labels.numel():
        bad = ((labels >= classes) | (labels < 0)) & (labels != -100)
        if bool(bad.any()):
            value = int(labels[bad].flatten()[0])
            raise PreflightError(f"labels hold class id {value} (sample {_bad_row(labels, bad)} of the first batch), "
                                 f"outside the model's {classes} outputs (ids 0..{classes - 1}, or -100 to ignore a "
                                 "position); fix the labels or the model's output size")


def _output_classes(model: nn.Module, inputs: Any) -> int | None:
    """The size of the model's last output dim, from a forward on the meta device (None if that fails)."""
    def meta(x: Any) -> Any:
        return x.to("meta") if isinstance(x, torch.Tensor) else x

    try:
        with torch.no_grad():
            if isinstance(inputs, Mapping):
                out = model(**{k: meta(v) for k, v in inputs.items()})
            elif isinstance(inputs, (list, tuple)):
                out = model(*[meta(v) for v in inputs])
            else:
                out = model(meta(inputs))
    except Exception:  # noqa: BLE001 - not every model runs on meta tensors; the ranks check the loss then
        return None
    logits = getattr(out, "logits", out)
    if isinstance(logits, (tuple, list)) and logits:
        logits = logits[0]
    return int(logits.shape[-1]) if isinstance(logits, torch.Tensor) and logits.dim() >= 1 else None


# ---------------------------------------------------------------------------- everything


def preflight(job: JobConfig, *, tp: int | None = None, resume: str | None = None) -> PreflightReport:
    """Run every check of the module docstring on ``job``; raise :class:`PreflightError` on the first mistake.

    ``tp``: the TP degree the job will run with (default ``job.training.tp``; None when the
    planner chooses it). ``resume``: the ``--resume`` argument.
    """
    from merak_core.data import split_inputs_labels

    t = job.training
    report = PreflightReport()
    check_output_dir(t.output_dir)
    check_resume(resume, t.output_dir)
    report.checks.append(f"output_dir {t.output_dir} writable")
    model = build_meta_model(job)
    report.checks.append(f"model {type(model).__name__} builds")
    plan = check_tp_plan(model, t.tp_plan, t.tp if tp is None and t.layout != "auto" else tp, t.overlap_chunks)
    if plan is not None:
        report.checks.append(f"TP plan {plan} resolves")
    data_fn = job.data.load(job.base_dir, "data.factory")
    check_model_kwargs(data_fn, job.data.kwargs, "data")
    try:
        train, evaluation = job.build_datasets()
    except ValueError:
        raise
    except Exception as exc:  # noqa: BLE001 - reported with the factory and the kwargs
        raise PreflightError(f"data.factory {job.data.spec!r} failed with kwargs {job.data.kwargs}: "
                             f"{type(exc).__name__}: {exc}{_where(exc)}") from None
    collate = job.optional("collate")
    for what, dataset, batch_size in (("training", train, t.per_device_train_batch_size),
                                      ("evaluation", evaluation, t.per_device_eval_batch_size)):
        if dataset is None:
            continue
        check_dataset(dataset, what)
        batch = first_batch(dataset, collate, batch_size, what)
        try:
            inputs, labels = split_inputs_labels(batch)
        except ValueError as exc:
            raise PreflightError(f"the first {what} batch: {exc}") from None
        check_batch(model, inputs, labels, default_loss=job.loss is None)
        report.checks.append(f"first {what} batch collates")
    return report
