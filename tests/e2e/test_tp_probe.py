"""merak_core.autoplan.probe on 2 gloo ranks: one factor per probed layout and one for the time outside the
pipeline, the same on every rank, and the caller's model, random stream and folders left as they were."""

from __future__ import annotations

import math
import os
import tempfile

import pytest
import torch

from tests.e2e._trainer_support import TokenDataset, build_model, make_args
from tests.support.dist import run_on_ranks


def _probe_body() -> tuple[object, bool, bool, list[str]]:
    from merak_core.autoplan.probe import measure_tp_scale
    from merak_core.planner import CommModel, ModelProfile

    model = build_model("gpt")
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    args = make_args(
        output_dir=tempfile.mkdtemp(prefix="merak-probe-test-"),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=1,
        max_steps=1,
    )
    profile = ModelProfile(
        layer_forward_s=[1e-4] * 2,
        layer_backward_s=[2e-4] * 2,
        layer_activation_bytes=[1e3] * 2,
        layer_param_bytes=[1e4] * 2,
        num_heads=4,
    )
    torch.manual_seed(3)
    expected = torch.rand(2)
    torch.manual_seed(3)
    temp_before = sorted(os.listdir(tempfile.gettempdir()))
    scale = measure_tp_scale(
        args, model, TokenDataset(64, model.config.vocab_size), profile, CommModel(), None, steps=3
    )
    same_stream = torch.equal(torch.rand(2), expected)
    unchanged = all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    left = sorted(set(os.listdir(tempfile.gettempdir())) - set(temp_before))
    return scale, same_stream, unchanged, left


def test_tp_probe_measures_one_factor_per_degree_and_leaves_the_caller_alone():
    results = run_on_ranks(2, _probe_body)
    result, same_stream, unchanged, left = results[0]
    assert sorted(result.tp_scale) == [1, 2]  # pure DP and DP x TP-2 on 2 ranks
    assert all(math.isfinite(v) and v > 0 for v in result.tp_scale.values())
    assert math.isfinite(result.overhead_scale) and result.overhead_scale > 0
    assert all(r[0] == result for r in results)  # every rank holds the same factors
    assert all(r[1] for r in results), "the probe moved the caller's random stream"
    assert all(r[2] for r in results), "the probe changed the caller's model"
    assert not [name for name in left if name.startswith("merak-tp-probe-")]


def test_tp_probe_rejects_too_few_steps():
    from merak_core.autoplan.probe import measure_tp_scale
    from merak_core.planner import CommModel, ModelProfile

    profile = ModelProfile(
        layer_forward_s=[1.0], layer_backward_s=[1.0], layer_activation_bytes=[1.0], layer_param_bytes=[1.0]
    )
    with pytest.raises(ValueError, match="steps=2"):
        measure_tp_scale(make_args(), torch.nn.Linear(2, 2), [], profile, CommModel(), None, steps=2)
