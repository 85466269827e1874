"""The usage example in packages/merak-pipe/README.md runs as written."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "packages" / "merak-pipe" / "README.md"


def test_readme_usage_example_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    text = README.read_text()
    usage = text[text.index("## Usage") :]
    match = re.search(r"```python\n(.*?)```", usage, re.S)
    assert match is not None, "the README lost its python usage example"
    monkeypatch.chdir(tmp_path)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(match.group(1), str(README), "exec"), {})
    printed = out.getvalue()
    assert "(0.875, 0.75, 0.0, 0.0)" in printed  # the plan the README comment promises
    assert "shifted-critical-path: makespan" in printed
    assert (tmp_path / "scp.json").exists()
