"""The default group that ``merak_core.parallel.layout.init`` creates is destroyed at exit (see [Note: teardown at
exit] in merak_core.parallel.layout): no gloo worker thread is left to run into the interpreter's shutdown, where it
aborted about one bare-torchrun run in six. One process (a world of 1), the exit handler called by hand.
"""

from __future__ import annotations

import atexit
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch.distributed as dist

from merak_core.parallel import layout as layout_module


@pytest.fixture
def exit_handlers(
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[list[tuple[Callable[..., Any], tuple[Any, ...]]]]:
    """The handlers merak_core.parallel.layout registers with atexit (kept here, not run at this process's exit)."""
    if dist.is_initialized():
        pytest.skip("this process already has a default process group")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    registered: list[tuple[Callable[..., Any], tuple[Any, ...]]] = []
    register = atexit.register

    def keep(fn: Callable[..., Any], *args: Any) -> Any:
        if getattr(fn, "__module__", None) != layout_module.__name__:
            return register(fn, *args)
        registered.append((fn, args))
        return fn

    monkeypatch.setattr(atexit, "register", keep)
    try:
        yield registered
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_init_destroys_its_groups_at_exit(exit_handlers: list) -> None:
    layout = layout_module.init(1, 1, 1, device="cpu")
    assert layout.world_size == 1 and dist.is_initialized()
    assert len(exit_handlers) == 1
    fn, args = exit_handlers[0]
    fn(*args)  # what the interpreter does at exit, before it finalises
    assert not dist.is_initialized(), "the process group outlives the script: its gloo threads with it"
    fn(*args)  # the script destroyed it first (the Trainer and merak train do): nothing to do


def test_a_group_the_script_replaced_is_left_alone(exit_handlers: list) -> None:
    layout_module.init(1, 1, 1, device="cpu")
    dist.destroy_process_group()
    dist.init_process_group(
        "gloo", store=dist.HashStore(), rank=0, world_size=1
    )  # the script's own group now
    fn, args = exit_handlers[0]
    fn(*args)
    assert dist.is_initialized()


def test_after_an_uncaught_exception_nothing_is_destroyed(
    exit_handlers: list, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A collective may still wait on a dead peer then: destroying its group would wait with it."""
    layout_module.init(1, 1, 1, device="cpu")
    monkeypatch.setattr(sys, "last_value", RuntimeError("the script failed"), raising=False)
    fn, args = exit_handlers[0]
    fn(*args)
    assert dist.is_initialized()
