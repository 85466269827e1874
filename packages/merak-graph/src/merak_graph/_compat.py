"""The only place where merak_graph touches private or version-dependent torch APIs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def _load_pytree() -> tuple[Callable[..., Any], Callable[..., Any], Callable[..., Any]]:
    """(tree_flatten, tree_flatten_with_path, tree_unflatten): torch's private pytree helpers (the
    structures torch.export and transformers use), else merak_graph's own for tuples, lists, dicts
    and named tuples (``_pytree_fallback``)."""
    module: Any
    try:
        import torch.utils._pytree as module  # private torch API
    except ImportError:
        import merak_graph._pytree_fallback as module
    return module.tree_flatten, module.tree_flatten_with_path, module.tree_unflatten


tree_flatten, tree_flatten_with_path, tree_unflatten = _load_pytree()

__all__ = ["flop_formula", "is_export_guard_node", "tree_flatten", "tree_flatten_with_path", "tree_unflatten"]


def _flop_registry() -> dict[Any, Callable[..., int]] | None:
    """torch's table of flop formulas by aten overload packet, or None where this torch has none."""
    try:
        from torch.utils.flop_counter import flop_registry  # undocumented module attribute

        return flop_registry
    except ImportError:
        return None


def flop_formula(func: Any) -> Callable[..., int] | None:
    """The flop formula torch registers for an aten overload packet, or None."""
    registry = _flop_registry() or {}
    packet = getattr(func, "overloadpacket", func)
    return registry.get(packet)


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


_REGISTRY_MODES: dict[type, type] = {}


def _registry_mode_class() -> type | None:
    """A dispatch mode adding up ``flop_formula`` of every aten op (private base class), or None."""
    try:
        from torch.utils._python_dispatch import TorchDispatchMode  # private torch API
    except ImportError:
        return None
    if TorchDispatchMode not in _REGISTRY_MODES:

        class _RegistryMode(TorchDispatchMode):  # type: ignore[misc,valid-type]
            def __init__(self, registry: dict[Any, Callable[..., int]]) -> None:
                super().__init__()
                self.registry = registry
                self.flops = 0

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
                kwargs = kwargs or {}
                out = func(*args, **kwargs)
                formula = self.registry.get(getattr(func, "overloadpacket", func))
                if formula is not None:
                    self.flops += int(formula(*args, **kwargs, out_val=out))
                return out

        _REGISTRY_MODES[TorchDispatchMode] = _RegistryMode
    return _REGISTRY_MODES[TorchDispatchMode]


class FlopCountingMode:
    """Adds up the flops of every aten op dispatched under it (works on meta tensors): ``flops``.

    Over torch's private dispatch-mode base and flop table where both exist; else through the public
    ``torch.utils.flop_counter.FlopCounterMode`` (the same formulas; it also counts the parts of an op
    without a formula that it can decompose).
    """

    def __init__(self) -> None:
        self.flops = 0
        registry, mode_class = _flop_registry(), _registry_mode_class()
        self._mode: Any
        if registry is not None and mode_class is not None:
            self._mode = mode_class(registry)
        else:
            from torch.utils.flop_counter import FlopCounterMode

            self._mode = FlopCounterMode(display=False)

    def __enter__(self) -> FlopCountingMode:
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._mode.__exit__(*exc)
        total = getattr(self._mode, "flops", None)
        self.flops = int(self._mode.get_total_flops() if total is None else total)


__all__ += ["FlopCountingMode"]


# --------------------------------------------------------------------------- collectives on meta tensors

import contextlib  # noqa: E402
from collections.abc import Iterator  # noqa: E402

_COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "broadcast",
    "reduce",
    "all_to_all",
    "all_to_all_single",
    "barrier",
)


class _DoneWork:
    """Stands in for the Work handle of an async collective that did nothing."""

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def _all_meta(values: Any) -> bool:
    flat, _ = tree_flatten(values)
    tensors = [v for v in flat if isinstance(v, torch.Tensor)]
    return bool(tensors) and all(t.is_meta for t in tensors)


@contextlib.contextmanager
def meta_collectives() -> Iterator[None]:
    """torch.distributed collectives whose tensors are all on meta do nothing (shapes are preserved:
    their outputs are preallocated by the caller). Lets tensor-parallel leaf modules run on meta
    tensors for shape and cost propagation without a process group."""
    import torch.distributed as dist

    originals = {name: getattr(dist, name) for name in _COLLECTIVES if hasattr(dist, name)}

    def wrap(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def collective(*args: Any, **kwargs: Any) -> Any:
            if _all_meta((args, kwargs)):
                return _DoneWork() if kwargs.get("async_op") else None
            return fn(*args, **kwargs)

        collective.__name__ = name
        return collective

    for name, fn in originals.items():
        setattr(dist, name, wrap(name, fn))
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


__all__ += ["meta_collectives"]


@contextlib.contextmanager
def export_compiling_state() -> Iterator[None]:
    """The compiling/exporting flags ``torch.export`` sets while it traces (``torch.compiler.is_exporting()``).

    An eager run under it takes the code path the export will take: libraries such as
    transformers then skip the value-dependent checks (``mask.all()``) that meta tensors cannot answer.
    """
    context: Any
    try:
        from torch._export.utils import _compiling_state_context as context  # private torch API
    except ImportError:
        context = None
    if context is not None:
        with context():
            yield
        return
    # Without it: torch.compiler's public predicates answer True (for callers that look them up
    # when they ask, as transformers does; a function bound at import time is not reached).
    originals = torch.compiler.is_compiling, torch.compiler.is_exporting
    torch.compiler.is_compiling = lambda: True  # type: ignore[assignment]
    torch.compiler.is_exporting = lambda: True  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.compiler.is_compiling, torch.compiler.is_exporting = originals  # type: ignore[assignment]


__all__ += ["export_compiling_state"]


# --------------------------------------------------------------------------- gradient hooks of a tensor

_TENSOR_HOOKS = "_backward_hooks"  # torch's private table of the hooks ``register_hook`` put on a tensor
RECORDED_GRAD_HOOKS = "_merak_grad_hooks"
"""A parameter's attribute listing hooks registered with a record (merak-tp's ``register_grad_hook``
writes it under this name): what :func:`carry_grad_hooks` re-registers where torch's table is missing."""


def carry_grad_hooks(old: torch.Tensor, new: torch.Tensor) -> None:
    """``new`` takes ``old``'s place: it runs the gradient hooks registered on ``old``.

    torch's hook table where it exists (every hook, however registered); else the hooks recorded on
    ``old`` (:data:`RECORDED_GRAD_HOOKS`) are registered on ``new`` through the public ``register_hook``.
    """
    if not old.requires_grad:
        return
    try:
        hooks = getattr(old, _TENSOR_HOOKS)
    except AttributeError:
        for hook in old.__dict__.get(RECORDED_GRAD_HOOKS, ()):
            new.register_hook(hook)
        new.__dict__[RECORDED_GRAD_HOOKS] = list(old.__dict__.get(RECORDED_GRAD_HOOKS, ()))
        return
    if hooks:
        setattr(new, _TENSOR_HOOKS, hooks)


__all__ += ["RECORDED_GRAD_HOOKS", "carry_grad_hooks"]


# --------------------------------------------------------------------------- buffer persistence

_NON_PERSISTENT = "_non_persistent_buffers_set"  # nn.Module's private set of non-persistent buffer names


def is_persistent(owner: torch.nn.Module, name: str) -> bool:
    """False only for a buffer of ``owner`` registered with ``persistent=False`` (a parameter, a persistent
    buffer or any other attribute: True). nn.Module's private set where it exists; else whether the
    buffer is in ``owner``'s state dict (public, slower: the state dict of ``owner``'s whole subtree)."""
    names = getattr(owner, _NON_PERSISTENT, None)
    if isinstance(names, set):
        return name not in names
    if name not in dict(owner.named_buffers(recurse=False)):
        return True
    return name in owner.state_dict(keep_vars=True)


__all__ += ["is_persistent"]
