"""Early receives on the tagged transport ([Note: early receives] in merak_pipe/p2p_order.py).

Order level, for every built-in schedule: each data receive is posted exactly once, at most
``lookahead`` units before its place and never before the point where its buffers' shapes are
known; sends and control messages stay where they were; lookahead 0 changes nothing. Runner
level: the tagged transport runs the moved order, NCCL's rules the checked one. That the runtime
computes the same losses and gradients with the moved order is the runtime matrix
(tests/pipe/test_runtime.py, "tags" transport); that the sends a message proves matched before
they are issued are still let go is tests/pipe/test_buffer_lifetime.py.
"""

from __future__ import annotations

import pytest

from merak_pipe import ActionKind, Schedule, build_schedule, lower
from merak_pipe.p2p_order import DATA_B, DATA_F, P2POp, Step, early_receives, issue_orders

CASES = [
    ("gpipe", 2, 2, 4),
    ("1f1b", 2, 2, 8),
    ("1f1b", 4, 4, 8),
    ("interleaved-1f1b", 4, 2, 8),
    ("shifted-critical-path", 3, 3, 5),
    ("zb-h1", 4, 4, 8),
    ("zb-v", 4, 2, 8),
]


def _schedule(name: str, stages: int, ranks: int, m: int) -> Schedule:
    return lower(build_schedule(name, num_stages=stages, num_microbatches=m, num_ranks=ranks))


def _unit_positions(steps: list[Step]) -> dict[int, int]:
    """id(op) -> the ordinal of the unit that holds it."""
    out, k = {}, 0
    for step in steps:
        if isinstance(step, tuple):
            for op in step:
                out[id(op)] = k
            k += 1
    return out


def _compute(steps: list[Step]) -> list[Step]:
    return [s for s in steps if not isinstance(s, tuple)]


def _ops(steps: list[Step]) -> list[P2POp]:
    return [op for s in steps if isinstance(s, tuple) for op in s]


@pytest.mark.parametrize("name,stages,ranks,m", CASES)
@pytest.mark.parametrize("forward_only", [False, True])
def test_receives_move_at_most_lookahead_units_and_only_receives(
    name: str, stages: int, ranks: int, m: int, forward_only: bool
) -> None:
    schedule = _schedule(name, stages, ranks, m)
    moved_any = False
    for lookahead in (1, 2):
        for rank, steps in issue_orders(schedule, forward_only=forward_only).items():
            early = early_receives(steps, lookahead)
            # Compute actions untouched; every op exactly once.
            assert _compute(early) == _compute(steps)
            assert sorted(map(id, _ops(early))) == sorted(map(id, _ops(steps)))
            before = _unit_positions(steps)
            old_units = [s for s in steps if isinstance(s, tuple)]
            for op in _ops(steps):
                # Units are only ever emptied (dropped), so map the new unit back to an old ordinal
                # through an op that did not move (a unit keeps its sends and control messages, or is
                # a unit of receives only).
                delta = _old_ordinal(early, op, old_units) - before[id(op)]
                if op.send or op.kind not in (DATA_F, DATA_B):
                    assert delta == 0, (name, rank, str(op))
                else:
                    assert -lookahead <= delta <= 0, (name, rank, str(op), delta)
                    moved_any |= delta < 0
            _assert_shapes_known(early)
    assert moved_any, "no receive moved: the test would pass on an identity transform"


def _old_ordinal(early: list[Step], op: P2POp, old_units: list[tuple[P2POp, ...]]) -> int:
    """The ordinal, in the old order, of the unit ``op`` sits in now: the old unit that shares any
    op with it and did not lose it to an earlier unit (the first old unit among its members' homes)."""
    home = {id(o): k for k, unit in enumerate(old_units) for o in unit}
    for step in early:
        if isinstance(step, tuple) and any(o is op for o in step):
            return min(home[id(o)] for o in step)
    raise AssertionError(str(op))


def _assert_shapes_known(steps: list[Step]) -> None:
    """A forward receive never comes before its stage's first one in the round; a gradient receive
    never before the first forward of the stage whose outputs it matches."""
    first_recv_seen: set[int] = set()
    forwarded: set[int] = set()
    for step in steps:
        if not isinstance(step, tuple):
            if step.kind is ActionKind.FORWARD:
                forwarded.add(step.stage)
            continue
        for op in step:
            if op.send:
                continue
            if op.kind == DATA_F:
                first_recv_seen.add(op.stage + 1)
            elif op.kind == DATA_B:
                assert op.stage - 1 in forwarded, str(op)
        for op in step:
            if not op.send and op.kind == DATA_F:
                assert op.stage + 1 in first_recv_seen


def test_lookahead_zero_is_the_issue_order() -> None:
    schedule = _schedule("1f1b", 2, 2, 8)
    for steps in issue_orders(schedule).values():
        assert early_receives(steps, 0) == steps


def test_one_f_one_b_posts_the_next_input_before_the_current_forward() -> None:
    """Last stage of 1F1B at 2 ranks: the receive of microbatch m+1's input is posted in the unit
    before F(m) (it used to come after B(m), after the sender had already sent it)."""
    schedule = _schedule("1f1b", 2, 2, 4)
    steps = early_receives(issue_orders(schedule)[1], 1)
    posted: set[int] = set()
    for step in steps:
        if isinstance(step, tuple):
            posted |= {op.microbatch for op in step if not op.send and op.kind == DATA_F}
        elif step.kind is ActionKind.FORWARD and step.microbatch < 3:
            assert step.microbatch + 1 in posted, (str(step), sorted(posted))


@pytest.mark.parametrize("nccl_rules,early", [(False, 1), (True, 1), (False, 0)])
def test_the_runner_moves_receives_only_on_the_tagged_transport(nccl_rules: bool, early: int) -> None:
    from tests.support.dist import run_on_ranks

    results = run_on_ranks(2, _plans_body, nccl_rules, early)
    for rank, (plan, checked) in enumerate(results):
        if nccl_rules or early == 0:
            assert plan == checked, rank
        else:
            assert plan != checked, rank


def test_early_receives_must_be_a_whole_number() -> None:
    from tests.support.dist import run_on_ranks

    for bad in (-1, 1.5, True):
        with pytest.raises(Exception, match="early_receives"):
            run_on_ranks(2, _plans_body, False, bad)


def _plans_body(nccl_rules: bool, early: int) -> tuple[list[str], list[str]]:
    import torch
    import torch.distributed as dist

    from merak_pipe import PipelineRunner, PipelineStage

    rank = dist.get_rank()
    torch.manual_seed(0)
    stage = PipelineStage(torch.nn.Linear(4, 4), stage_index=rank, num_stages=2)
    schedule = build_schedule("1f1b", num_stages=2, num_microbatches=4)
    runner = PipelineRunner(
        [stage],
        schedule,
        loss_fn=lambda y, t: (y - t).pow(2).mean(),
        nccl_rules=nccl_rules,
        early_receives=early,
    )

    def text(steps: list[Step]) -> list[str]:
        return [str(s) if not isinstance(s, tuple) else " ".join(map(str, s)) for s in steps]

    return text(runner._plans[True]), text(issue_orders(runner.schedule)[rank])
