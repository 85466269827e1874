"""The pipeline runtime's own costs: per action (:func:`measure_action_cost`, collective;
:func:`busiest_actions`) and of its split backward (:func:`measure_split_backward_scale`, one process).

[Note: per-action measurement]
merak_pipe's runner spends host time on every action of a step besides the math (issuing a send or a
receive, waking up when one arrives, the bookkeeping around a forward or a backward). ``layout: auto``
measures it on the ranks it has, as ``bench_pipe_runtime.py --section actions`` does: every rank
holds one stage of a plain 1F1B pipeline over the whole world whose stage is a tiny linear layer (its
compute is negligible), the step time (the slowest rank's, the median of a few steps) divided by the
busiest rank's number of lowered actions is the seconds per action. It is the planner's
``CommModel.per_action_s`` (priced by merak_pipe's simulator) and what a cluster file's
``device.per_action_us`` states for other machines. The same number on every rank (every step's time
is the slowest rank's).
"""

from __future__ import annotations

import logging
import math
import statistics
from typing import Any

import torch
from torch import nn

from merak_core.planner.clock import now

logger = logging.getLogger(__name__)

__all__ = [
    "action_probe",
    "busiest_actions",
    "check_split_backward_scale",
    "measure_action_cost",
    "measure_split_backward_scale",
    "runtime_actions_s",
]

_WIDTH = 16


def busiest_actions(schedule: Any) -> int:
    """The most lowered actions (compute, send, receive and the runtime's own) any rank runs in a step."""
    from merak_pipe import lower

    lowered = schedule if schedule.lowered else lower(schedule)
    return max(len(lowered.actions[r]) for r in range(lowered.num_ranks))


def _tiny_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


def measure_action_cost(
    *, microbatches: int = 4, rounds: int = 5, warmup: int = 2, device: torch.device | None = None
) -> float:
    """Seconds the pipeline runtime spends per action on this machine (collective; [Note: per-action measurement]).

    Every rank of the default group must call it; one rank (no pipeline) returns 0. A few tens of
    milliseconds on two CPU ranks. The random stream is left as it was.
    """
    import torch.distributed as dist

    from merak_core.parallel.devices import collective_device

    if microbatches < 1 or rounds < 1 or warmup < 0:
        raise ValueError(
            f"measure_action_cost: microbatches={microbatches}, rounds={rounds}, warmup={warmup}; expected "
            "microbatches >= 1, rounds >= 1, warmup >= 0"
        )
    if dist.get_world_size() < 2:
        return 0.0
    dev = device if device is not None else collective_device()
    run_step, actions = action_probe(microbatches, dev)

    def step() -> float:
        dist.barrier()
        start = now(dev)
        run_step()
        elapsed = torch.tensor([now(dev) - start], dtype=torch.float64, device=dev)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank's: the same on every rank
        return float(elapsed)

    for _ in range(warmup):
        step()
    step_s = statistics.median(step() for _ in range(rounds))
    return step_s / actions


def action_probe(microbatches: int, device: torch.device) -> tuple[Any, int]:
    """The probe of [Note: per-action measurement] on this rank (collective: every rank of the default
    group): a function that runs one step of it, and the busiest rank's number of lowered actions.
    For a caller that times the step its own way (``bench_cluster_plan.py steps``: CPU time)."""
    import torch.distributed as dist

    from merak_pipe import PipelineRunner, PipelineStage, build_schedule

    world, rank = dist.get_world_size(), dist.get_rank()
    schedule = build_schedule("1f1b", num_stages=world, num_microbatches=microbatches)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(0)
        layer = nn.Linear(_WIDTH, _WIDTH).to(device)
        x = torch.randn(microbatches, _WIDTH, device=device)
        y = torch.randn(microbatches, _WIDTH, device=device)
    runner = PipelineRunner(
        [PipelineStage(layer, stage_index=rank, num_stages=world, device=device)],
        schedule,
        loss_fn=_tiny_loss,
    )

    def run_step() -> None:
        runner.step(x if runner.holds_first_stage else None, y if runner.holds_last_stage else None)

    return run_step, busiest_actions(runner.schedule)


def runtime_actions_s(per_action_s: float, schedule: Any) -> float:
    """The runtime's own seconds in a step of ``schedule``: ``per_action_s`` x :func:`busiest_actions`.

    The cluster model adds it to a pipelined step (``ClusterSpec.per_action_s``); the inverse of the
    measurement ([Note: per-action measurement]). 0 for one pipeline rank (no pipeline runtime) or
    a zero cost (then the schedule is not lowered).
    """
    if per_action_s == 0.0 or schedule.num_ranks < 2:
        return 0.0
    return per_action_s * busiest_actions(schedule)


# [Note: split backward measurement]
# ZB-H1 and ZB-V run each backward as merak_pipe's ``I`` (input gradients, graph kept) and ``W``
# (weight gradients from the gradients ``I`` kept); the planner prices them as halves of ``B`` times
# ``CommModel.split_backward_scale``. :func:`measure_split_backward_scale` times that factor in one
# process on one block of the job's model (the profile's layers, the first one, on the inputs the
# model gives it for one microbatch), run as a middle ``PipelineStage`` (its input needs a gradient,
# as on every stage but the first): a full ``B`` against ``I`` then ``W`` after a fresh forward each,
# the order alternated, the ratio per round, the median over the rounds. The forward is not timed.
# CPU: process CPU time (a descheduling does not count, intra-op threads do); CUDA: the synchronised
# host clock ([Note: device clocks] in :mod:`.clock`). A model whose first block cannot be run on its
# own (no ``nn.ModuleList`` of layers, no floating input to it) is measured on a small stand-in
# block instead (a layer norm and an MLP at width 64). ``layout: auto`` measures it on rank 0 and
# broadcasts it, so every rank plans with the same number.


class _Captured(Exception):
    """Raised by the capture hook to stop the model's forward once the first block's inputs are known."""


def _first_block_inputs(model: nn.Module, sample: Any) -> tuple[nn.Module, tuple[Any, ...], dict[str, Any]]:
    """The first of the profile's layers and the (args, kwargs) the model calls it with on ``sample``."""
    import inspect

    from merak_core.planner.profile import _find_layers

    block = _find_layers(model)[0]
    seen: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def capture(_m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        seen.append((args, kwargs))
        raise _Captured

    extra = {"use_cache": False} if "use_cache" in inspect.signature(model.forward).parameters else {}
    handle = block.register_forward_pre_hook(capture, with_kwargs=True)
    try:
        with torch.no_grad():
            model(sample, **extra) if isinstance(sample, torch.Tensor) else model(**sample, **extra)
    except _Captured:
        pass
    finally:
        handle.remove()
    if not seen:
        raise ValueError("the model's forward did not call its first layer")
    return block, *seen[0]


def _stand_in_block(
    device: torch.device, dtype: torch.dtype
) -> tuple[nn.Module, tuple[Any, ...], dict[str, Any]]:
    """A small block (layer norm, MLP, width 64) and an input for it: where the model's own cannot be run alone."""
    width = 64
    block = nn.Sequential(
        nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
    )
    x = torch.randn(4, 16, width)
    return block.to(device=device, dtype=dtype), (x.to(device=device, dtype=dtype),), {}


def _with_grad_input(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``args``/``kwargs`` with their first floating tensor a fresh leaf that needs a gradient (the
    hidden state a middle stage receives); ValueError when there is none."""
    args = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
    kwargs = {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            return (*args[:i], a.requires_grad_(True), *args[i + 1 :]), kwargs
    for k, v in kwargs.items():
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            return args, {**kwargs, k: v.requires_grad_(True)}
    raise ValueError("the first layer takes no floating-point tensor")


def measure_split_backward_scale(
    model: nn.Module | None = None, sample: Any = None, *, rounds: int = 6, warmup: int = 1
) -> float:
    """The pipeline runtime's ``(I + W) / B`` on one block of ``model`` ([Note: split backward measurement]).

    ``model`` and ``sample`` (one microbatch, a tensor or keyword dict, on the model's device) as the
    profile takes them; None: the stand-in block. No collective; the random stream and the model's
    gradients are left as they were. Costs one partial forward of the model and ``rounds + warmup + 1``
    times two forwards, one ``B`` and one ``I`` + ``W`` of one block.
    """
    if rounds < 1 or warmup < 0:
        raise ValueError(
            f"measure_split_backward_scale: rounds={rounds}, warmup={warmup}; expected rounds >= 1, warmup >= 0"
        )
    param = next(model.parameters(), None) if model is not None else None
    device = param.device if param is not None else torch.device("cpu")
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(0)
        if model is not None:
            try:
                block, args, kwargs = _first_block_inputs(model, sample)
                return _measure_block(block, args, kwargs, device, rounds, warmup)
            except Exception as exc:  # noqa: BLE001 - measured on the stand-in instead, and said so
                logger.info("split backward measured on a stand-in block: %s: %s", type(exc).__name__, exc)
        dtype = param.dtype if param is not None and param.is_floating_point() else torch.float32
        return _measure_block(*_stand_in_block(device, dtype), device, rounds, warmup)


def _measure_block(
    block: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    device: torch.device,
    rounds: int,
    warmup: int,
) -> float:
    """:func:`_paired_median` of ``block`` as a middle ``PipelineStage``, its gradients left as they were."""
    from merak_pipe import PipelineStage

    _with_grad_input(args, kwargs)  # ValueError before anything runs when no input can need a gradient
    stage = PipelineStage(block, stage_index=1, num_stages=3, device=device)
    grads_before = {p: p.grad for p in block.parameters()}
    try:
        return _paired_median(stage, args, kwargs, rounds, warmup, device)
    finally:
        stage.clear()
        for p, g in grads_before.items():
            p.grad = g


def _paired_median(
    stage: Any, args: tuple[Any, ...], kwargs: dict[str, Any], rounds: int, warmup: int, device: torch.device
) -> float:
    """Median over ``rounds`` (after ``warmup``) of (I + W) / B, the two orders alternated."""
    import time

    from merak_pipe.comm import flatten_boundary

    clock = time.process_time if device.type == "cpu" else (lambda: now(device))

    def fresh() -> tuple[tuple[Any, ...], dict[str, Any]]:
        return _with_grad_input(args, kwargs)

    out, _ = stage.forward(0, *fresh())
    grads = [torch.randn_like(t) for t in flatten_boundary(out)[1] if t.requires_grad]
    stage.backward(0, grads)

    def timed_backward(split: bool) -> float:
        stage.forward(0, *fresh())
        start = clock()
        if split:
            stage.backward_input(0, grads)
            stage.backward_weight(0)
        else:
            stage.backward(0, grads)
        return clock() - start

    ratios = []
    for r in range(warmup + rounds):
        order = (False, True) if r % 2 == 0 else (True, False)
        took = dict(zip(order, (timed_backward(s) for s in order), strict=True))
        if r >= warmup and took[False] > 0:
            ratios.append(took[True] / took[False])
    if not ratios:
        raise ValueError("measure_split_backward_scale: the full backward took no measurable time")
    return statistics.median(ratios)


def check_split_backward_scale(where: str, value: Any) -> float:
    """``value`` as a given ``split_backward_scale``, or ValueError naming ``where``, the value and the fix."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0 < value < math.inf):
        raise ValueError(
            f"{where}: split_backward_scale={value!r}; expected the runtime's (I + W) / B, a finite number > 0 "
            "(1: the split costs one full backward; about 1.35-1.55 measured on CPU), or None to measure it"
        )
    return float(value)
