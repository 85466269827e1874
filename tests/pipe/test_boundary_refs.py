"""Flattening a stage boundary leaves no reference cycle holding its tensors.

A cycle there kept a microbatch's output (and through its grad_fn the graph a split backward
retains from I to W) alive until the cyclic garbage collector ran: on the last stage of zb_h1 at
pp=2 every other microbatch's activations outlived its W (tests/core/test_memory_model.py).
"""

from __future__ import annotations

import gc
import weakref

import torch

from merak_pipe.comm import flatten_boundary


def test_flattened_outputs_are_freed_without_the_garbage_collector() -> None:
    x = torch.randn(3, 4, requires_grad=True)
    enabled = gc.isenabled()
    gc.disable()
    try:
        y = (x * 2).sin()
        node = weakref.ref(y)
        spec, tensors = flatten_boundary({"h": y, "n": 3, "pair": (y, None)})
        assert tensors[0] is y and len(tensors) == 2
        del y, tensors, spec
        assert node() is None, "a reference cycle still holds the flattened tensor"
    finally:
        if enabled:
            gc.enable()
