"""``layout: auto`` on 2 gloo ranks: a job that writes its degrees keeps their global batch; a plan that
ranks first the layout its own probe measured slowest says so.

The machine's measurements are replaced (a fixed profile, a device per rank, the default
``CommModel``; for the probe, the seconds each probe step took) so that the plan, not this
machine's load, decides; the planning, the probe's bookkeeping and the agreement over the ranks
are real. The degrees, the config checks and the dry run without processes are in
``tests/core/test_autoplan.py``; the probe's line for every case in ``tests/core/test_probe_note.py``.
"""

from __future__ import annotations

import logging
from typing import Any

from tests.e2e._trainer_support import TokenDataset
from tests.support.dist import run_on_ranks


def _profile(heads: int, param_bytes: float, layers: int) -> Any:
    from merak_core.planner import ModelProfile

    return ModelProfile(
        layer_forward_s=[1e-2] * layers,
        layer_backward_s=[2e-2] * layers,
        layer_activation_bytes=[1e3] * layers,
        layer_param_bytes=[param_bytes] * layers,
        boundary_bytes=1e3,
        num_heads=heads,
    )


def _plan_body(
    kwargs: dict[str, Any], heads: int = 1, param_bytes: float = 1e8, probe_ms: Any = None, layers: int = 4
) -> dict[str, Any]:
    """``auto_layout`` with the fixed profile; ``probe_ms``: per TP degree, (pipeline, whole) ms of each probe step."""
    import torch.distributed as dist

    from merak_core.autoplan import auto, probe
    from merak_core.config import TrainingArguments
    from merak_core.planner import CommModel
    from tests.e2e.test_virtual_stages import build

    profile = _profile(heads, param_bytes, layers)
    saved = auto.profile_for_plan, auto._cpu_compute_slots, auto.measure_comm, probe._times
    auto.profile_for_plan = lambda *a, **k: profile
    auto._cpu_compute_slots = lambda *a, **k: None
    auto.measure_comm = lambda *a, **k: CommModel()
    if probe_ms is not None:

        def times(model: Any, args: Any, layout: Any, *rest: Any) -> tuple[list[float], list[float]]:
            pipe, whole = probe_ms[layout.tp]
            return [pipe / 1e3] * rest[-1], [whole / 1e3] * rest[-1]

        probe._times = times
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    auto.logger.addHandler(handler)
    try:
        args = TrainingArguments(layout="auto", **kwargs)
        model = build("gpt", profile.num_layers)
        chosen = auto.auto_layout(args, model, TokenDataset(16, model.config.vocab_size))
    finally:
        auto.profile_for_plan, auto._cpu_compute_slots, auto.measure_comm, probe._times = saved
        auto.logger.removeHandler(handler)
    t = chosen.args
    return {
        "written": (args.dp, args.tp, args.pp),
        "before": auto.auto_global_batch(args, dist.get_world_size())[0],
        "chosen": (t.layout, t.dp, t.tp, t.pp),
        "after": t.per_device_train_batch_size * t.gradient_accumulation_steps * t.dp,
        "lines": lines if dist.get_rank() == 0 else None,
    }


def test_auto_with_written_degrees_replaces_them_and_keeps_their_global_batch():
    # Four layers whose weights fit a device only split in two (no dp=2) and one head (no tp=2).
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


def test_a_plan_ranking_first_the_layout_its_probe_measured_slowest_says_so():
    # One layer (no pp=2), two heads (tp=2 allowed), small weights. The probe's pipeline times make dp2-tp1
    # the fastest for the
    # cost model (it ranks first), but its whole steps were measured slowest: 40 ms for 2 samples (20 ms
    # per sample) against 15 ms for 1 sample at dp1-tp2. The plan's output names that measurement.
    kwargs = dict(
        per_device_train_batch_size=1,
        gradient_accumulation_steps=1,
        memory_per_device=int(1e9),
        plan_probe_tp=True,
        plan_check_steps=0,
        max_steps=1,
    )
    probe_ms = {1: (1.0, 40.0), 2: (10.0, 15.0)}
    results = run_on_ranks(2, _plan_body, kwargs, 2, 1e3, probe_ms, 1)
    r0 = results[0]
    assert all(r["chosen"] == r0["chosen"] for r in results)
    assert r0["chosen"] == ("manual", 2, 1, 1)
    slowest = [line for line in r0["lines"] if "probe measured" in line]
    assert slowest == [
        "layout auto: the plan ranks dp2-tp1-pp1 first, but its probe measured that layout slowest: 40 ms per "
        "step of 2 samples (20 ms per sample; dp1-tp2 15 ms per sample); the cost model and this machine "
        "disagree here: to train the measured fastest, set layout: manual with training.dp=1 training.tp=2 "
        "training.pp=1"
    ]
    # measured faster per sample than the other: no such line
    results = run_on_ranks(2, _plan_body, kwargs, 2, 1e3, {1: (1.0, 20.0), 2: (10.0, 15.0)}, 1)
    assert results[0]["chosen"] == ("manual", 2, 1, 1)
    assert not [line for line in results[0]["lines"] if "probe measured" in line]
