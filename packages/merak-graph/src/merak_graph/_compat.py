"""The only place where merak_graph touches private or version-dependent torch APIs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten  # private torch API (pytree helpers)

__all__ = ["flop_formula", "is_export_guard_node", "tree_flatten", "tree_unflatten"]


def _flop_registry() -> dict[Any, Callable[..., int]]:
    try:
        from torch.utils.flop_counter import flop_registry  # private module attribute

        return dict(flop_registry)
    except ImportError:  # pragma: no cover - very old torch
        return {}


_REGISTRY = _flop_registry()


def flop_formula(func: Any) -> Callable[..., int] | None:
    """The flop formula torch registers for an aten overload packet, or None."""
    packet = getattr(func, "overloadpacket", func)
    return _REGISTRY.get(packet)


_ASSERT_TARGETS: set[Any] = set()
for _name in ("_assert_tensor_metadata", "_assert_scalar", "sym_constrain_range_for_size", "_assert_async"):
    _op = getattr(torch.ops.aten, _name, None)
    if _op is not None:
        _ASSERT_TARGETS.add(_op)
        for _overload in _op.overloads():
            _ASSERT_TARGETS.add(getattr(_op, _overload))


def is_export_guard_node(node: torch.fx.Node) -> bool:
    """True for the input-guard call and assertion nodes that ``torch.export`` inserts."""
    if node.op == "call_module" and str(node.target) == "_guards_fn":
        return True
    return node.op == "call_function" and node.target in _ASSERT_TARGETS and not node.users


from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402  (private torch API)


class FlopCountingMode(TorchDispatchMode):
    """Adds up the flops of every aten op dispatched under it (works on meta tensors)."""

    def __init__(self) -> None:
        super().__init__()
        self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = flop_formula(func)
        if formula is not None:
            self.flops += int(formula(*args, **kwargs, out_val=out))
        return out


__all__ += ["FlopCountingMode"]
