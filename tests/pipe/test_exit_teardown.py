"""A bare script on its own default group that never calls ``dist.destroy_process_group()``: the pipeline
runtime ends that group at a normal exit (see [Note: groups at exit] in merak_pipe._exit), so no gloo worker
thread of it runs into the interpreter's shutdown, where it aborted about one bare-torchrun run in six.
One process (a world of 1), the exit handler called by hand.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import merak_pipe
from tests.support.exit_handlers import kept_exit_handlers


@pytest.fixture
def exit_handlers(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Callable[[], Any]]]:
    """A default group of one rank made as a script makes it; the handlers merak_pipe registers, kept here."""
    yield from kept_exit_handlers(monkeypatch, "merak_pipe._exit")


def _run_one_step() -> None:
    torch.manual_seed(0)
    stage = merak_pipe.PipelineStage(nn.Linear(4, 3), stage_index=0, num_stages=1, device="cpu")
    schedule = merak_pipe.build_schedule("1f1b", num_stages=1, num_microbatches=2)
    runner = merak_pipe.PipelineRunner([stage], schedule, loss_fn=F.mse_loss)
    loss = runner.step(torch.randn(4, 4), torch.randn(4, 3))
    assert loss is not None and torch.isfinite(loss)


def test_the_runner_ends_the_default_group_at_exit(exit_handlers: list) -> None:
    _run_one_step()
    _run_one_step()
    assert len(exit_handlers) == 1, "one handler per process, however many runners"
    exit_handlers[0]()  # what the interpreter does at exit, before it finalises
    assert not dist.is_initialized(), "the default group outlives the script: its gloo threads with it"
    exit_handlers[0]()  # already gone (the script or merak-core destroyed it): nothing to do


def test_after_an_uncaught_exception_nothing_is_destroyed(
    exit_handlers: list, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A collective may still wait on a dead peer then: destroying its group would wait with it."""
    _run_one_step()
    monkeypatch.setattr(sys, "last_value", RuntimeError("the script failed"), raising=False)
    exit_handlers[0]()
    assert dist.is_initialized()
