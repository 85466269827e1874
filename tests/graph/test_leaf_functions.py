"""Leaf functions (``trace(..., leaf_functions=...)``): calls kept as ``call_function`` nodes that run
when the graph runs, however the model reaches the function (its module's attribute or a name it
imported), with traced or constant arguments; the tracer's replacements are undone afterwards.

The function here reads a module-level setting when it runs, as merak-tp's context-parallel hook reads
the active context: a graph that computed it while tracing would keep the trace-time value.
"""

from __future__ import annotations

import sys

import pytest
import torch
from torch import nn

from merak_graph import partition, trace

OFFSET = [0.0]
"""What :func:`shifted` adds, read when it runs."""


def shifted(x: torch.Tensor, times: int = 1) -> torch.Tensor:
    """``x + times * OFFSET`` with the offset of the moment it runs."""
    return x + times * OFFSET[0]


def arange_now(n: int) -> torch.Tensor:
    """A constant-argument call: ``arange(n) + OFFSET``, decided when it runs."""
    return torch.arange(n, dtype=torch.float64) + OFFSET[0]


_THIS = sys.modules[__name__]


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4).double()
        self.b = nn.Linear(4, 4).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = _THIS.shifted(self.a(x), times=2)  # through the module's attribute
        h = shifted(h)  # through the name imported into this module's globals
        return self.b(h) + _THIS.arange_now(4)  # no traced argument


def _expected(model: Net, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(x)


def test_leaf_functions_run_when_the_graph_runs() -> None:
    torch.manual_seed(0)
    model, x = Net(), torch.randn(3, 4, dtype=torch.float64)
    OFFSET[0] = 0.0
    gm = trace(model, example_inputs=(x,), leaf_functions=(shifted, arange_now))
    assert _THIS.shifted is shifted and _THIS.arange_now is arange_now  # the replacements are undone
    calls = [
        n.target for n in gm.graph.nodes if n.op == "call_function" and n.target in (shifted, arange_now)
    ]
    assert calls == [shifted, shifted, arange_now]
    for offset in (0.0, 1.5):
        OFFSET[0] = offset
        torch.testing.assert_close(gm(x), _expected(model, x), rtol=0, atol=0)
    OFFSET[0] = 0.0


def test_without_leaf_functions_the_trace_time_value_stays() -> None:
    """What leaf functions are for: the same trace without them keeps the trace-time offset."""
    torch.manual_seed(0)
    model, x = Net(), torch.randn(3, 4, dtype=torch.float64)
    OFFSET[0] = 0.0
    gm = trace(model, example_inputs=(x,), method="fx")
    OFFSET[0] = 1.5
    assert not torch.allclose(gm(x), _expected(model, x))
    OFFSET[0] = 0.0


def test_partition_keeps_leaf_functions_in_the_stages() -> None:
    torch.manual_seed(0)
    model, x = Net(), torch.randn(3, 4, dtype=torch.float64)
    OFFSET[0] = 0.0
    part = partition(model, 2, example_inputs=(x,), leaf_functions=(shifted, arange_now), method="uniform")
    OFFSET[0] = 0.75
    out: tuple[torch.Tensor, ...] = (x,)
    for stage in part.stages:
        result = stage(*out)
        out = result if isinstance(result, tuple) else (result,)
    torch.testing.assert_close(out[0], _expected(model, x), rtol=0, atol=0)
    OFFSET[0] = 0.0


def test_export_with_leaf_functions_is_refused() -> None:
    model, x = Net(), torch.randn(3, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"leaf_functions need method='fx'"):
        trace(model, example_inputs=(x,), leaf_functions=(shifted,), method="export")
