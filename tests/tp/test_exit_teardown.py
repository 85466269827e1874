"""A bare script on its own default group that never calls ``dist.destroy_process_group()``: merak_tp's layers
end that group at a normal exit (see [Note: groups at exit] in merak_tp._exit), so no gloo worker thread of it
runs into the interpreter's shutdown, where it aborted about one bare-torchrun run in six.
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

import merak_tp
from tests.support.exit_handlers import kept_exit_handlers


@pytest.fixture
def exit_handlers(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Callable[[], Any]]]:
    """A default group of one rank made as a script makes it; the handlers merak_tp registers, kept here."""
    yield from kept_exit_handlers(monkeypatch, "merak_tp._exit")


def _column_row_pair() -> None:
    torch.manual_seed(0)
    fc1 = merak_tp.ColumnParallelLinear(8, 16, group=None)
    fc2 = merak_tp.RowParallelLinear(16, 8, group=None)
    fc2(F.gelu(fc1(torch.randn(2, 8)))).sum().backward()
    assert fc1.weight.grad is not None and fc2.weight.grad is not None


def test_the_layers_end_the_default_group_at_exit(exit_handlers: list) -> None:
    _column_row_pair()
    assert len(exit_handlers) == 1, "one handler per process, however many layers"
    exit_handlers[0]()  # what the interpreter does at exit, before it finalises
    assert not dist.is_initialized(), "the default group outlives the script: its gloo threads with it"
    exit_handlers[0]()  # already gone (the script or merak-core destroyed it): nothing to do


def test_after_an_uncaught_exception_nothing_is_destroyed(
    exit_handlers: list, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A collective may still wait on a dead peer then: destroying its group would wait with it."""
    _column_row_pair()
    monkeypatch.setattr(sys, "last_value", RuntimeError("the script failed"), raising=False)
    exit_handlers[0]()
    assert dist.is_initialized()
