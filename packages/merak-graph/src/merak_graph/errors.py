"""Exceptions raised by merak_graph (all subclass ``ValueError`` or ``RuntimeError``)."""

from __future__ import annotations

__all__ = ["TraceError", "PartitionError", "InputMismatchError"]


class TraceError(RuntimeError):
    """Tracing failed; the message names the module and source line that broke it."""

    module_name: str | None = None
    """The qualified name of the submodule whose code broke tracing (None when no frame was found)."""
    module_class: str | None = None
    """That submodule's class name."""


class PartitionError(ValueError):
    """No partition satisfies the request (too few shards, memory limit, bad split points)."""


class InputMismatchError(ValueError):
    """Inputs given to a traced model or stage do not match the traced signature."""
