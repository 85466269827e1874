"""Run a (lowered) schedule on this rank's pipeline stages over torch.distributed p2p.

:class:`PipelineRunner` walks this rank's action list of a :class:`~merak_pipe.ir.Schedule`:
compute actions go to the :class:`~merak_pipe.stage.PipelineStage` they name, ``SEND_*`` /
``RECV_*`` actions to the non-blocking transport (``merak_pipe.comm``) in the units and the
order of :func:`merak_pipe.p2p_order.issue_orders` ([Note: issue order]): consecutive
send/recv actions are one ``batch_isend_irecv``, nothing is posted ahead of its place, and
both sides of every pair of ranks issue its messages in the same order, so the runner obeys
NCCL's rules on every backend (checked by :func:`merak_pipe.nccl_check.check_nccl` when the
runner is built). Only the compute that consumes a value waits for it. Two consecutive stages
on one rank (interleaved and V schedules) hand values over locally, without communication.

One ``step``: the batch is split into ``schedule.num_microbatches`` equal microbatches along
dim 0, every action runs, parameter gradients accumulate into ``param.grad`` scaled so they
equal the gradient of the full-batch mean loss (or sum), the gradients of shared parameters
are all-reduced over their groups, and the full-batch loss comes back on the rank holding the
last stage. The runner never zeroes gradients and never calls an optimizer.

Bad input (a batch not divisible into microbatches, missing inputs/labels, a schedule whose
stage count or rank count does not match the stages and the group) raises before any
communication. A failed or timed-out wait raises
:class:`~merak_pipe.comm.PipelineCommError` naming rank, stage, action and microbatch; after
such an error the process group may hold unmatched messages and should be recreated.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from merak_pipe._exit import destroy_default_group_at_exit
from merak_pipe._placement import _common_device, _local_runs
from merak_pipe._round import _as_call, _concat, _Round, _split_batch
from merak_pipe.action_profile import ActionProfile, profiling
from merak_pipe.comm import (
    P2PTransport,
    PipelineCommError,
    describe_spec,
    flatten_boundary,
    unflatten_boundary,
)
from merak_pipe.exchange import BoundaryExchange
from merak_pipe.ir import Action, ActionKind, Schedule
from merak_pipe.p2p_order import EARLY_RECEIVE_UNITS, Step, describe_step, runner_orders, settled_sends
from merak_pipe.stage import PipelineStage
from merak_pipe.timing import ActionTiming, RoundClock, resolve_marks

__all__ = ["PipelineRunner"]

logger = logging.getLogger(__name__)


class PipelineRunner:
    """Execute ``schedule`` for this rank's ``stages``.

    Args:
        stages: the :class:`PipelineStage` objects held by this rank (any order).
        schedule: a compute-only or lowered schedule; compute-only ones are lowered here.
        loss_fn: ``loss_fn(output, labels) -> scalar tensor``, the mean (or sum) over a microbatch.
        group: the pipeline process group (``None``: the default group); may be a subgroup.
        loss_reduction: ``"mean"``: gradients and returned loss are those of the full-batch mean
            of the per-microbatch losses; ``"sum"``: of their sum.
        shared_parameters: ``[(param, group), ...]``: after each step, ``param.grad`` is summed
            over ``group`` (copies of one logical parameter on several ranks, e.g. tied
            embeddings; see :func:`merak_pipe.shared.shared_parameter_groups`).
        timeout: the longest any single wait may take (on CPU; on CUDA waits are stream waits
            and the process group's timeout guards instead).
        record_timing: record per-action timings of each step in :attr:`timings` (on CUDA from
            CUDA events, read after the step's end is synchronised).
        device: the device of this rank's stages and of every message (default: the stages'
            device; they must all agree).
        nccl_rules: run the transport as on NCCL on any backend: every p2p op on tag 0 and one
            Work per batch (always on for a CUDA device; used by the CPU tests to emulate NCCL).
        early_receives: on a transport that matches messages by tag (not under ``nccl_rules``), post
            each data receive this many units before its place ([Note: early receives] in
            ``p2p_order.py``); 0 posts it where lowering put it. Each unit adds at most one posted
            receive buffer per stream of received messages.
    """

    def __init__(
        self,
        stages: Sequence[PipelineStage],
        schedule: Schedule,
        *,
        loss_fn: Callable[[Any, Any], torch.Tensor],
        group: dist.ProcessGroup | None = None,
        loss_reduction: str = "mean",
        shared_parameters: Sequence[tuple[nn.Parameter, dist.ProcessGroup | None]] | None = None,
        timeout: timedelta = timedelta(minutes=5),
        record_timing: bool = False,
        device: torch.device | str | None = None,
        nccl_rules: bool = False,
        early_receives: int = EARLY_RECEIVE_UNITS,
    ) -> None:
        if loss_reduction not in ("mean", "sum"):
            raise ValueError(f"loss_reduction={loss_reduction!r}; expected 'mean' or 'sum'")
        if not stages:
            raise ValueError("PipelineRunner needs at least one PipelineStage on this rank")
        if not isinstance(timeout, timedelta):
            raise TypeError(f"timeout must be a datetime.timedelta, got {type(timeout).__name__}")
        if isinstance(early_receives, bool) or not isinstance(early_receives, int) or early_receives < 0:
            raise ValueError(f"early_receives={early_receives!r}; expected a whole number of units >= 0")
        stage_groups = {id(s.group): s.group for s in stages if s.group is not None}
        if len(stage_groups) > 1 or (group is not None and stage_groups and id(group) not in stage_groups):
            raise ValueError(
                "the PipelineStages and the PipelineRunner were given different process groups; pass the "
                "same pipeline group to every PipelineStage and to the runner"
            )
        if group is None and stage_groups:
            group = next(iter(stage_groups.values()))
        world = dist.group.WORLD
        if group is None and world is None:
            raise RuntimeError(
                "torch.distributed is not initialised: call init_process_group before PipelineRunner"
            )
        self.group: dist.ProcessGroup = group if group is not None else world  # type: ignore[assignment]
        self.rank = dist.get_rank(self.group)
        group_size = dist.get_world_size(self.group)
        destroy_default_group_at_exit()  # see [Note: groups at exit]
        if self.rank < 0:
            raise ValueError("this process is not a member of the pipeline group passed to PipelineRunner")
        if schedule.num_ranks != group_size:
            raise ValueError(
                f"schedule {schedule.name!r} runs on {schedule.num_ranks} pipeline ranks but the pipeline "
                f"group has {group_size}; build the schedule with num_ranks={group_size} or pass the right group"
            )
        for stage in stages:
            if stage.num_stages != schedule.num_stages:
                raise ValueError(
                    f"stage {stage.stage_index} was built with num_stages={stage.num_stages} but schedule "
                    f"{schedule.name!r} has {schedule.num_stages} stages; use the same stage count"
                )
        mine = tuple(sorted(s.stage_index for s in stages))
        expected = schedule.stages_of(self.rank)
        if mine != expected:
            raise ValueError(
                f"pipeline rank {self.rank} holds stages {list(mine)} but schedule {schedule.name!r} "
                f"(stage_to_rank={list(schedule.stage_to_rank)}) puts stages {list(expected)} on it; "
                "build one PipelineStage per stage of this rank"
            )
        if not schedule.lowered:
            from merak_pipe.lowering import lower

            schedule = lower(schedule)
        self.schedule = schedule
        self.stages: dict[int, PipelineStage] = {s.stage_index: s for s in stages}
        self.loss_fn = loss_fn
        self.loss_reduction = loss_reduction
        self.shared_parameters = list(shared_parameters or [])
        self.timeout = timeout
        self.record_timing = record_timing
        self.timings: list[ActionTiming] = []
        self.num_microbatches = schedule.num_microbatches
        self.actions: list[Action] = list(schedule.actions[self.rank])
        self._recompute = schedule.recompute
        self.device = _common_device(stages, device)
        self.transport = P2PTransport(
            group=self.group,
            num_stages=schedule.num_stages,
            num_microbatches=self.num_microbatches,
            timeout=timeout,
            device=self.device,
            nccl_rules=nccl_rules,
        )
        self.exchange = BoundaryExchange(self.transport)
        from merak_pipe.nccl_check import check_nccl

        check_nccl(schedule)
        lookahead = 0 if self.transport.nccl_rules else early_receives
        orders = {training: runner_orders(schedule, not training, lookahead) for training in (True, False)}
        self._plans: dict[bool, list[Step]] = {training: orders[training][self.rank] for training in orders}
        self.exchange.prepare(self._plans.values())
        # Where host waits are the only way to learn that a send completed (gloo), sends are waited
        # once a message from the peer proves them matched; on CUDA their Work reports it.
        self._settles = {
            training: settled_sends(orders[training], self.rank) if self.transport.host_waits else {}
            for training in orders
        }
        self._local_runs = _local_runs(schedule)
        self._clock = RoundClock(self.device)
        self._step_marks: tuple[Any, Any] | None = None
        self._round = _Round(index=0, training=True)
        self._profile: ActionProfile | None = None

    # ------------------------------------------------------------------ public API

    @property
    def holds_first_stage(self) -> bool:
        """True when this rank holds stage 0 (it needs the inputs)."""
        return 0 in self.stages

    @property
    def holds_last_stage(self) -> bool:
        """True when this rank holds the last stage (it needs the labels and returns the loss)."""
        return self.schedule.num_stages - 1 in self.stages

    @property
    def last_step_s(self) -> float:
        """Seconds of the last ``step``/``evaluate`` call, from the start of its first action to the
        end of its last one (a step: of the shared-parameter all-reduce); on CUDA between CUDA
        events, waiting for the device when read; 0.0 before the first call."""
        if self._step_marks is None:
            return 0.0
        start, end = self._step_marks
        return self._clock.seconds(end) - self._clock.seconds(start)

    def profiling(self, *, torch_ops: bool = True) -> AbstractContextManager[ActionProfile]:
        """Profile every ``step``/``evaluate`` inside the ``with`` block: per action of this rank's
        issue order, host time, time blocked in waits and (``torch_ops``) time inside torch
        operators (:mod:`merak_pipe.action_profile`; off, it costs one check per round)."""
        return profiling(self, torch_ops=torch_ops)

    def describe_position(self) -> str:
        """Stage, action and microbatch this rank runs now (safe to call from another thread)."""
        return describe_step(self.exchange.position)

    def step(self, inputs: Any = None, labels: Any = None) -> torch.Tensor | None:
        """One training step: forward and backward of every microbatch; returns the loss on the last stage."""
        self._run_round(inputs, labels, training=True)
        if self._profile is None:
            self._sync_shared_parameters()
        else:
            self._profile.timed("shared grads", self._sync_shared_parameters, self._round.index)
        if self._step_marks is not None:
            self._step_marks = (self._step_marks[0], self._clock.mark())
        return self._round.loss(self.num_microbatches, self.loss_reduction) if self.holds_last_stage else None

    def evaluate(self, inputs: Any = None, labels: Any = None, *, return_outputs: bool = False) -> Any:
        """Forward only, without autograd. On the last stage returns the loss (None without labels),
        or ``(loss, outputs)`` with ``return_outputs`` (outputs concatenated over microbatches)."""
        self._run_round(inputs, labels, training=False)
        loss = self._round.loss(self.num_microbatches, self.loss_reduction) if self.holds_last_stage else None
        if not self.holds_last_stage:
            return None
        if return_outputs:
            outputs = [self._round.outputs[m] for m in range(self.num_microbatches)]
            return loss, _concat(outputs)
        return loss

    # ------------------------------------------------------------------ round driver

    def _reset_round(self, *, training: bool) -> None:
        self._round = _Round(index=self._round.index + 1, training=training)
        self.exchange.reset_round(self._settles[training])

    def _check_inputs(self, inputs: Any, labels: Any) -> None:
        m = self.num_microbatches
        if self.holds_first_stage:
            if inputs is None:
                raise ValueError(f"pipeline rank {self.rank} holds stage 0: pass the batch as inputs=")
            self._round.inputs = _split_batch(inputs, m, "inputs")
        if self.holds_last_stage and labels is not None:
            self._round.labels = _split_batch(labels, m, "labels")

    def _run_round(self, inputs: Any, labels: Any, *, training: bool) -> None:
        self._reset_round(training=training)
        self._check_inputs(inputs, labels)
        if training and self.holds_last_stage and labels is None:
            raise ValueError(
                f"pipeline rank {self.rank} holds the last stage ({self.schedule.num_stages - 1}): "
                "pass labels= to step()"
            )
        self._clock.start_round(anchor=self.record_timing)
        start = self._clock.mark()
        try:
            if self._profile is None:
                self._run_plan(self._plans[training])
            else:
                self._profile.run_round(self, self._plans[training], self._round.index)
            self._check_round_complete()
        except BaseException:
            for stage in self.stages.values():
                stage.clear()
            self.transport.drop_sends()
            self.transport.clear_pool()
            raise
        finally:
            for buffers in self._round.held.values():
                (self.transport.release if training else self.transport.discard)(buffers)
            self._round.held.clear()
        self._step_marks = (start, self._clock.mark())
        if self.record_timing:
            self.timings = resolve_marks(self._round.marks, self._clock.seconds, self.rank, self._round.index)

    def _run_plan(self, plan: list[Step]) -> None:
        for step in plan:
            if isinstance(step, Action):
                self._run_compute(step)
                self._let_go(step)
            elif self.record_timing:
                start_unit = self._clock.mark()
                issued = self.exchange.run_unit(step)
                end_unit = self._clock.mark()
                self._round.marks += [(a, start_unit, start_unit, end_unit, 0.0) for a in issued]
            else:
                self.exchange.run_unit(step)
        self.transport.wait_sends()

    def _check_round_complete(self) -> None:
        leftovers = self.exchange.leftovers()
        if self._round.training:
            for index, stage in self.stages.items():
                if stage.pending_microbatches():
                    leftovers.append(
                        f"stage {index} microbatches without a backward: {stage.pending_microbatches()}"
                    )
        if leftovers:
            raise RuntimeError(
                f"schedule {self.schedule.name!r} left work undone on pipeline rank {self.rank}: "
                + "; ".join(leftovers)
            )

    # ------------------------------------------------------------------ compute actions

    def _stage(self, action: Action) -> PipelineStage:
        stage = self.stages.get(action.stage)
        if stage is None:
            raise RuntimeError(
                f"pipeline rank {self.rank}: action {action} names stage {action.stage}, "
                f"which this rank does not hold (it holds {sorted(self.stages)})"
            )
        return stage

    def _fraction(self, s: int) -> float:
        return 0.0 if self._recompute is None else float(self._recompute[s])

    def _forward_input(self, s: int, m: int) -> Any:
        if s == 0:
            return self._round.inputs[m]
        if self.schedule.rank_of(s - 1) == self.rank:
            value = self._round.fwd_local.pop((s, m), None)
            if value is None:
                raise RuntimeError(
                    f"pipeline rank {self.rank}: {s}F{m} runs before {s - 1}F{m} on the same rank"
                )
            return value
        spec, tensors = self.exchange.take_forward_input(s, m, Action(s, ActionKind.FORWARD, m))
        leaves = []
        for t, meta in zip(tensors, self.exchange.metas(s, spec), strict=True):
            leaves.append(t.requires_grad_(meta.requires_grad and self._round.training))
        self._round.held.setdefault((s, m), []).extend(tensors)
        return unflatten_boundary(spec, leaves)

    def _output_grads(self, s: int, m: int, action: Action) -> list[torch.Tensor] | None:
        if s == self.schedule.num_stages - 1:
            return None
        if self.schedule.rank_of(s + 1) == self.rank:
            grads = self._round.bwd_local.pop((s, m), None)
            if grads is None:
                raise RuntimeError(
                    f"pipeline rank {self.rank}: backward of {s} mb {m} runs before that of {s + 1}"
                )
            return grads
        grads = self.exchange.take_output_grads(s, m, action)
        self._round.held.setdefault((s, m), []).extend(grads)
        return grads

    def _run_compute(self, action: Action) -> None:
        self.exchange.position = action  # read by watchdogs: describe_position()
        stage = self._stage(action)
        s, m, kind = action.stage, action.microbatch, action.kind
        recompute_before = stage.recompute_seconds
        clock = self._clock if self.record_timing else None
        start = ready = clock.mark() if clock else None
        try:
            if kind is ActionKind.FORWARD:
                value = self._forward_input(s, m)
                ready = clock.mark() if clock else None
                self._forward(stage, s, m, value)
            elif kind in (ActionKind.FULL_BACKWARD, ActionKind.BACKWARD_INPUT):
                grads = self._output_grads(s, m, action)
                ready = clock.mark() if clock else None
                if kind is ActionKind.FULL_BACKWARD:
                    input_grads = stage.backward(m, grads)
                else:
                    input_grads = stage.backward_input(m, grads)
                self._hand_back(s, m, input_grads)
            elif kind is ActionKind.BACKWARD_WEIGHT:
                stage.backward_weight(m)
            elif kind is ActionKind.RECOMPUTE:
                stage.recompute(m)
            else:  # pragma: no cover
                raise AssertionError(action)
        except PipelineCommError:
            raise
        except (RuntimeError, ValueError, TypeError) as exc:
            if type(exc) not in (RuntimeError, ValueError, TypeError):
                raise
            raise type(exc)(
                f"pipeline rank {self.rank}, stage {s}, action {action} (microbatch {m}): {exc}"
            ) from exc
        if clock is not None:
            implicit = stage.recompute_seconds - recompute_before if kind is not ActionKind.RECOMPUTE else 0.0
            self._round.marks.append((action, start, ready, clock.mark(), implicit))

    def _let_go(self, action: Action) -> None:
        """After a compute action: drop completed sends, and hand back the buffers received for its
        microbatch once no stage of its local run holds that microbatch ([Note: buffer lifetime]:
        stages of one rank next to each other hand values over as they are, so a value received by
        one may live on in its neighbour)."""
        self.exchange.settle_proven()
        self.transport.reap_sends()
        m, run = action.microbatch, self._local_runs[action.stage]
        keys = [(s, m) for s in run if (s, m) in self._round.held]
        if not keys:
            return
        if self._round.training and any(self.stages[s].holds(m) for s in run):
            return
        let_go = self.transport.release if self._round.training else self.transport.discard
        for key in keys:
            let_go(self._round.held.pop(key))

    def _forward(self, stage: PipelineStage, s: int, m: int, value: Any) -> None:
        args, kwargs = _as_call(value)
        is_last = s == self.schedule.num_stages - 1
        labels = self._round.labels[m] if (is_last and self._round.labels) else None
        scale = 1.0 / self.num_microbatches if self.loss_reduction == "mean" else 1.0
        out, loss = stage.forward(
            m,
            args,
            kwargs,
            recompute_fraction=self._fraction(s),
            loss_fn=self.loss_fn if labels is not None else None,
            labels=labels,
            loss_scale=scale,
            training=self._round.training,
        )
        if is_last:
            if loss is not None:
                self._round.losses[m] = loss
            if not self._round.training:
                self._round.outputs[m] = out
            return
        spec, tensors = flatten_boundary(out)
        if self.schedule.rank_of(s + 1) == self.rank:
            handed = [t.detach().requires_grad_(t.requires_grad and self._round.training) for t in tensors]
            self._round.fwd_local[(s + 1, m)] = unflatten_boundary(spec, handed)
            return
        known = self.exchange.out_spec.setdefault(s, spec)
        if known != spec:
            raise ValueError(
                f"pipeline rank {self.rank}, stage {s}: microbatch {m} produced outputs {describe_spec(spec)} but "
                f"earlier microbatches of this step produced {describe_spec(known)}; all microbatches of a step "
                "must have the same boundary shapes"
            )
        self.exchange.put_forward_output(s, m, tensors)

    def _hand_back(self, s: int, m: int, input_grads: list[torch.Tensor]) -> None:
        if s == 0:
            return
        if self.schedule.rank_of(s - 1) == self.rank:
            self._round.bwd_local[(s - 1, m)] = input_grads
        else:
            self.exchange.put_input_grads(s, m, input_grads)

    # ------------------------------------------------------------------ shared parameters, timing

    def _sync_shared_parameters(self) -> None:
        for param, group in self.shared_parameters:
            if group is None:
                continue
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            work = dist.all_reduce(param.grad, op=dist.ReduceOp.SUM, group=group, async_op=True)
            what = (
                f"pipeline rank {self.rank} (global rank {dist.get_rank()}): all-reduce of a shared "
                f"parameter's gradient {tuple(param.shape)} over global ranks "
                f"{dist.get_process_group_ranks(group)}"
            )
            self.transport.wait([work], what)
