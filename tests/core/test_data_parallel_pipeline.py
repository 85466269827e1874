"""DP gradient sync overlapped with a real merak-pipe pipeline step (dp=2 x pp=2, tied weights).

The recipe the trainer uses: ``sync.prepare_step(num_microbatches)`` before
``PipelineRunner.step``, ``sync.finish()`` after it, the tied embedding (held by the
first and the last stage, summed over the stages by the runner at the end of its
step) passed as ``deferred_params``. Every stage's gradients, by logical name, must
equal the single-process gradient of the global batch, for schedules with a full
backward (1F1B, GPipe; there the hooks must have launched buckets during the step) and
with a split input/weight backward (ZB-H1, whose weight gradients may be accumulated by
hand, so they may only be reduced by ``finish``).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from merak_core.parallel.data_parallel import DataParallelGradSync
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


def _pipeline_step(schedule_name: str) -> tuple[int, dict[str, torch.Tensor], int, int]:
    from merak_pipe import PipelineRunner, PipelineStage, build_schedule
    from merak_pipe.shared import shared_parameter_groups, shared_parameters_list

    layout = ParallelLayout.build(DP, 1, PP, device="cpu")
    w = stage_weights()
    if layout.is_first_stage:
        module = nn.Sequential(Embed(w["embed.weight"]), Block(w["block0.weight"], w["block0.bias"]))
        tied = module[0].weight
        names = {
            "embed.weight": tied,
            "block0.weight": module[1].linear.weight,
            "block0.bias": module[1].linear.bias,
        }
    else:
        module = nn.Sequential(Block(w["block1.weight"], w["block1.bias"]), TiedHead(w["embed.weight"]))
        tied = module[1].weight
        names = {
            "embed.weight": tied,
            "block1.weight": module[0].linear.weight,
            "block1.bias": module[0].linear.bias,
        }
    groups = shared_parameter_groups({"embed": [0, 1]}, group=layout.pp_group)
    shared = shared_parameters_list({"embed": tied}, groups)
    stage = PipelineStage(module, stage_index=layout.pp_rank, num_stages=PP, group=layout.pp_group)
    schedule = build_schedule(schedule_name, num_stages=PP, num_microbatches=MICRO)
    runner = PipelineRunner(
        [stage], schedule, loss_fn=tied_loss, group=layout.pp_group, shared_parameters=shared
    )
    sync = DataParallelGradSync(module, layout.dp_group, bucket_size_bytes=8, deferred_params=[tied])

    ids, labels = global_batch()
    rows = slice(layout.dp_rank * PER_RANK, (layout.dp_rank + 1) * PER_RANK)
    sync.prepare_step(MICRO)
    runner.step(ids[rows] if layout.is_first_stage else None, labels[rows] if layout.is_last_stage else None)
    sync.finish()
    early = sync.buckets_launched_in_backward
    sync.remove_hooks()
    return layout.pp_rank, {n: p.grad.clone() for n, p in names.items()}, early, len(sync.buckets)


@pytest.mark.parametrize("schedule_name", ["1f1b", "gpipe", "zb-h1"])
def test_overlapped_dp_sync_inside_a_pipeline_step(schedule_name: str) -> None:
    results = run_on_ranks(DP * PP, _pipeline_step, schedule_name)
    ref = reference_grads()
    for stage in range(PP):
        got: dict[str, torch.Tensor] = {}
        for pp_rank, grads, early, num_buckets in results:
            if pp_rank == stage:
                assert num_buckets >= 3
                if schedule_name != "zb-h1":
                    # Full backwards run AccumulateGrad, so the hooks launch buckets during the step.
                    # (A split weight backward may accumulate by hand: then finish() reduces them.)
                    assert early >= 1, "no bucket was launched during the pipeline step"
                got = grads
        assert_grads_match(got, {n: g for n, g in ref.items() if n in got})
    dist_names = {n for _, grads, _, _ in results for n in grads}
    assert dist_names == set(ref)
