"""Code that runs as plain Python under torch.compile while what it calls is compiled, and as
itself under torch.export.

[Note: region bookkeeping is not traced] A region's own code (its forward, the sequence gather on
entry, the chunking, the probe) sets and reads its ``_RegionState``: the mode its TP layers run in
and the handles the region waits on. torch.compile must not trace that code. Traced inside a
compiled block (``training.compile: regional``, Llama at tp = 2 with sequence parallelism,
``aot_eager``), the compiled code of the third and fourth blocks' regions wrote ``mode = "sp"``
into the second block's region state instead of their own (dynamo traced the ``ModuleSpec``
registry lookup and read the state from a fixed registry entry, guarded on its type only): their
column layers then found no region mode, all-reduced their input gradients themselves, and the
region's entry reduce-scattered them again (the region's input gradient summed twice; every weight
about 2e-2 off eager after two steps). So the region's methods and helpers are
``torch.compiler.disable(recursive=False)``d (:func:`_not_traced`): their frames run as plain
Python, while what they call is still compiled (``base_forward``, the original module's forward:
its attention or MLP compute between the TP layers, which stay eager themselves).

torch.export (merak-graph's trace of a pipelined model, and its eager pre-run of leaf modules under
export's flags) refuses a non-recursive disable: "Non-recursive torch.compiler.disable is not
supported with torch.export". :func:`_not_traced` therefore asks ``torch.compiler.is_exporting()``
on every call and, while exporting, runs the plain function, which is what export traced before.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch

_F = TypeVar("_F", bound=Callable[..., Any])


def _not_traced(fn: _F) -> _F:
    """Run ``fn``'s own frame as plain Python under torch.compile, compiling what it calls; under
    torch.export, ``fn`` itself ([Note: region bookkeeping is not traced])."""
    disabled = torch.compiler.disable(fn, recursive=False)

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_exporting():  # read per call: export refuses the non-recursive disable
            return fn(*args, **kwargs)
        return disabled(*args, **kwargs)

    return run  # type: ignore[return-value]
