"""The GPU check (``nox -s gpu``): every check of ``tests/gpu/checks.py`` at full size on CUDA.

Each check runs in its own process (``python -m tests.gpu.main``; with several GPUs visible,
``torchrun --nproc-per-node N``), so CUDA and NCCL never live in the pytest process, whose gloo
worker pool forks. The results (tokens/s, MFU, the overlap speedups) are printed. Skipped where
CUDA is not available (tests/conftest.py skips the ``gpu`` marker); the multi-GPU checks also
need at least 2 (``multi_3d``: 8) visible GPUs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.gpu import checks

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.gpu


def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _run(command: list[str], timeout_s: float, capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("MERAK_GPU_RESULT ")]
    if proc.returncode != 0 or not lines:
        raise AssertionError(
            f"{' '.join(command)} exited with {proc.returncode}\n--- stdout\n{proc.stdout[-6000:]}"
            f"\n--- stderr\n{proc.stderr[-6000:]}"
        )
    result = json.loads(lines[-1].removeprefix("MERAK_GPU_RESULT "))
    with capsys.disabled():
        print(f"\n[gpu] {result['check']} (world {result['world']}): {json.dumps(result, sort_keys=True)}")
    return result


@pytest.mark.parametrize("name", sorted(checks.SINGLE_CHECKS))
def test_single_gpu(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    result = _run([sys.executable, "-m", "tests.gpu.main", name, "--device", "cuda"], 480, capsys)
    if name == "trainer_bf16":
        assert result["llama_tokens_per_s"] > 0
        assert result["llama_params"] > 2e8


@pytest.mark.parametrize("name", sorted(checks.MULTI_CHECKS))
def test_multi_gpu(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    n = _gpus()
    if n < 2 or (name == "multi_3d" and n % 4 != 0) or (name == "multi_3d" and n < 8):
        pytest.skip(
            f"{name} needs {'8' if name == 'multi_3d' else 'at least 2'} visible GPUs, this machine has {n}"
        )
    _run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={n}",
            "-m",
            "tests.gpu.main",
            name,
            "--device",
            "cuda",
        ],
        600,
        capsys,
    )
