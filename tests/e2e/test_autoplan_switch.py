"""``layout: auto`` as one switch on 2 gloo ranks: a job that writes its degrees keeps their global batch.

The machine's measurements are replaced (a fixed profile, a device per rank, the default
``CommModel``) so that the plan, not this machine's load, decides; the planning itself and the
agreement over the ranks are real. The degrees, the config checks and the dry run without
processes are in ``tests/core/test_autoplan.py``.
"""

from __future__ import annotations

import logging
from typing import Any

from tests.e2e._trainer_support import TokenDataset
from tests.support.dist import run_on_ranks


def _profile() -> Any:
    # Four layers whose weights fit a device only split in two (no dp=2) and one head (no tp=2).
    from merak_core.planner import ModelProfile

    return ModelProfile(
        layer_forward_s=[1e-2] * 4,
        layer_backward_s=[2e-2] * 4,
        layer_activation_bytes=[1e3] * 4,
        layer_param_bytes=[1e8] * 4,
        boundary_bytes=1e3,
        num_heads=1,
    )


def _plan_body(kwargs: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist

    from merak_core.autoplan import auto
    from merak_core.config import TrainingArguments
    from merak_core.planner import CommModel
    from tests.e2e.test_virtual_stages import build

    profile = _profile()
    saved = auto.profile_for_plan, auto._cpu_compute_slots, auto.measure_comm
    auto.profile_for_plan = lambda *a, **k: profile
    auto._cpu_compute_slots = lambda *a, **k: None
    auto.measure_comm = lambda *a, **k: CommModel()
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    auto.logger.addHandler(handler)
    try:
        args = TrainingArguments(layout="auto", **kwargs)
        model = build("gpt", profile.num_layers)
        chosen = auto.auto_layout(args, model, TokenDataset(16, model.config.vocab_size))
    finally:
        auto.profile_for_plan, auto._cpu_compute_slots, auto.measure_comm = saved
        auto.logger.removeHandler(handler)
    t = chosen.args
    return {
        "written": (args.dp, args.tp, args.pp),
        "before": args.per_device_train_batch_size * args.gradient_accumulation_steps * args.dp,
        "chosen": (t.layout, t.dp, t.tp, t.pp),
        "after": t.per_device_train_batch_size * t.gradient_accumulation_steps * t.dp,
        "lines": lines if dist.get_rank() == 0 else None,
    }


def test_auto_with_written_degrees_replaces_them_and_keeps_their_global_batch():
    # The job writes dp=1 tp=2 (a manual job switched to auto): global batch 1 x 2 x dp 1 = 2. Counting
    # every rank as DP would plan for 4; the planner may not keep tp=2 (one head), and does not need to.
    kwargs = dict(
        dp=1,
        tp=2,
        per_device_train_batch_size=1,
        gradient_accumulation_steps=2,
        memory_per_device=int(1.3e9),
        plan_probe_tp=False,
        plan_check_steps=0,
        max_steps=1,
    )
    results = run_on_ranks(2, _plan_body, kwargs)
    r0 = results[0]
    assert all(r["chosen"] == r0["chosen"] and r["after"] == r0["after"] for r in results)
    assert r0["written"] == (1, 2, 1) and r0["before"] == 2
    assert r0["after"] == r0["before"] == 2  # the same global batch before and after planning
    assert r0["chosen"] == ("manual", 1, 1, 2)  # the plan's degrees, not the written ones
    note = [line for line in r0["lines"] if line.startswith("layout auto: the job's")]
    assert note == [
        "layout auto: the job's dp=1 tp=2 are replaced by the plan's (layout: manual keeps them); they fix "
        "the global batch at 2 (per_device_train_batch_size 1 x gradient_accumulation_steps 2 x dp 1 as written)"
    ]
