"""The exit handlers a library registers with ``atexit``, kept for a test to call by hand.

Used by the groups-at-exit tests of merak-pipe and merak-tp (tests/pipe and tests/tp
``test_exit_teardown.py``): each library registers one handler per process that ends a default group
a bare script left (see [Note: groups at exit] in ``merak_pipe._exit`` / ``merak_tp._exit``).
"""

from __future__ import annotations

import atexit
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch.distributed as dist


def kept_exit_handlers(monkeypatch: pytest.MonkeyPatch, module: str) -> Iterator[list[Callable[[], Any]]]:
    """A default group of one rank made as a script makes it; the handlers ``module`` registers, kept.

    A generator for a fixture: yields the list the handlers land in, destroys the group afterwards.
    """
    if dist.is_initialized():
        pytest.skip("this process already has a default process group")
    if module in sys.modules:  # a handler registered earlier in this process: register afresh
        monkeypatch.setattr(sys.modules[module], "_registered", False)
    registered: list[Callable[[], Any]] = []
    register = atexit.register

    def keep(fn: Callable[..., Any], *args: Any) -> Any:
        if getattr(fn, "__module__", None) != module:
            return register(fn, *args)
        registered.append(lambda: fn(*args))
        return fn

    monkeypatch.setattr(atexit, "register", keep)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield registered
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
