"""The GPU check's entry (``python -m tests.gpu.run``) started as on the GPU machine: sources on PYTHONPATH only.

How "nothing installed" is made honest here: the child runs with ``python -S``, so ``site`` does not
run and no ``.pth`` file of the environment is read; the editable installs of the four Merak
packages are ``.pth`` files, so they are invisible. torch and the other third-party packages come
from the environment's ``site-packages`` folder, put on ``PYTHONPATH`` beside the four ``src``
folders and the repository root, as a GPU image's own packages would be. The report says where
each Merak package was imported from (asserted: the ``src`` folders) and that nox was never
imported. ``OMP_NUM_THREADS=1`` is passed in (what the test suite sets): the check must still give
its CPU work every core.
"""

from __future__ import annotations

import json
import os
import site
import subprocess
import sys
from pathlib import Path

import pytest

from tests.gpu.run import ROOT, SOURCES, markdown

pytestmark = pytest.mark.slow


def _run_entry(out: Path, *options: str) -> subprocess.CompletedProcess[str]:
    """``python -S -m tests.gpu.run --out OUT --device cpu OPTIONS`` with the sources on PYTHONPATH only."""
    path = [*map(str, SOURCES), str(ROOT), *site.getsitepackages()]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PYTHONPATH=os.pathsep.join(path), OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    command = [sys.executable, "-S", "-m", "tests.gpu.run", "--out", str(out), "--device", "cpu", *options]
    proc = subprocess.run(command, cwd=out.parent, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc


@pytest.mark.one_process  # a world-1 check: the entry, then its one child
def test_gpu_check_runs_from_the_sources_with_python_path_only(tmp_path: Path) -> None:
    out = tmp_path / "out"
    _run_entry(out, "--only", "pipeline_v")
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["format"] == 1 and report["passed"] and not report["nox_imported"]
    for name, folder in report["imports"].items():
        assert Path(folder).parent in SOURCES, f"{name} imported from {folder}, not from the sources"
    (check,) = report["checks"]
    assert check["check"] == "pipeline_v" and check["status"] == "passed" and check["world"] == 1
    assert check["result"]["threads"] == os.cpu_count() == check["threads"]  # not the inherited 1
    assert check["result"]["pipeline_grads_checked"] > 0
    assert (out / "gpu_check.md").read_text() == markdown(report)


def test_multi_rank_check_runs_under_torchrun_from_the_sources(tmp_path: Path) -> None:
    """The multi-rank part goes through ``torch.distributed.run -m tests.gpu.main`` (it once passed the
    module name as a script path: every multi-rank check failed before running); a check that needs
    more devices than there are is skipped with a line saying why."""
    out = tmp_path / "out"
    proc = _run_entry(out, "--only", "multi_zero,multi_3d", "--nproc", "2", "--threads", "2")
    assert "[gpu check] multi_3d: skipped: needs 8 devices, this machine has 2" in proc.stdout
    report = json.loads((out / "gpu_check.json").read_text())
    zero, three_d = report["checks"]
    assert zero["check"] == "multi_zero" and zero["status"] == "passed" and zero["world"] == 2
    assert all(zero["result"][f"zero{s}_loss_rel_diff"] <= 1e-4 for s in (1, 2, 3))
    assert set(zero["tokens_per_s"]) == {"zero1_tokens_per_s", "zero2_tokens_per_s", "zero3_tokens_per_s"}
    assert set(zero["mfu"]) == {"zero1_mfu", "zero2_mfu", "zero3_mfu"}  # null on CPU: no peak
    assert three_d["status"] == "skipped" and three_d["error"] == "needs 8 devices, this machine has 2"


@pytest.mark.one_process
def test_gpu_check_refuses_without_cuda(tmp_path: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    proc = subprocess.run(
        [sys.executable, "-m", "tests.gpu.run", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "needs CUDA" in proc.stderr
