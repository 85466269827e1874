"""The GPU check under pytest (``-m gpu``): the one entry, ``python -m tests.gpu.run``, in a subprocess.

CUDA and NCCL never live in the pytest process (whose gloo worker pool forks). Skipped where CUDA
is not available (tests/conftest.py skips the ``gpu`` marker). The report lands in pytest's
temporary folder and is printed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.gpu.run import ROOT

pytestmark = pytest.mark.gpu


def test_gpu_check(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "tests.gpu.run", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    with capsys.disabled():
        print(proc.stdout[-8000:])
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert proc.returncode == 0 and report["passed"], (tmp_path / "gpu_check.md").read_text()
