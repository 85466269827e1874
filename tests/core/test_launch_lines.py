"""What a rank of ``merak train`` prints for the user (the resume line, the final line) reaches stdout whole.

``print(line)`` writes the text and its newline in two writes; on torchrun's unbuffered rank stdout a
log line from another thread (the checkpoint writer) landed between them in CI, on the resume line
itself ("... --resume latest[rank 0] ... saved checkpoint ..."), and the line no longer parsed.
"""

from __future__ import annotations

import ast
import inspect

import pytest


class _Recorder:
    def __init__(self) -> None:
        self.writes: list[str] = []
        self.flushes = 0

    def write(self, text: str) -> int:
        self.writes.append(text)
        return len(text)

    def flush(self) -> None:
        self.flushes += 1


def test_say_writes_the_line_and_its_newline_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from merak_core.launch import say

    out = _Recorder()
    monkeypatch.setattr(sys, "stdout", out)
    say(
        "merak: stopped by SIGTERM after step 5, checkpoint out/checkpoints/step_5; resume with: merak train j.yaml"
    )
    assert out.writes == [
        "merak: stopped by SIGTERM after step 5, checkpoint out/checkpoints/step_5; resume with: merak train j.yaml\n"
    ]
    assert out.flushes == 1


def test_the_launch_prints_its_lines_through_say() -> None:
    import merak_core.launch as launch

    calls = [
        node.func.id
        for node in ast.walk(ast.parse(inspect.getsource(launch)))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
    ]
    assert "print" not in calls and calls.count("say") >= 2, calls
