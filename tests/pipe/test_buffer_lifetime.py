"""Boundary buffers live as long as the schedule needs them, not for the whole round.

The runtime holds three kinds of boundary tensors: sent tensors (until the send's Work completes),
received activations (until the stage is done with that microbatch: after ``B``, or after ``W``
under a split backward) and received gradients (until the backward that consumes them is done).
Its receive pool keeps no more buffers than the round had in use at once.

How it is measured, from the outside: the transport's batch call is wrapped; every floating-point
tensor that goes through it (sent tensors, receive buffers, pooled ones when they come back) is
tracked by a weak reference, and after each batch the distinct storages still alive are counted.
A tensor that anything still references (the runtime's bookkeeping, a stage's autograd graph, a
pending Work, the pool) counts; what was let go does not. The count only rises when a batch
registers new tensors, so sampling after each batch finds the peak.

What the peak must be: per rank, sent and received tensors each at most the schedule's simulated
in-flight count (how many (stage, microbatch) pairs the rank holds between F and B or W, from
:func:`merak_pipe.sim.simulate` with one unit of activation per microbatch and W keeping the whole
graph) plus one, and the same at M=4 and at M=16 (except GPipe, whose in-flight count is M). On the
tagged transport (gloo without NCCL's rules) receives are posted ``EARLY_RECEIVE_UNITS`` units early
([Note: early receives] in ``p2p_order.py``): each stream of received messages (a receiving stage
and a direction) may hold that many more received buffers, still independent of M. Before
this change every sent tensor and every received buffer of a round lived until its end: 1F1B at
S=2 held 3M boundary tensors on its first rank (12 at M=4, 48 at M=16), now 3 at both.
"""

from __future__ import annotations

import weakref
from typing import Any

import pytest
import torch
import torch.distributed as dist

from merak_pipe.p2p_order import DATA_B, DATA_F
from merak_pipe.runner import EARLY_RECEIVE_UNITS
from merak_pipe.sim import CostModel, simulate
from tests.pipe import _runtime_bodies as bodies
from tests.pipe.test_runtime import assert_matches, make_case
from tests.support.dist import run_on_ranks

SCHEDULES = ["gpipe", "1f1b", "interleaved-1f1b", "shifted-critical-path", "zb-h1", "zb-v"]
TRANSPORT = pytest.mark.parametrize("nccl_rules", [False, True], ids=["tags", "nccl-rules"])
SMALL_M, LARGE_M = 4, 16


class _LiveMeter:
    """Wraps ``batch_isend_irecv``: tracks the floating-point tensors of every op, counts the live ones."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.refs: dict[str, list[weakref.ref[torch.Tensor]]] = {"sent": [], "received": []}
        self.peak = {"all": 0, "sent": 0, "received": 0}

    def __call__(self, ops: list[Any]) -> Any:
        for op in ops:
            if op.tensor.is_floating_point():
                kind = "received" if op.op is dist.irecv else "sent"
                self.refs[kind].append(weakref.ref(op.tensor))
        works = self.inner(ops)
        storages = {}
        for kind, refs in self.refs.items():
            alive = [t for r in refs if (t := r()) is not None]
            self.refs[kind] = [weakref.ref(t) for t in alive]
            storages[kind] = {t.untyped_storage().data_ptr() for t in alive}
            self.peak[kind] = max(self.peak[kind], len(storages[kind]))
        self.peak["all"] = max(self.peak["all"], len(storages["sent"] | storages["received"]))
        return works


def early_slack(runner: Any) -> int:
    """Received buffers that early receives may add on this rank: ``EARLY_RECEIVE_UNITS`` per stream
    of received data messages (receiving stage and direction) of its training round; 0 under NCCL's rules."""
    if runner.transport.nccl_rules:
        return 0
    streams = {
        (op.stage, op.kind)
        for step in runner._plans[True]
        if isinstance(step, tuple)
        for op in step
        if not op.send and op.kind in (DATA_F, DATA_B)
    }
    return EARLY_RECEIVE_UNITS * len(streams)


def live_body(case: dict[str, Any]) -> dict[str, Any]:
    """Two steps with the meter on; per rank: peak live tensors, pool statistics, loss and grads."""
    world = dist.get_world_size()
    schedule = bodies.make_schedule(case, world)
    model, runner = bodies.build_runner(case, schedule)
    meter = _LiveMeter(runner.transport.batch_isend_irecv)
    runner.transport.batch_isend_irecv = meter
    results = []
    for step, seq in enumerate(case["seqs"]):
        model.zero_grad(set_to_none=True)
        ids, labels = bodies.batch_for(case, step, seq)
        loss = runner.step(
            ids if runner.holds_first_stage else None, labels if runner.holds_last_stage else None
        )
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results.append({"loss": loss, "grads": grads})
    return {
        "peak": meter.peak,
        "steps": results,
        "allocated": runner.transport.buffers_allocated,
        "pooled": runner.transport.pooled_buffers,
        "early": early_slack(runner),
    }


def simulated_in_flight(case: dict[str, Any], world: int) -> list[int]:
    """Per rank: the most (stage, microbatch) pairs between their F and their B (or W) at once, from the
    simulator's activation memory with one unit per microbatch (recomputation set aside)."""
    schedule = bodies.strip_recompute_actions(bodies.make_schedule(case, world))
    result = simulate(schedule, CostModel(activation_bytes=1.0, weight_grad_fraction=1.0))
    return [round(peak) for peak in result.peak_memory_per_rank]


def _case(schedule: str, world: int, m: int, nccl_rules: bool) -> dict[str, Any]:
    # One sequence length: a second one would keep the first one's pooled buffers alive beside it.
    case = make_case(
        schedule, world, "gpt", None, seqs=(8, 8), num_microbatches=m, batch=m, nccl_rules=nccl_rules
    )
    if schedule == "zb-v":
        case["num_stages"] = 2 * world
    return case


@TRANSPORT
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_live_boundary_tensors_follow_the_schedule(schedule: str, nccl_rules: bool) -> None:
    world = 2
    peaks = {}
    for m in (SMALL_M, LARGE_M):
        case = _case(schedule, world, m, nccl_rules)
        results = run_on_ranks(world, live_body, case)
        assert_matches([r["steps"] for r in results], bodies.reference(case))
        in_flight = simulated_in_flight(case, world)
        peaks[m] = ([r["peak"]["all"] for r in results], in_flight)
        for rank, r in enumerate(results):
            # Each microbatch in flight holds at most one received message (its input, or the gradient
            # its backward consumes) and one sent (its output until the peer took it); +1: the message
            # of the unit being issued (a gradient around a backward).
            for kind in ("sent", "received"):
                bound = in_flight[rank] + 1 + (r["early"] if kind == "received" else 0)
                assert r["peak"][kind] <= bound, (
                    f"M={m} rank {rank}: {r['peak'][kind]} {kind} boundary tensors alive at once; the "
                    f"schedule holds {in_flight[rank]} microbatches in flight (early receives: {r['early']})"
                )
            # The pool never holds more than the round had in use at once.
            assert r["pooled"] <= r["allocated"] <= in_flight[rank] + 1 + r["early"], (
                rank,
                r["pooled"],
                r["allocated"],
            )
    if schedule != "gpipe":  # GPipe holds every microbatch by design: its in-flight count is M
        assert peaks[LARGE_M] == peaks[SMALL_M], f"live boundary tensors grow with M: {peaks}"


@TRANSPORT
def test_one_f_one_b_holds_at_most_s_in_flight(nccl_rules: bool) -> None:
    """1F1B over S=4 ranks at M=16: no rank holds more than S sent or S received tensors at once (plus,
    on the tagged transport, the receives posted early)."""
    world = 4
    case = _case("1f1b", world, LARGE_M, nccl_rules)
    results = run_on_ranks(world, live_body, case)
    assert_matches([r["steps"] for r in results], bodies.reference(case))
    assert simulated_in_flight(case, world) == [world - r for r in range(world)]
    for rank, r in enumerate(results):
        assert r["peak"]["sent"] <= world and r["peak"]["received"] <= world + r["early"], (rank, r["peak"])
