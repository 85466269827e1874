"""ZeRO-2/3 on a torch whose FSDP2 private state is not where merak-core reads it (issue 25, item 2).

``merak_core.parallel._compat`` drives FSDP2's post-backward on demand (one reduce-scatter per step) and
counts the unsharded bytes FSDP2 holds, both from private state. Here one private attribute at a
time (the parameter-group list's two spellings together) is made to vanish (``_compat._fsdp_state`` hands out a view of FSDP2's state objects that
raises ``AttributeError`` for that name, as a torch without it or with it renamed would; FSDP2
itself keeps working). The step must then take the public path (every backward syncs) and give
the single-process float64 gradients, the same as the private path, inside a real dp=2 x pp=2
pipeline step (the ZeRO-2/3 tests' world); the public byte count must equal the private one at
every point sampled.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from merak_core.parallel import _compat
from merak_core.parallel.fsdp import ShardedDataParallel
from merak_core.parallel.layout import ParallelLayout
from tests.support.compare import assert_grads_match, assert_tensors_close
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

pytest.importorskip("merak_pipe")

# Every private name _compat reads, at each level of FSDP2's state (state, parameter group, parameter).
PRIVATE_NAMES = (
    "_fsdp_param_groups,_fsdp_param_group",
    "_root_post_backward_final_callback",
    "post_backward",
    "fsdp_params",
    "all_gather_outputs",
    "unsharded_accumulated_grad",
)


class _Hiding:
    """A view of one of FSDP2's state objects without the attributes ``hidden`` (others pass through)."""

    def __init__(self, target: Any, hidden: tuple[str, ...]) -> None:
        object.__setattr__(self, "_hiding_target", target)
        object.__setattr__(self, "_hiding_names", hidden)

    def __getattr__(self, name: str) -> Any:
        if name in self._hiding_names:
            raise AttributeError(f"{type(self._hiding_target).__name__!r} object has no attribute {name!r}")
        return _hide_in(getattr(self._hiding_target, name), self._hiding_names)


def _hide_in(value: Any, hidden: tuple[str, ...]) -> Any:
    if isinstance(value, (list, tuple)):
        return [_hide_in(v, hidden) for v in value]
    if type(value).__module__.startswith("torch.distributed.fsdp"):
        return _Hiding(value, hidden)
    return value


def _stage_module(layout: ParallelLayout) -> tuple[nn.Sequential, dict[str, tuple[int, str]], nn.Parameter]:
    w = stage_weights()
    if layout.is_first_stage:
        module = nn.Sequential(Embed(w["embed.weight"]), Block(w["block0.weight"], w["block0.bias"]))
        names = {
            "embed.weight": (0, "weight"),
            "block0.weight": (1, "linear.weight"),
            "block0.bias": (1, "linear.bias"),
        }
        return module, names, module[0].weight
    module = nn.Sequential(Block(w["block1.weight"], w["block1.bias"]), TiedHead(w["embed.weight"]))
    names = {
        "embed.weight": (1, "weight"),
        "block1.weight": (0, "linear.weight"),
        "block1.bias": (0, "linear.bias"),
    }
    return module, names, module[1].weight


def _sample(
    sharded: ShardedDataParallel, real_state: Any, samples: list[tuple[tuple[int, int], tuple[int, int]]]
) -> None:
    """(what _compat counts now, what FSDP2's real private state holds now) for every unit."""
    for root in sharded.roots:
        groups = [g for sub in real_state(root)._state_ctx.all_states for g in sub._fsdp_param_groups]
        samples.append((_compat.fsdp_unsharded_bytes(root), _compat._private_unsharded_bytes(groups)))


def _step(zero_stage: int, schedule_name: str, hidden: str | None) -> dict[str, Any]:
    """One pipeline step with the comma-separated private names ``hidden`` out of _compat's sight."""
    from merak_pipe import PipelineRunner, PipelineStage, build_schedule
    from merak_pipe.shared import shared_parameter_groups, shared_parameters_list

    real_state = _compat._fsdp_state
    if hidden is not None:
        _compat._fsdp_state = lambda root: _Hiding(real_state(root), tuple(hidden.split(",")))  # type: ignore[assignment]
    try:
        layout = ParallelLayout.build(DP, 1, PP, device="cpu")
        module, names, tied = _stage_module(layout)
        groups = shared_parameter_groups({"embed": [0, 1]}, group=layout.pp_group)
        sharded = ShardedDataParallel(
            {layout.pp_rank: module},
            layout.dp_group,
            zero_stage=zero_stage,
            device_type="cpu",
            num_stages=PP,
            shared_parameters=shared_parameters_list({"embed": tied}, groups),
        )
        samples: list[tuple[tuple[int, int], tuple[int, int]]] = []
        for unit in sharded.roots:  # after FSDP2's own pre-forward hook: the unit is gathered here
            unit.register_forward_pre_hook(lambda *_: _sample(sharded, real_state, samples))
        stage = PipelineStage(module, stage_index=layout.pp_rank, num_stages=PP, group=layout.pp_group)
        schedule = build_schedule(schedule_name, num_stages=PP, num_microbatches=MICRO)
        runner = PipelineRunner(
            [stage], schedule, loss_fn=tied_loss, group=layout.pp_group, shared_parameters=[]
        )
        ids, labels = global_batch()
        rows = slice(layout.dp_rank * PER_RANK, (layout.dp_rank + 1) * PER_RANK)
        sharded.prepare_step(MICRO)
        runner.step(
            ids[rows] if layout.is_first_stage else None, labels[rows] if layout.is_last_stage else None
        )
        _sample(sharded, real_state, samples)
        before_finish = sharded.unsharded_bytes()
        sharded.finish()
        _sample(sharded, real_state, samples)
        params = {n: module[i].get_parameter(attr) for n, (i, attr) in names.items()}
        return {
            "deferred": sharded.deferred_reduce,
            "grads": {n: p.grad.full_tensor() for n, p in params.items()},
            "samples": samples,
            "before_finish": before_finish,
            "after_finish": sharded.unsharded_bytes(),
        }
    finally:
        _compat._fsdp_state = real_state  # type: ignore[assignment]


def _merged(results: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    return {n: g for r in results for n, g in r["grads"].items()}


@pytest.mark.parametrize(
    ("zero_stage", "schedule_name", "hidden"),
    [(3, "1f1b", name) for name in PRIVATE_NAMES] + [(2, "gpipe", "_root_post_backward_final_callback")],
)
def test_sharded_step_without_a_private_fsdp_attribute(
    zero_stage: int, schedule_name: str, hidden: str
) -> None:
    private = run_on_ranks(DP * PP, _step, zero_stage, schedule_name, None)
    public = run_on_ranks(DP * PP, _step, zero_stage, schedule_name, hidden)
    assert all(r["deferred"] for r in private), "this torch's FSDP2 state should be readable"
    assert not any(r["deferred"] for r in public), f"without {hidden!r} the step must sync every backward"
    ref = reference_grads()
    assert_grads_match(_merged(public), ref)
    for name, grad in _merged(private).items():  # the same sum in another order
        assert_tensors_close(_merged(public)[name], grad, name=f"grad[{name}]", rtol=1e-12, atol=1e-14)
    for rank, r in enumerate(public):
        assert r["samples"], f"rank {rank}: nothing sampled"
        for counted, held in r["samples"]:
            assert counted == held, f"rank {rank}: counted {counted} bytes, FSDP2 holds {held}"
        assert r["before_finish"][1] == 0, f"rank {rank}: unsharded gradients outlived their backward"
        assert r["after_finish"] == (0, 0)
    # Something was really gathered (the counts are not trivially zero) on every rank.
    assert all(any(c[0] > 0 for c, _ in r["samples"]) for r in public)


def test_reduce_gradients_refuses_without_the_private_state(monkeypatch: pytest.MonkeyPatch) -> None:
    unit = nn.Linear(2, 2)
    monkeypatch.setattr(_compat, "_fsdp_state", lambda root: object())
    assert not _compat.fsdp_can_defer_reduce(unit)
    with pytest.raises(
        RuntimeError, match=r"torch .*FSDP2's private post-backward state.*fsdp_can_defer_reduce"
    ):
        _compat.fsdp_reduce_gradients(unit)


def test_one_group_per_state_torch_keeps_the_deferred_reduce() -> None:
    """A torch whose FSDP2 states hold one parameter group (``_fsdp_param_group``, no list) still gets one
    reduce-scatter per step, with the single-process gradients."""
    results = run_on_ranks(DP * PP, _step, 3, "1f1b", "_fsdp_param_groups")
    assert all(r["deferred"] for r in results)
    assert_grads_match(_merged(results), reference_grads())
    for rank, r in enumerate(results):
        for counted, held in r["samples"]:
            assert counted == held, f"rank {rank}: counted {counted} bytes, FSDP2 holds {held}"
