"""The step watchdog names phase, stage, action, microbatch and the silent rank before the timeout.

In-pool, pp=2 on gloo: rank 1 stops its heartbeat and sleeps inside its pipeline step (a blocked
peer); rank 0 waits for it in a p2p operation of the round. Before the 20 s timeout, rank 0's
watchdog logs its step, the phase (the pipeline step), its pipeline stage, action and microbatch,
and the heartbeat's diagnosis naming rank 1 as silent; then rank 1 resumes and the step finishes
normally. Plus the pure parts: the flight recorder's environment for ``merak train`` and the
position sentence of merak-pipe.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import pytest

from tests.support.dist import run_on_ranks

TIMEOUT_S = 20.0
WARN_AFTER_S = 3.0
BLOCKED_S = 9.0


def blocked_peer_body() -> dict[str, Any]:
    import tempfile

    import torch.distributed as dist

    from merak_core import Trainer
    from merak_core.config import TrainingArguments
    from tests.core.test_memory_model import _addition

    model, data, _ = _addition()
    args = TrainingArguments(
        output_dir=tempfile.mkdtemp(prefix="merak-watchdog-"),
        pp=2,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=1,
        comm_timeout_s=TIMEOUT_S,
        logging_steps=1,
        seed=0,
    )
    trainer = Trainer(model, args, data)
    engine = trainer.engine
    rank = dist.get_rank()
    engine.watchdog.warn_after_s = WARN_AFTER_S if rank == 0 else 10 * TIMEOUT_S
    if rank == 1:
        real_step = engine.runner.step

        def blocked_step(*a: Any, **k: Any) -> Any:
            assert engine.heartbeat is not None
            engine.heartbeat.stop()  # silent, as a rank stopped by SIGSTOP or hung holding the GIL
            time.sleep(BLOCKED_S)
            engine.heartbeat.start()
            return real_step(*a, **k)

        engine.runner.step = blocked_step  # type: ignore[method-assign]
    start = time.monotonic()
    history = trainer.train()
    return {
        "rank": rank,
        "reports": list(engine.watchdog.reports),
        "seconds": time.monotonic() - start,
        "loss": history[0]["loss"] if history else None,
    }


def test_watchdog_names_where_a_rank_waits_and_the_silent_peer() -> None:
    results = run_on_ranks(2, blocked_peer_body, timeout_s=120)
    waiting, blocked = results
    assert blocked["reports"] == []
    assert len(waiting["reports"]) == 1, waiting["reports"]
    message = waiting["reports"][0]
    assert message.startswith("rank 0 (pp_rank 0, dp_rank 0, tp_rank 0), step 1: still in pipeline step"), (
        message
    )
    assert f"of the {TIMEOUT_S:g} s timeout" in message
    assert re.search(r"pipeline position: stage 0, action \S+, microbatch \d+", message), message
    assert re.search(r"no heartbeat from rank 1\b.*stalled", message), message
    waited = float(re.search(r"after ([0-9.]+) s", message).group(1))  # type: ignore[union-attr]
    assert WARN_AFTER_S <= waited < TIMEOUT_S
    assert waiting["loss"] is not None or blocked["loss"] is not None  # the step then finished


def test_flight_recorder_env_for_nccl_ranks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from merak_core.cli.train import nccl_flight_recorder_env
    from merak_core.run.watchdog import flight_recorder_env

    env = flight_recorder_env(str(tmp_path), {"TORCH_NCCL_TRACE_BUFFER_SIZE": "50"})
    assert "TORCH_NCCL_TRACE_BUFFER_SIZE" not in env  # the user's value wins
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert env["TORCH_FR_DUMP_TEMP_FILE"] == f"{tmp_path}/nccl_flight_recorder/rank_"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert nccl_flight_recorder_env(str(tmp_path), {}) == {}  # gloo ranks: nothing to record
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    env = nccl_flight_recorder_env(str(tmp_path), {})
    assert env["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "2000"
    assert (tmp_path / "nccl_flight_recorder").is_dir()


def test_position_sentence() -> None:
    from merak_pipe.ir import Action
    from merak_pipe.p2p_order import describe_step

    assert describe_step(None) == "no pipeline action yet this round"
    action = Action.parse("1B3")
    assert describe_step(action) == f"stage 1, action {action}, microbatch 3"


def test_a_finished_watchdog_does_not_keep_its_job_alive() -> None:
    """The thread that lives on for an idle minute holds the watchdog weakly: the object behind
    ``diagnose`` (the engine, with its layout's process groups and their gloo threads or NCCL
    communicators) goes when its Trainer goes. It stayed a minute, so consecutive Trainers in one
    process (a sweep; the test pool's ranks) each kept their groups alive for that minute."""
    import gc
    import weakref

    from merak_core.run.watchdog import StepWatchdog

    class Job:
        def diagnose(self) -> str:
            return "no diagnosis"

    job = Job()
    watchdog = StepWatchdog(timeout_s=20.0, who="rank 0", diagnose=job.diagnose)
    with watchdog.watch("the pipeline step", 1):
        pass
    thread = watchdog._thread
    assert thread is not None and thread.is_alive()
    gone = weakref.ref(job)
    del job, watchdog
    gc.collect()
    assert gone() is None, "the watchdog's thread keeps the job alive"
    thread.join(timeout=5.0)  # it notices at its next poll (1 s) that the watchdog is gone
    assert not thread.is_alive()
