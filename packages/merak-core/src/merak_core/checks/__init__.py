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
  ids (or -100) inside the model's output size, and ``input_ids``-like inputs are integers;
- the sizes (:mod:`~merak_core.checks.sizes`): microbatches against ``pp``, attention heads
  against ``tp``, the training set against one global batch, the first batch against the model's
  position table, and that batch counts a label; the metrics function runs on that batch
  (:mod:`~merak_core.checks.metrics`);
- the first batch against ``forward`` (:mod:`~merak_core.checks.forward`): its input keys name
  parameters, and the default loss finds logits in the output.

Not checked here: anything that needs the process group or the real weights (the loss on real
values, memory), samples after the first few batches, and layouts chosen by ``layout: auto``
(their degrees are known only on the ranks; patterns are still checked).

Modules: ``files`` (output_dir, --resume), ``model`` (factory arguments, the meta build), ``tp_plan``,
``data`` (datasets and the first batch); ``base`` (the error and the report).

May import the folders below it (``lora``, ``parallel``, ``config``, ``data``, ``checkpoint``,
``generation``, ``hf``) and ``merak_core.job``; never ``run``, the planners, the Trainer or the CLI.
"""

from __future__ import annotations

from typing import Any

from merak_core.checks.base import PreflightError, PreflightReport
from merak_core.checks.data import (
    SHAPE_SCAN_SAMPLES,
    check_batch,
    check_dataset,
    check_labels_not_inputs,
    first_batch,
)
from merak_core.checks.files import check_export_dir, check_output_dir, check_resume
from merak_core.checks.forward import check_default_loss_output, check_input_keys, check_traceable
from merak_core.checks.metrics import check_metrics
from merak_core.checks.model import _where, build_meta_model, check_model_kwargs
from merak_core.checks.sizes import (
    check_attention_heads,
    check_global_batch,
    check_labels_counted,
    check_microbatches,
    check_positions,
)
from merak_core.checks.tp_plan import _resolve_plan, check_tp_plan
from merak_core.job import JobConfig

__all__ = [
    "SHAPE_SCAN_SAMPLES",
    "PreflightError",
    "PreflightReport",
    "build_meta_model",
    "check_batch",
    "check_dataset",
    "check_model_kwargs",
    "check_output_dir",
    "check_resume",
    "check_tp_plan",
    "first_batch",
    "preflight",
]


def preflight(job: JobConfig, *, tp: int | None = None, resume: str | None = None) -> PreflightReport:
    """Run every check of the module docstring on ``job``; raise :class:`PreflightError` on the first mistake.

    ``tp``: the TP degree the job will run with (default ``job.training.tp``; None when the
    planner chooses it). ``resume``: the ``--resume`` argument.
    """
    from merak_core.data.loader import label_split
    from merak_core.parallel.virtual_stages import check_layer_count

    t = job.training
    report = PreflightReport()
    check_output_dir(t.output_dir)
    check_export_dir(t.export_hf_dir)
    check_resume(resume, t.output_dir)
    report.checks.append(f"output_dir {t.output_dir} writable")
    check_microbatches(t)
    model = build_meta_model(job)
    report.checks.append(f"model {type(model).__name__} builds")
    from merak_core.checks.lora import check_lora_targets

    report.checks.extend(check_lora_targets(model, job.model.lora))
    from merak_core.checks.context_parallel import check_cp_first_batch, check_cp_job

    report.checks.extend(check_cp_job(job, model))  # training.cp > 1: the model, LoRA, the loss
    from merak_core.checks.expert_parallel import check_ep_job

    report.checks.extend(check_ep_job(job, model))  # training.ep > 1: the model's MoE blocks, LoRA
    from merak_core.checks.router_aux import check_router_aux_job

    report.checks.extend(check_router_aux_job(job, model))  # output_router_logits: pp 1, cp 1
    from merak_core.checks.generation import check_samples_job

    report.checks.extend(check_samples_job(job, model))  # training.sample_prompts: tokenizer, layout
    if t.virtual_stages > 1:
        try:
            check_layer_count(model, t.pp, t.virtual_stages)
        except ValueError as exc:
            raise PreflightError(str(exc)) from None
        report.checks.append(f"{t.pp * t.virtual_stages} virtual stages fit the model's layers")
    tp_degree = t.tp if tp is None and t.layout != "auto" else tp
    plan = check_tp_plan(model, t.tp_plan, tp_degree, t.overlap_chunks)
    if plan is not None:
        check_attention_heads(model, _resolve_plan(model, t.tp_plan), tp_degree)
        report.checks.append(f"TP plan {plan} resolves")
    if t.sequence_parallel and ((t.tp if tp is None else tp) or 0) > 1:
        from merak_core.checks.tp_check import check_sequence_parallel

        try:
            check_sequence_parallel(model, t.tp_plan)
        except ValueError as exc:
            raise PreflightError(str(exc)) from None
        report.checks.append("sequence parallelism supported by the TP plan")
    data_fn = job.data.load(job.base_dir, "data.factory")
    check_model_kwargs(data_fn, job.data.kwargs, "data")
    try:
        train, evaluation = job.build_datasets()
    except ValueError:
        raise
    except Exception as exc:  # noqa: BLE001 - reported with the factory and the kwargs
        raise PreflightError(
            f"data.factory {job.data.spec!r} failed with kwargs {job.data.kwargs}: "
            f"{type(exc).__name__}: {exc}{_where(exc)}"
        ) from None
    collate = job.optional("collate")
    first: dict[str, Any] = {}
    for what, dataset, batch_size in (
        ("training", train, t.per_device_train_batch_size),
        ("evaluation", evaluation, t.per_device_eval_batch_size),
    ):
        if dataset is None:
            continue
        size = check_dataset(dataset, what)
        if what == "training" and t.layout != "auto":  # auto chooses the batch split on the ranks
            check_global_batch(size, t, t.dp)
        batch = first_batch(dataset, collate, batch_size, what)
        try:
            inputs, labels = label_split(t.labels)(batch)  # unshifted: shifted here, as the ranks do
        except ValueError as exc:
            raise PreflightError(f"the first {what} batch: {exc}") from None
        _check_against_model(job, model, inputs, labels, what, report)
        first[what] = (inputs, labels)
        check_cp_first_batch(inputs, labels, t, what)  # its length, padding and positions at cp > 1
        report.checks.append(f"first {what} batch collates")
    if job.metrics is not None and "evaluation" in first:
        check_metrics(job, model, *first["evaluation"])
        report.checks.append(f"metrics {job.metrics} runs")
    return report


def _check_against_model(
    job: JobConfig, model: Any, inputs: Any, labels: Any, what: str, report: PreflightReport
) -> None:
    """The first batch of the ``what`` set against the model: ids, labels, forward, positions, tracing."""
    t = job.training
    check_batch(model, inputs, labels, default_loss=job.loss is None)
    if t.labels == "shifted" and job.loss is None:
        check_labels_not_inputs(inputs, labels, what)
    check_input_keys(model, inputs, what)
    check_positions(model, inputs, job, what)
    check_labels_counted(labels, what)
    if what == "training" and job.loss is None:
        check_default_loss_output(model, inputs)
    if what == "training" and check_traceable(model, inputs, t):
        report.checks.append(f"the model traces for pp={t.pp}")
