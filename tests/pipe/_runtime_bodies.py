"""Test bodies run on every rank of the worker pool (module level, picklable), plus references.

A *case* is a dict: model ("gpt", "llama", "llama-dict"), schedule name, num_stages,
num_microbatches, recompute (None, "full" or a float), seqs (one sequence length per step),
batch, and optionally nccl_rules (True: the transport runs as on NCCL, every p2p op on tag 0
and one Work per batch, so gloo matches each pair's messages in issue order alone). :func:`train_body` builds the stages of this rank from a full float64 reference model,
runs one ``PipelineRunner.step`` per sequence length, and returns per step the loss (on the
last-stage rank) and the gradient of every parameter this rank holds, by the full model's
names. :func:`reference` computes the same in one process.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from merak_pipe.ir import ActionKind, Schedule
from merak_pipe.runner import PipelineRunner
from merak_pipe.schedules import build_schedule
from merak_pipe.shared import shared_parameter_groups, shared_parameters_list
from merak_pipe.stage import PipelineStage
from tests.pipe._runtime_support import build_model, layers_for, model_units, split_units
from tests.support.models import REFERENCE_MODELS, lm_loss

TIMEOUT = timedelta(seconds=30)


def make_schedule(case: dict[str, Any], world: int) -> Schedule:
    options = dict(case.get("options", {}))
    return build_schedule(
        case["schedule"],
        num_stages=case["num_stages"],
        num_microbatches=case["num_microbatches"],
        num_ranks=world,
        recompute=case.get("recompute"),
        **options,
    )


def batch_for(case: dict[str, Any], step: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    ref = REFERENCE_MODELS["gpt"]  # token models share the input/label makers
    (ids,) = ref.make_inputs(case["batch"], seq, 100 + step)
    labels = ref.make_labels(case["batch"], seq, 100 + step)
    return ids, labels


def build_runner(
    case: dict[str, Any], schedule: Schedule, group: dist.ProcessGroup | None = None, **runner_kwargs: Any
) -> tuple[torch.nn.Module, PipelineRunner]:
    rank = dist.get_rank(group)
    num_stages = case["num_stages"]
    model = build_model(case["model"], num_layers=layers_for(num_stages), dropout=case.get("dropout", 0.0))
    modules = split_units(model_units(case["model"], model), num_stages)
    stages = [
        PipelineStage(modules[s], stage_index=s, num_stages=num_stages, group=group)
        for s in schedule.stages_of(rank)
    ]
    shared: list[Any] = []
    if case["model"] == "gpt":
        groups = shared_parameter_groups(
            {"wte.weight": [schedule.rank_of(0), schedule.rank_of(num_stages - 1)]}, group=group
        )
        shared = shared_parameters_list({"wte.weight": model.wte.weight}, groups)
    runner_kwargs.setdefault("timeout", TIMEOUT)
    runner_kwargs.setdefault("loss_reduction", case.get("loss_reduction", "mean"))
    runner_kwargs.setdefault("nccl_rules", case.get("nccl_rules", False))
    runner = PipelineRunner(
        stages, schedule, loss_fn=lm_loss, group=group, shared_parameters=shared, **runner_kwargs
    )
    return model, runner


def train_body(case: dict[str, Any], schedule: Schedule | None = None) -> list[dict[str, Any]]:
    """One runner, one step per sequence length; per step: loss and this rank's grads by name."""
    world = dist.get_world_size()
    schedule = schedule if schedule is not None else make_schedule(case, world)
    if "seed" in case:
        torch.manual_seed(case["seed"])
    model, runner = build_runner(case, schedule)
    if "seed" in case:
        torch.manual_seed(case["seed"] + dist.get_rank())
    results = []
    for step, seq in enumerate(case["seqs"]):
        model.zero_grad(set_to_none=True)
        ids, labels = batch_for(case, step, seq)
        loss = runner.step(
            ids if runner.holds_first_stage else None, labels if runner.holds_last_stage else None
        )
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results.append(
            {
                "loss": loss,
                "grads": grads,
                "pending": [st.pending_microbatches() for st in runner.stages.values()],
                "allocated": runner.transport.buffers_allocated,
                "reused": runner.transport.buffers_reused,
            }
        )
    return results


def reference(case: dict[str, Any]) -> list[dict[str, Any]]:
    """The same steps in one process, full batch at once."""
    model = build_model(case["model"], num_layers=layers_for(case["num_stages"]))
    results = []
    for step, seq in enumerate(case["seqs"]):
        model.zero_grad(set_to_none=True)
        ids, labels = batch_for(case, step, seq)
        loss = lm_loss(model(ids), labels)
        if case.get("loss_reduction") == "sum":
            # The sum of the microbatches' mean losses: equal microbatches, so M x the full mean.
            loss = loss * case["num_microbatches"]
        loss.backward()
        results.append(
            {
                "loss": loss.detach(),
                "grads": {n: p.grad.detach().clone() for n, p in model.named_parameters()},
            }
        )
    return results


def strip_recompute_actions(schedule: Schedule) -> Schedule:
    """The same order of compute actions without R and without a recompute plan."""
    actions = {
        r: [a for a in acts if a.kind is not ActionKind.RECOMPUTE] for r, acts in schedule.actions.items()
    }
    return Schedule(
        name=schedule.name + "-norecompute",
        num_stages=schedule.num_stages,
        num_microbatches=schedule.num_microbatches,
        stage_to_rank=schedule.stage_to_rank,
        actions=actions,
        lowered=schedule.lowered,
        recompute=None,
    )


def dropout_body(case: dict[str, Any], strip: bool) -> list[dict[str, Any]]:
    """Train with dropout, with the schedule's recompute plan or (strip=True) without recompute."""
    schedule = make_schedule(case, dist.get_world_size())
    if strip:
        schedule = strip_recompute_actions(schedule)
    return train_body(case, schedule)


def evaluate_body(case: dict[str, Any]) -> Any:
    schedule = make_schedule(case, dist.get_world_size())
    model, runner = build_runner(case, schedule)
    ids, labels = batch_for(case, 0, case["seqs"][0])
    x, y = (ids if runner.holds_first_stage else None), (labels if runner.holds_last_stage else None)
    first = runner.evaluate(x, y, return_outputs=True)
    # Evaluate and step share the channels: a step in between (other grad flags, so a new header)
    # and a second evaluate must still line up; the model is unchanged (no optimizer).
    step_loss = runner.step(x, y)
    again = runner.evaluate(x, y, return_outputs=True)
    return {"evaluate": first, "step_loss": step_loss, "again": again}


def subgroup_body(case: dict[str, Any]) -> list[dict[str, Any]] | None:
    """World of 4 = two pipelines of 2 ranks side by side ({0, 2} and {1, 3}): p2p by group rank."""
    rank = dist.get_rank()
    pipelines = [[0, 2], [1, 3]]
    groups = [dist.new_group(p) for p in pipelines]
    group = groups[rank % 2]
    schedule = make_schedule(case, 2)
    model, runner = build_runner(case, schedule, group=group)
    results = []
    for step, seq in enumerate(case["seqs"]):
        model.zero_grad(set_to_none=True)
        ids, labels = batch_for(case, step, seq)
        loss = runner.step(
            ids if runner.holds_first_stage else None, labels if runner.holds_last_stage else None
        )
        results.append(
            {
                "loss": loss,
                "grads": {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
            }
        )
    return results


def failure_body(case: dict[str, Any], mode: str, victim: int, timeout_s: float) -> str | None:
    """Rank ``victim`` stalls (never runs its step) or dies (``os._exit``); the others report their error."""
    world = dist.get_world_size()
    group = dist.new_group(list(range(world)))  # a fresh group: unmatched receives die with it
    schedule = make_schedule(case, world)
    model, runner = build_runner(case, schedule, group=group, timeout=timedelta(seconds=timeout_s))
    if dist.get_rank() == victim:
        if mode == "die":
            time.sleep(0.2)
            os._exit(17)
        time.sleep(timeout_s + 1.0)  # stall past everyone's timeout, then leave without a step
        return None
    ids, labels = batch_for(case, 0, case["seqs"][0])
    start = time.monotonic()
    try:
        runner.step(ids if runner.holds_first_stage else None, labels if runner.holds_last_stage else None)
    except Exception as exc:
        if mode == "die":
            raise  # the pool reports every rank's traceback when one rank died
        return f"{type(exc).__name__} after {time.monotonic() - start:.1f}s: {exc}"
    return "no error"


def bad_input_body(case: dict[str, Any]) -> dict[str, str]:
    """Each bad call must raise ValueError before communicating; a good step afterwards still works."""
    world = dist.get_world_size()
    schedule = make_schedule(case, world)
    model, runner = build_runner(case, schedule)
    errors: dict[str, str] = {}
    ids, labels = batch_for(case, 0, case["seqs"][0])
    first, last = runner.holds_first_stage, runner.holds_last_stage
    trials = {
        "not_divisible": (ids[:6] if first else None, labels[:6] if last else None),
        "too_few_samples": (ids[:2] if first else None, labels[:2] if last else None),
        "missing_inputs": (None, labels if last else None),
        "missing_labels": (ids if first else None, None),
    }
    for name, (x, y) in trials.items():
        if name == "missing_inputs" and not first or name == "missing_labels" and not last:
            continue
        if name in ("not_divisible", "too_few_samples") and not (first or last):
            continue
        try:
            runner.step(x, y)
        except ValueError as exc:
            errors[name] = str(exc)
    try:
        PipelineStage(torch.nn.Linear(2, 2), stage_index=0, num_stages=world + 1)
        PipelineRunner(
            [PipelineStage(torch.nn.Linear(2, 2), stage_index=0, num_stages=world + 1)],
            schedule,
            loss_fn=lm_loss,
        )
    except ValueError as exc:
        errors["stage_count"] = str(exc)
    wrong_ranks = build_schedule("1f1b", num_stages=2 * world, num_microbatches=4, num_ranks=2 * world)
    try:
        PipelineRunner(list(runner.stages.values()), wrong_ranks, loss_fn=lm_loss)
    except ValueError as exc:
        errors["group_size"] = str(exc)
    # Nothing was sent: a correct step on the same runner still matches the reference (checked by the test).
    model.zero_grad(set_to_none=True)
    loss = runner.step(ids if first else None, labels if last else None)
    errors["good_loss"] = repr(None if loss is None else float(loss))
    return errors


def timing_body(case: dict[str, Any], steps: int) -> dict[str, Any]:
    from merak_pipe.timing import gather_timings, measured_chrome_trace, measured_costs, measured_step_time

    schedule = make_schedule(case, dist.get_world_size())
    model, runner = build_runner(case, schedule, record_timing=True)
    collected = []
    for step in range(steps):
        model.zero_grad(set_to_none=True)
        ids, labels = batch_for(case, step, case["seqs"][0])
        runner.step(ids if runner.holds_first_stage else None, labels if runner.holds_last_stage else None)
        collected.extend(gather_timings(runner.timings))
    own = [str(a) for a in runner.schedule.actions[dist.get_rank()]]
    mine = [t.action for t in runner.timings]
    trace = measured_chrome_trace(gather_timings(runner.timings))
    return {
        "own": own,
        "recorded": mine,
        "costs": measured_costs(collected, runner.schedule),
        "step_s": measured_step_time(gather_timings(runner.timings)),
        "events": len(trace["traceEvents"]),
        "last_step_s": runner.last_step_s,
        "own_span_s": measured_step_time(runner.timings),
        "ordered": all(t.start_s <= t.ready_s <= t.end_s for t in runner.timings),
        "recompute_s": sum(t.recompute_s + (t.compute_s if t.kind == "R" else 0.0) for t in runner.timings),
    }


def v_schedule(
    *, num_stages: int, num_microbatches: int, num_ranks: int | None = None, recompute: Any = None
) -> Schedule:
    """A user-defined GPipe-order "V" schedule: stage s on rank min(s, S - 1 - s) (2 stages per rank).

    Stages 1 and 2 share rank 1 and stages 0 and 3 share rank 0 (for S = 4), so the runtime hands
    values between stages of one rank without communication; the tied GPT embedding (stages 0 and
    S - 1) is one Parameter object on rank 0.
    """
    from merak_pipe.ir import Action

    ranks = num_stages // 2
    stage_to_rank = tuple(min(s, num_stages - 1 - s) for s in range(num_stages))
    actions: dict[int, list[Action]] = {r: [] for r in range(ranks)}
    for s in range(num_stages):
        actions[stage_to_rank[s]] += [Action(s, ActionKind.FORWARD, m) for m in range(num_microbatches)]
    for s in reversed(range(num_stages)):
        actions[stage_to_rank[s]] += [Action(s, ActionKind.FULL_BACKWARD, m) for m in range(num_microbatches)]
    return Schedule(
        name="v-gpipe",
        num_stages=num_stages,
        num_microbatches=num_microbatches,
        stage_to_rank=stage_to_rank,
        actions=actions,
        recompute=recompute,
    )


def registered_v_body(case: dict[str, Any]) -> list[dict[str, Any]]:
    from merak_pipe.schedules import register_schedule

    register_schedule("test-v-gpipe", v_schedule, overwrite=True)
    return train_body(case)


def csv_body(case: dict[str, Any], lowered: bool) -> list[dict[str, Any]]:
    """Run a schedule written to CSV (compute-only or with send/recv) and read back."""
    from merak_pipe.csv_io import from_csv, to_csv
    from merak_pipe.lowering import lower

    built = make_schedule(case, dist.get_world_size())
    text = to_csv(lower(built) if lowered else built, drop_recompute=True)
    return train_body(case, from_csv(text, recompute=built.recompute))
