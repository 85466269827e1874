"""Optimizer states written by a checkpoint load land where torch's own load_state_dict puts them.

See [Note: optimizer state placement] in merak_core.checkpoint.manager: the loader assembles
each state tensor itself and writes it into ``optimizer.state``, so it must follow torch's rule
(a fused or capturable AdamW reads ``step`` on the parameter's device as float32).
"""

from __future__ import annotations

import pytest
import torch

from merak_core.checkpoint.manager import place_optimizer_state


def _adamw(param: torch.nn.Parameter, **kwargs: bool) -> torch.optim.AdamW:
    opt = torch.optim.AdamW([param], lr=1e-3, **kwargs)
    param.grad = torch.ones_like(param)
    opt.step()
    return opt


@pytest.mark.parametrize("flags", [{}, {"foreach": True}, {"fused": True}, {"foreach": False}])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_placement_matches_torch_load_state_dict(flags: dict[str, bool], dtype: torch.dtype) -> None:
    if flags.get("fused") and dtype == torch.float64:
        pytest.skip("fused AdamW on CPU is float32/16 only")
    p = torch.nn.Parameter(torch.randn(3, 4, dtype=dtype))
    saved = _adamw(p, **flags).state_dict()
    # As read back from storage: a float64 step (not float32) and a half-precision moment,
    # so any cast or move the policy makes is visible.
    loaded = {
        k: (v.to(torch.float64) if k == "step" else v.to(torch.float16)) for k, v in saved["state"][0].items()
    }

    target = torch.nn.Parameter(p.detach().clone())
    reference = _adamw(torch.nn.Parameter(p.detach().clone()), **flags)
    reference.load_state_dict({"state": {0: loaded}, "param_groups": saved["param_groups"]})
    expected = reference.state[reference.param_groups[0]["params"][0]]

    group = _adamw(target, **flags).param_groups[0]
    for key, value in loaded.items():
        got = place_optimizer_state(value, key, target, group)
        assert got.dtype == expected[key].dtype, key
        assert got.device == expected[key].device, key
        assert torch.equal(got, expected[key]), key


def test_fused_or_capturable_step_is_float32_on_the_parameter_device() -> None:
    p = torch.nn.Parameter(torch.zeros(2))
    step = torch.tensor(7.0, dtype=torch.float64)
    for flag in ("fused", "capturable"):
        got = place_optimizer_state(step, "step", p, {flag: True})
        assert (got.dtype, got.device, got.item()) == (torch.float32, p.device, 7.0)
    plain = place_optimizer_state(step, "step", p, {"fused": False, "capturable": False})
    assert plain is step  # left as it was, as torch does
