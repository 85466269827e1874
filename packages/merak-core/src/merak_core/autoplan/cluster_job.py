"""A job file's model on the meta device, planned for a cluster or dry-run at N ranks (the CLI's
``merak plan --cluster FILE --nodes N`` and ``--dry-run-ranks N``).

The job's model factory runs under ``merak_graph.empty_init()`` (no weights allocated, whatever
the size) and is cast to the job's ``training.dtype`` as the Trainer casts it; one training sample
gives the input shapes, moved to the meta device. With ``model.lora`` the model carries its adapters
and every other weight is frozen, priced as weights only ([Note: frozen weights]). Compute is priced at the peak of the job's
compute dtype (``compute_dtype``: ``training.bf16`` or ``dtype: bfloat16`` at the bf16 peak), never
read from the model's parameters. Heads, kv heads and vocabulary are read from the model (the
attributes the profiler reads) to constrain tp.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from merak_core.planner.cluster import ClusterSpec, compute_dtype
from merak_core.planner.cluster_context import attach_attentions
from merak_core.planner.cluster_cost import model_costs, trace_for_cluster
from merak_core.planner.cluster_search import format_cluster_plan, plan_cluster
from merak_core.planner.context_cost import runnable_cp
from merak_core.planner.dryrun import DryRunReport, dry_run

__all__ = ["JobModel", "job_model", "plan_job_on_cluster", "dry_run_job"]


@dataclass
class JobModel:
    """A job's model on the meta device with one sample's example inputs."""

    model: nn.Module
    example_inputs: Any
    num_heads: int | None
    num_kv_heads: int | None
    vocab_size: int | None
    dtype: str
    """The cluster's ``peak_tflops`` key the job computes at (:func:`compute_dtype`)."""


def _to_meta(x: Any, dtype: torch.dtype) -> Any:
    """One sample on the meta device, floating tensors in the job's ``dtype`` (as the Trainer feeds them)."""
    if isinstance(x, torch.Tensor):
        return x[:1].to("meta", dtype=dtype if x.is_floating_point() else x.dtype)
    if isinstance(x, Mapping):
        return {k: _to_meta(v, dtype) for k, v in x.items()}
    return x


def job_model(job: Any) -> JobModel:
    """Build ``job``'s model on the meta device and one sample of its inputs (meta tensors)."""
    import merak_graph as mg
    from merak_core.autoplan.auto import profile_inputs
    from merak_core.planner.profile import tp_constraints

    t = job.training
    dtype = compute_dtype(dtype=t.dtype, bf16=t.bf16)
    torch.manual_seed(t.seed)
    with mg.empty_init():
        model = job.build_model().to(dtype=t.torch_dtype)
    lora = getattr(job.model, "lora", None)
    if lora is not None:  # the adapters train, every other weight is frozen: priced as weights only
        from merak_core.lora.apply import apply_lora

        apply_lora(model, lora)
    train, _ = job.build_datasets()
    inputs = _to_meta(profile_inputs(model, train, 1, job.optional("collate")), t.torch_dtype)
    heads, kv_heads, vocab = tp_constraints(model, t.tp_plan)
    return JobModel(
        model=model,
        example_inputs=inputs if isinstance(inputs, Mapping) else (inputs,),
        num_heads=heads,
        num_kv_heads=kv_heads,
        vocab_size=vocab,
        dtype=dtype,
    )


def plan_job_on_cluster(
    jm: JobModel,
    cluster: ClusterSpec,
    *,
    num_nodes: int,
    global_batch_size: int,
    top: int = 10,
    cps: Sequence[int] = (1,),
    cp_mode: str | Sequence[str] = "ring",
) -> tuple[str, Any]:
    """The ranked table for ``jm`` on ``num_nodes`` nodes of ``cluster``; (text, best candidate).

    ``cps``: the context-parallel degrees tried (the CLI: those the model and its batch allow, :func:`merak_core.autoplan.givens.model_cp_degrees`)."""
    sharded = trace_for_cluster(jm.model, jm.example_inputs, cluster, dtype=jm.dtype)
    costs = model_costs(
        sharded,
        jm.model,
        dtype=jm.dtype,
        num_heads=jm.num_heads,
        num_kv_heads=jm.num_kv_heads,
        vocab_size=jm.vocab_size,
    )
    attach_attentions(costs, jm.model)
    cands = plan_cluster(
        costs, cluster, num_nodes=num_nodes, global_batch_size=global_batch_size, cps=cps, cp_mode=cp_mode
    )
    cands = runnable_cp(
        cands, jm.model
    )  # what the run refuses at a candidate's layout (a router aux loss at pp > 1)
    world = num_nodes * cluster.devices_per_node
    head = (
        f"{len(cands)} feasible configurations on {num_nodes} nodes x {cluster.devices_per_node} "
        f"{cluster.device_name or 'devices'} ({world} ranks, cluster {cluster.name}), global batch "
        f"{global_batch_size}; {costs.num_layers} layers (graph shards) priced from the meta-traced model "
        f"at {cluster.flops(jm.dtype) / 1e12:.1f} TFLOP/s sustained ({jm.dtype})"
    )
    return head + "\n" + format_cluster_plan(cands, top=top), cands[0]


def dry_run_job(jm: JobModel, cluster: ClusterSpec, *, world_size: int, training: Any) -> DryRunReport:
    """Dry-run the job's training section at ``world_size`` ranks (dp inferred: N / (cp * tp * pp)).

    The job's tp, pp, schedule, microbatches (gradient_accumulation_steps), micro batch size,
    recompute, ZeRO stage and overlap_chunks are used; what the cluster model does not price (an
    interleaved schedule, uniform recomputation) is replaced by its nearest priced choice and said so.
    """
    from merak_core.planner.choices import PREDICTABLE_SCHEDULES
    from merak_core.planner.dryrun import DryRunProblem

    t = training
    notes = []
    schedule = t.schedule
    if schedule == "auto":
        schedule = "shifted_critical_path" if t.memory_budget is not None else "1f1b"
    if schedule not in PREDICTABLE_SCHEDULES:
        notes.append(f"schedule {schedule!r} is not priced by the cluster model: 1f1b was dry-run instead")
        schedule = "1f1b"
    recompute = t.recompute
    if recompute not in ("none", "full", "stage_aware"):
        notes.append(
            f"recompute {recompute!r} is not priced by the cluster model: full recomputation was dry-run"
        )
        recompute = "full"
    report = dry_run(
        jm.model,
        jm.example_inputs,
        cluster,
        world_size=world_size,
        dp=None,
        tp=t.tp,
        pp=t.pp,
        schedule=schedule,
        num_microbatches=t.gradient_accumulation_steps,
        micro_batch_size=t.per_device_train_batch_size,
        recompute=recompute,
        zero_stage=t.zero_stage,
        tp_overlap=t.overlap_chunks > 1,
        tp_chunks=max(t.overlap_chunks, 2),
        num_heads=jm.num_heads,
        num_kv_heads=jm.num_kv_heads,
        vocab_size=jm.vocab_size,
        dtype=jm.dtype,
        ep=t.ep,
        cp=t.cp,
        cp_mode=t.cp_mode,
    )
    report.problems[:0] = [DryRunProblem(0, None, "model", n, fatal=False) for n in notes]
    return report
