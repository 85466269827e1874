"""The runner's per-action profile (``runner.profiling()``, merak_pipe.action_profile).

On 2 ranks in the worker pool: a step inside ``profiling()`` gives exactly the loss and gradients
of the same step without it (bit for bit), its spans cover every action of each rank's lowered
schedule (one span per action, counts per kind equal), and the trace it writes has the simulator
trace's layout (one thread per rank, compute actions named and categorised alike).
"""

from __future__ import annotations

import json
import os
import tempfile
from collections import Counter
from typing import Any

import pytest
import torch
import torch.distributed as dist

from merak_pipe.action_profile import gather_spans
from merak_pipe.sim import simulate
from merak_pipe.trace import chrome_trace
from tests.pipe import _runtime_bodies as bodies
from tests.pipe.test_runtime import make_case
from tests.support.dist import run_on_ranks

_RUNNER_WORK = {"release", "control", "end sends", "shared grads"}


def _one_step(runner: Any, model: torch.nn.Module, case: dict[str, Any]) -> dict[str, Any]:
    model.zero_grad(set_to_none=True)
    ids, labels = bodies.batch_for(case, 0, case["seqs"][0])
    loss = runner.step(ids if runner.holds_first_stage else None, labels if runner.holds_last_stage else None)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return {"loss": loss, "grads": grads}


def profile_body(case: dict[str, Any], torch_ops: bool, trace_dir: str) -> dict[str, Any]:
    """Off, on, off again: per rank the three steps' results, the spans' kinds, the schedule's kinds."""
    schedule = bodies.make_schedule(case, dist.get_world_size())
    model, runner = bodies.build_runner(case, schedule)
    before = _one_step(runner, model, case)
    with runner.profiling(torch_ops=torch_ops) as profile:
        during = _one_step(runner, model, case)
    after = _one_step(runner, model, case)
    spans = gather_spans(profile.spans)
    path = os.path.join(trace_dir, "profile.json")
    if dist.get_rank() == 0:
        profile.chrome_trace(path, spans)
    return {
        "results": [before, during, after],
        "span_kinds": Counter(s.kind for s in profile.spans if s.kind),
        "runner_work": {s.name for s in profile.spans if not s.kind},
        "schedule_kinds": Counter(a.kind.value for a in runner.actions),
        "summary": profile.summary(),
        "wait_restored": "wait" not in vars(runner.transport),
        "spans": len(spans),
    }


@pytest.mark.parametrize(
    ("schedule", "torch_ops"), [("1f1b", True), ("zb-v", False), ("interleaved-1f1b", False)]
)
def test_profile_covers_every_action_and_changes_no_loss(schedule: str, torch_ops: bool) -> None:
    case = make_case(schedule, 2, "gpt", None, seqs=(8,), num_microbatches=4, batch=4)
    if schedule == "zb-v":
        case["num_stages"] = 4
    with tempfile.TemporaryDirectory() as trace_dir:
        per_rank = run_on_ranks(2, profile_body, case, torch_ops, trace_dir)
        with open(os.path.join(trace_dir, "profile.json"), encoding="utf-8") as f:
            trace = json.load(f)
    for rank, out in enumerate(per_rank):
        before, during, after = out["results"]
        for other in (during, after):
            if before["loss"] is not None:
                assert torch.equal(other["loss"], before["loss"]), rank
            assert before["grads"].keys() == other["grads"].keys()
            for name, grad in before["grads"].items():
                assert torch.equal(other["grads"][name], grad), (rank, name)
        assert out["span_kinds"] == out["schedule_kinds"], rank
        assert out["runner_work"] <= _RUNNER_WORK and {"release", "end sends"} <= out["runner_work"]
        assert out["wait_restored"]
        summary = out["summary"]
        compute = summary["forward"]
        assert compute["host_s"] > 0 and compute["python_s"] >= 0
        assert (compute["torch_s"] > 0) == torch_ops, summary
        total_waits = sum(row["wait_s"] for row in summary.values())
        assert total_waits > 0, summary
    # The trace has one slice per span and the simulator trace's layout and names.
    slices = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(slices) == per_rank[0]["spans"]
    threads = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert threads == {0: "rank 0", 1: "rank 1"}
    sim = chrome_trace(simulate(bodies.make_schedule(case, 2)))
    sim_compute = Counter((e["tid"], e["name"], e["cat"]) for e in sim["traceEvents"] if e["ph"] == "X")  # type: ignore[attr-defined,index]
    ours_compute = Counter(
        (e["tid"], e["name"], e["cat"]) for e in slices if (e["tid"], e["name"], e["cat"]) in sim_compute
    )
    assert ours_compute == sim_compute
