"""Bodies of the life-of-a-job tests: a full disk during a save, a deleted checkpoint, a finished job resumed."""

from __future__ import annotations

import errno
from typing import Any

import torch.distributed as dist

from tests.e2e._checkpoint_support import LogCapture, make_trainer


def disk_full_body(kwargs: dict[str, Any], victim: int, full_at_step: int) -> dict[str, Any]:
    """Train; the DCP write of step ``full_at_step`` on rank ``victim`` fails with ENOSPC. What every rank raised."""
    from torch.distributed.checkpoint import FileSystemWriter

    original = FileSystemWriter.write_data

    def write_data(self: Any, plan: Any, planner: Any) -> Any:
        if dist.get_rank() == victim and f"step_{full_at_step}.tmp" in str(self.path):
            raise OSError(errno.ENOSPC, "No space left on device")
        return original(self, plan, planner)

    trainer = make_trainer("gpt", kwargs)
    FileSystemWriter.write_data = write_data  # type: ignore[method-assign]
    try:
        trainer.train()
    except Exception as exc:  # noqa: BLE001 - the error is the result
        return {"error": f"{type(exc).__name__}: {exc}", "step": trainer.global_step}
    finally:
        FileSystemWriter.write_data = original  # type: ignore[method-assign]
    return {"error": None, "step": trainer.global_step}


def resume_body(kwargs: dict[str, Any], path: str = "latest") -> dict[str, Any]:
    """Resume ``path``; the step, the warnings and infos, the history of train() and the final parameters."""
    trainer = make_trainer("gpt", kwargs)
    with LogCapture() as logs:
        step = trainer.resume(path)
        history = trainer.train()
    return {
        "resumed_step": step,
        # Without the optional matplotlib the run also warns that it draws no loss.png: not what
        # these tests are about, and present or not depending on the environment.
        "warnings": [m for m in logs.messages("WARNING") if not m.startswith("matplotlib is not installed")],
        "infos": logs.messages("INFO"),
        "losses": {int(h["step"]): h["loss"] for h in history},
        "final_step": trainer.global_step,
        "state": trainer.full_state_dict(),
    }
