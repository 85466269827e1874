"""``merak plan`` without ``--memory-per-device``: the default of ``layout: auto``, and the output says which.

The profile is replaced by a fixed one (profiling is what ``layout: auto`` tests do); the job file,
the planning and the printed lines are real.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from merak_core.cli.main import main

DEMO = str(Path(__file__).resolve().parents[2] / "examples" / "addition" / "config.yaml")
BASE = ["plan", DEMO, "data.kwargs.train_size=64", "--world-size", "2"]


@pytest.fixture
def fixed_profile(monkeypatch: pytest.MonkeyPatch) -> None:
    import merak_core.autoplan.auto as auto
    from merak_core.planner import ModelProfile

    profile = ModelProfile(
        layer_forward_s=[1e-3] * 4,
        layer_backward_s=[2e-3] * 4,
        layer_activation_bytes=[1e3] * 4,
        layer_param_bytes=[1e6] * 4,
        boundary_bytes=1e3,
        num_heads=4,
    )
    monkeypatch.setattr(auto, "profile_for_plan", lambda *a, **k: profile)


def test_plan_without_memory_per_device_takes_layout_autos_default(
    fixed_profile: None, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from merak_core.autoplan.givens import default_memory_per_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # this machine's CPU, whatever it has
    assert main(BASE) == 0  # it was exit 2: "--memory-per-device is not given"
    expected = default_memory_per_device(torch.device("cpu"), ranks=2)
    assert (
        expected == os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2
    )  # RAM / the planned ranks
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == (
        f"memory per device: {expected} bytes ({expected / 2**30:.3g} GiB), the default, as layout: auto "
        "(this machine's RAM / 2 ranks); pass --memory-per-device to plan for another"
    )
    assert lines[1].startswith("pipeline runtime: split backward")
    assert f"feasible configurations for 2 ranks, {expected} bytes per device" in lines[2]


@pytest.mark.parametrize(
    ("extra", "where"),
    [
        (["--memory-per-device", "3GiB"], "from --memory-per-device"),
        (["training.memory_per_device=3GiB"], "from training.memory_per_device"),
    ],
)
def test_plan_says_where_its_memory_came_from(
    fixed_profile: None, capsys: pytest.CaptureFixture[str], extra: list[str], where: str
) -> None:
    argv = [*BASE[:3], *extra, *BASE[3:]] if extra[0].startswith("training.") else [*BASE, *extra]
    assert main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"memory per device: {3 * 2**30} bytes (3 GiB), {where}"
