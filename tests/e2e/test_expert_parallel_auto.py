"""``layout: auto`` choosing expert parallelism, and training with it (issue 29 item 4).

The reference MoE Llama on 2 ranks, the job at ``ep: 1``. The machine's measurements are replaced (a
device per rank, the default ``CommModel``, no per-action cost) and the profile by one whose experts
hold most of the bytes, with one key/value head (no tp=2) and one layer (no pp=2), and a memory per
device where the experts fit only sharded: the planner chooses dp=2 x ep=2 by itself. The run with the
chosen fields equals the manual run with the same fields (losses and every parameter, bit for bit);
the manual ep=2 run is itself tested against one process in float64 by ``test_expert_parallel.py``.
"""

from __future__ import annotations

from typing import Any

import torch

from tests.e2e.test_expert_parallel import Tokens, _args, _model, _sgd
from tests.support.dist import run_on_ranks

FIELDS = ("dp", "tp", "pp", "ep", "per_device_train_batch_size", "gradient_accumulation_steps", "recompute")


def _profile() -> Any:
    from merak_core.planner import ModelProfile

    return ModelProfile(
        layer_forward_s=[1e-3],
        layer_backward_s=[2e-3],
        layer_activation_bytes=[1e3],
        layer_param_bytes=[1e9],
        layer_expert_bytes=[8e8],
        layer_moe_blocks=[1],
        num_experts=4,
        top_k=2,
        boundary_bytes=1e3,
        num_heads=4,
        num_kv_heads=1,
    )


def _train(overrides: dict[str, Any]) -> tuple[dict[str, Any], list[float], dict[str, torch.Tensor] | None]:
    import torch.distributed as dist

    from merak_core import Trainer
    from merak_core.autoplan import auto
    from merak_core.planner import CommModel

    saved = auto.profile_for_plan, auto._cpu_compute_slots, auto.measure_comm, auto.measure_action_cost
    auto.profile_for_plan = lambda *a, **k: _profile()
    auto._cpu_compute_slots = lambda *a, **k: None
    auto.measure_comm = lambda *a, **k: CommModel()
    auto.measure_action_cost = lambda *a, **k: 0.0
    try:
        trainer = Trainer(_model(), _args(**overrides), Tokens(), optimizer_factory=_sgd)
    finally:
        auto.profile_for_plan, auto._cpu_compute_slots, auto.measure_comm, auto.measure_action_cost = saved
    history = trainer.train()
    state = trainer.full_state_dict()
    fields = {k: getattr(trainer.args, k) for k in FIELDS}
    return fields, [h["loss"] for h in history if "loss" in h], state if dist.get_rank() == 0 else None


def test_layout_auto_chooses_ep_when_the_experts_fit_only_sharded_and_trains_as_the_manual_run() -> None:
    # ep=1: 1e9 bytes of weights, gradients and two Adam states (4e9) on each rank; ep=2: the 8e8 of experts
    # halved (2.4e9). 3.5e9 per device leaves 2.975e9 after the planner's margin.
    auto = run_on_ranks(
        2,
        _train,
        dict(layout="auto", dp=2, memory_per_device=int(3.5e9), plan_probe_tp=False, plan_check_steps=0),
    )
    fields = auto[0][0]
    assert all(r[0] == fields for r in auto)
    assert (fields["dp"], fields["ep"], fields["tp"], fields["pp"]) == (2, 2, 1, 1)
    manual = run_on_ranks(2, _train, fields)
    assert auto[0][1] == manual[0][1]
    got, want = auto[0][2], manual[0][2]
    assert got is not None and want is not None and set(got) == set(want)
    for name, value in want.items():
        assert torch.equal(got[name], value), name
