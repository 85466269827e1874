"""ZeRO-2/3 (FSDP2 over the DP axis) inside a real merak-pipe pipeline step (dp=2 x pp=2, tied weights).

The recipe the engine uses: ``ShardedDataParallel.prepare_step`` before ``PipelineRunner.step``
(the runner gets no shared parameters: their copies are summed on the gradient shards),
``finish()`` after it. Every stage's gradients, gathered over DP, must equal the single-process
gradient of the global batch by logical name, for ZeRO 2 and 3, 1F1B and GPipe, with and
without recomputation; the parameters must really be sharded (each DP rank holds half), and
the pure rules (the reshard-after-forward choice, the FSDP units) are checked without processes.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from merak_core.parallel.fsdp import ShardedDataParallel, default_reshard_after_forward, fsdp_units
from merak_core.parallel.layout import ParallelLayout
from tests.support.compare import assert_grads_match
from tests.support.dist import run_on_ranks
from tests.support.tied_pipeline import (
    DP,
    MICRO,
    PER_RANK,
    PP,
    Block,
    Embed,
    TiedHead,
    global_batch,
    reference_grads,
    stage_weights,
    tied_loss,
)

merak_pipe = pytest.importorskip("merak_pipe")


def _pipeline_step(
    zero_stage: int, schedule_name: str, recompute: bool
) -> tuple[int, dict[str, torch.Tensor], bool]:
    from merak_pipe import PipelineRunner, PipelineStage, RecomputePlan, build_schedule
    from merak_pipe.shared import shared_parameter_groups, shared_parameters_list

    layout = ParallelLayout.build(DP, 1, PP, device="cpu")
    w = stage_weights()
    if layout.is_first_stage:
        module = nn.Sequential(Embed(w["embed.weight"]), Block(w["block0.weight"], w["block0.bias"]))
        names = {
            "embed.weight": (0, "weight"),
            "block0.weight": (1, "linear.weight"),
            "block0.bias": (1, "linear.bias"),
        }
        tied = module[0].weight
    else:
        module = nn.Sequential(Block(w["block1.weight"], w["block1.bias"]), TiedHead(w["embed.weight"]))
        names = {
            "embed.weight": (1, "weight"),
            "block1.weight": (0, "linear.weight"),
            "block1.bias": (0, "linear.bias"),
        }
        tied = module[1].weight
    groups = shared_parameter_groups({"embed": [0, 1]}, group=layout.pp_group)
    shared = shared_parameters_list({"embed": tied}, groups)
    sharded = ShardedDataParallel(
        {layout.pp_rank: module},
        layout.dp_group,
        zero_stage=zero_stage,
        device_type="cpu",
        num_stages=PP,
        shared_parameters=shared,
    )
    stage = PipelineStage(module, stage_index=layout.pp_rank, num_stages=PP, group=layout.pp_group)
    plan = RecomputePlan.full(PP) if recompute else None
    schedule = build_schedule(schedule_name, num_stages=PP, num_microbatches=MICRO, recompute=plan)
    runner = PipelineRunner([stage], schedule, loss_fn=tied_loss, group=layout.pp_group, shared_parameters=[])

    ids, labels = global_batch()
    rows = slice(layout.dp_rank * PER_RANK, (layout.dp_rank + 1) * PER_RANK)
    sharded.prepare_step(MICRO)
    runner.step(ids[rows] if layout.is_first_stage else None, labels[rows] if layout.is_last_stage else None)
    sharded.finish()
    params = {n: module[i].get_parameter(attr) for n, (i, attr) in names.items()}
    halves = all(
        p.to_local().shape[0] == (p.shape[0] + 1) // 2
        if layout.dp_rank == 0
        else p.to_local().shape[0] == p.shape[0] // 2
        for p in params.values()
    )
    return layout.pp_rank, {n: p.grad.full_tensor() for n, p in params.items()}, halves


@pytest.mark.parametrize(
    ("zero_stage", "schedule_name", "recompute"),
    [
        (2, "1f1b", False),
        (3, "1f1b", False),
        (3, "gpipe", True),
        (2, "gpipe", True),
    ],
)
def test_sharded_gradients_inside_a_pipeline_step(
    zero_stage: int, schedule_name: str, recompute: bool
) -> None:
    results = run_on_ranks(DP * PP, _pipeline_step, zero_stage, schedule_name, recompute)
    ref = reference_grads()
    for pp_rank, grads, halves in results:
        assert halves, f"stage {pp_rank}: the parameters are not sharded over DP"
        assert_grads_match(grads, {n: g for n, g in ref.items() if n in grads})
    assert {n for _, grads, _ in results for n in grads} == set(ref)


def test_reshard_after_forward_rule() -> None:
    assert default_reshard_after_forward(3, stage_index=0, num_stages=1)
    assert [default_reshard_after_forward(3, stage_index=s, num_stages=4) for s in range(4)] == [True] * 3 + [
        False
    ]
    assert not any(default_reshard_after_forward(2, stage_index=s, num_stages=2) for s in range(2))
    with pytest.raises(ValueError, match="zero_stage=1"):
        default_reshard_after_forward(1, stage_index=0, num_stages=1)


def test_fsdp_units_are_the_stage_units_or_the_model() -> None:
    seq = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))
    assert fsdp_units(seq) == [seq[0], seq[2]]
    model = nn.Linear(2, 2)
    assert fsdp_units(model) == [model]


def test_split_backward_schedules_are_refused_before_any_collective() -> None:
    from merak_core.parallel.fsdp import check_sharding_supported

    with pytest.raises(ValueError, match=r"zero_stage=3 with schedule='zb_h1'.*I/W.*1f1b"):
        check_sharding_supported(3, "zb_h1")
    check_sharding_supported(1, "zb_h1")  # ZeRO-1 runs it
    for name in ("1f1b", "gpipe", "shifted_critical_path", "auto"):
        check_sharding_supported(2, name)
