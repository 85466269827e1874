"""Failure behaviour of the runtime: bad input raises before communicating; a stalled or dead
peer makes the others fail with an error naming rank, stage, action and microbatch, within the
timeout, instead of hanging. Also: per-action timing feeds the simulator and the Chrome trace."""

from __future__ import annotations

import re

import pytest

from merak_pipe.sim import CostModel, simulate
from tests.pipe import _runtime_bodies as bodies
from tests.pipe.test_runtime import TRANSPORT, make_case
from tests.support.dist import WorkerError, run_on_ranks

ERROR_RE = re.compile(
    r"pipeline rank (\d+) \(global rank \d+\), stage (\d+), action (\d+)(\w+?)(\d+) \(microbatch (\d+)\)"
)


def test_bad_input_raises_before_communication() -> None:
    case = make_case("1f1b", 2, "gpt", None, seqs=(8,))
    errors = run_on_ranks(2, bodies.bad_input_body, case)
    first, last = errors
    assert "not divisible into 4 microbatches" in first["not_divisible"]
    assert "not divisible into 4 microbatches" in last["not_divisible"]
    assert "fewer than the schedule's 4 microbatches" in first["too_few_samples"]
    assert "holds stage 0: pass the batch as inputs=" in first["missing_inputs"]
    assert "pass labels=" in last["missing_labels"]
    for rank_errors in errors:
        assert "num_stages=3" in rank_errors["stage_count"]
        assert "runs on 4 pipeline ranks but the pipeline group has 2" in rank_errors["group_size"]
    ref_loss = float(bodies.reference(case)[0]["loss"])
    assert first["good_loss"] == "None"
    assert abs(float(last["good_loss"]) - ref_loss) < 1e-10


@TRANSPORT
@pytest.mark.parametrize("victim", [0, 1])
def test_stalled_peer_raises_naming_error_within_timeout(victim: int, nccl_rules: bool) -> None:
    timeout_s = 1.5
    case = make_case("1f1b", 2, "llama", None, seqs=(8,), nccl_rules=nccl_rules)
    messages = run_on_ranks(2, bodies.failure_body, case, "stall", victim, timeout_s)
    survivor = 1 - victim
    message = messages[survivor]
    assert message is not None and message.startswith("PipelineTimeoutError"), message
    elapsed = float(message.split(" after ")[1].split("s:")[0])
    # Not a speed assertion: the step ends at the first failed wait instead of hanging (the pool
    # would wait 180 s); the bound is loose because the machine may be loaded.
    assert timeout_s <= elapsed < timeout_s + 10.0, message
    match = ERROR_RE.search(message)
    assert match, message
    rank, stage, _, kind, _, microbatch = match.groups()
    assert int(rank) == survivor and int(stage) == survivor
    # Rank 1 waits for the first activation; rank 0 for the first gradient (its sends are buffered).
    assert kind in (("RECV_B", "B") if survivor == 0 else ("RECV_F", "F")), message
    assert microbatch == "0"
    assert "did not complete within the timeout of 1.5 s" in message


@TRANSPORT
def test_dead_peer_raises_naming_error(nccl_rules: bool) -> None:
    case = make_case("1f1b", 2, "llama", None, seqs=(8,), nccl_rules=nccl_rules)
    with pytest.raises(WorkerError) as info:
        run_on_ranks(2, bodies.failure_body, case, "die", 1, 3.0)
    text = str(info.value)
    assert "rank 1 died" in text
    assert re.search(r"PipelineCommError|PipelineTimeoutError", text), text
    assert ERROR_RE.search(text), text
    assert "pipeline rank 0 (global rank 0), stage 0" in text


@TRANSPORT
@pytest.mark.parametrize("schedule", ["1f1b", "shifted-critical-path", "zb-h1"])
def test_timing_feeds_simulator_and_trace(schedule: str, nccl_rules: bool) -> None:
    case = make_case(schedule, 2, "gpt", "full", seqs=(8,), nccl_rules=nccl_rules)
    results = run_on_ranks(2, bodies.timing_body, case, 2)
    for res in results:
        # Every action of the rank once; compute actions in schedule order (receives may be posted early).
        assert sorted(res["recorded"]) == sorted(res["own"])
        compute = [a for a in res["own"] if "SEND" not in a and "RECV" not in a]
        assert [a for a in res["recorded"] if "SEND" not in a and "RECV" not in a] == compute
        assert res["ordered"]
        assert res["last_step_s"] >= res["own_span_s"] > 0  # the whole step spans this rank's actions
        assert res["events"] > len(res["own"])
    costs = results[0]["costs"]
    assert isinstance(costs, CostModel)
    assert all(f > 0 for f in costs.forward) and all(b > 0 for b in costs.backward)  # type: ignore[union-attr]
    # Recomputation was measured: inside B/I for 1f1b and zb-h1, as explicit R for shifted-critical-path.
    assert results[0]["recompute_s"] > 0
    built = bodies.make_schedule(case, 2)
    predicted = simulate(built, costs).makespan
    assert predicted > 0 and results[0]["step_s"] > 0
