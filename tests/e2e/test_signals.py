"""SIGTERM / SIGINT on one rank: every rank stops after the same step with a preemption checkpoint and one
resume line, and resuming gives the uninterrupted run bit for bit; SIGSTOP on one rank: the others name it
(global rank and coordinates) within the communication timeout."""

from __future__ import annotations

import re
import signal
from pathlib import Path

import pytest
import torch

from tests.e2e import _fault_support as faults
from tests.support.dist import WorkerError, run_on_ranks

LAYOUT = (2, 1, 2)  # 4 ranks: stage 0 = ranks 0, 1; stage 1 = ranks 2, 3
STEPS = 5


def _sections(text: str) -> dict[int, str]:
    parts = re.split(r"\n--- rank (\d+) ---\n", text)
    return {int(parts[i]): parts[i + 1] for i in range(1, len(parts) - 1, 2)}


@pytest.mark.parametrize("victim,signum", [(3, signal.SIGTERM), (0, signal.SIGINT)], ids=["sigterm_rank3",
                                                                                            "sigint_rank0"])
def test_a_signal_on_one_rank_stops_every_rank_after_the_same_step(tmp_path: Path, victim: int, signum: int) -> None:
    out = str(tmp_path / "out")
    stopped = run_on_ranks(4, faults.preempt_body, LAYOUT, victim, signum, 3, out, STEPS)
    name = signal.Signals(signum).name
    assert [r["step"] for r in stopped] == [3] * 4  # the signal came during step 3: step 3 completes everywhere
    assert stopped[victim]["signal"] == name
    assert all(r["signal"] == "a stop signal to another rank" for i, r in enumerate(stopped) if i != victim)
    checkpoint = str(Path(out) / "checkpoints" / "step_3")
    assert all(r["checkpoint"] == checkpoint for r in stopped), [r["checkpoint"] for r in stopped]
    assert stopped[victim]["line"] == (f"merak: stopped by {name} after step 3, checkpoint {checkpoint}; resume "
                                       "with: merak train job.yaml --resume latest")
    assert all(r["handler_restored"] for r in stopped), "train() left its signal handlers installed"
    # Resuming from the preemption checkpoint gives the uninterrupted run bit for bit.
    resumed = run_on_ranks(4, faults.resume_body, LAYOUT, out, STEPS, "latest")[0]
    whole = run_on_ranks(4, faults.resume_body, LAYOUT, str(tmp_path / "whole"), STEPS, None)[0]
    assert stopped[0]["losses"] == [whole["losses"][s] for s in (1, 2, 3)]
    assert resumed["losses"] == {s: whole["losses"][s] for s in (4, 5)}
    for key, value in whole["state"].items():
        assert torch.equal(resumed["state"][key], value), key


def test_a_stalled_rank_is_named_by_the_others_within_the_timeout() -> None:
    timeout_s = 2.0
    with pytest.raises(WorkerError) as info:
        run_on_ranks(4, faults.stall_body, LAYOUT, 3, 2, timeout_s)
    text = str(info.value)
    assert "ranks [3] of 4 did not answer" in text, text[-3000:]
    sections = _sections(text)
    for rank in (0, 1, 2):
        section = sections.get(rank, "")
        assert f"SURVIVOR rank {rank} failed after" in section, text[-3000:]
        assert "no heartbeat from rank 3 (pp_rank 1, dp_rank 1, tp_rank 0): stalled (stopped, hung) or dead" in \
            section, section
        elapsed = float(re.search(r"failed after ([0-9.]+) s", section).group(1))  # type: ignore[union-attr]
        assert elapsed < timeout_s + 5, section
