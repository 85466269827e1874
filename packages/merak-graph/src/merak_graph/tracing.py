"""Trace a model into a flat ``torch.fx.GraphModule`` (the proxy graph that gets sharded).

Two tracers:

- ``torch.export`` (non-strict) gives an aten-level graph; it handles modern
  code with shape arithmetic and Python control flow on shapes (transformers
  5.x models with ``use_cache=False``). Needs example inputs (meta tensors are
  fine). The graph is flattened: parameters appear as ``get_attr`` nodes named
  by their original fully-qualified names.
- ``torch.fx`` symbolic tracing keeps module calls as ``call_module`` nodes.

Both honour ``leaf_modules``: instances of the given classes (or the given
qualified names) stay opaque ``call_module`` nodes, so modules whose forward
cannot be traced (data-dependent control flow, custom autograd Functions with
collectives, e.g. tensor-parallel layers) are kept whole (for export see
[Note: leaf placeholders] in ``_leaf_export``: the leaves run once eagerly on
the example inputs to learn their output shapes).

fx alone honours ``leaf_functions``: each call of one of these functions made
while tracing becomes one opaque ``call_function`` node, whatever its arguments
(see [Note: leaf functions]); the function then runs when the graph runs, never
while tracing. Export would trace through them, so it is not used with them.

``method="auto"`` uses fx when leaf modules are given and export otherwise,
falling back to the other tracer when the first fails. On failure the error
names the module and the source line that broke tracing and suggests
``leaf_modules`` or explicit split points.

In the returned graph every placeholder is named after ``input_names`` and the
output node returns the flat tuple of output tensors (one tensor for a model
returning a tensor, the leaves of a ``ModelOutput`` otherwise; see
``gm.meta["merak_output_names"]``).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import io
import linecache
import logging
import sys
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from merak_graph._compat import is_export_guard_node
from merak_graph.errors import InputMismatchError, TraceError

__all__ = ["trace", "normalize_inputs"]

logger = logging.getLogger(__name__)

LeafSpec = type | str


def normalize_inputs(
    model: nn.Module,
    example_inputs: Sequence[Any] | Mapping[str, Any] | torch.Tensor | None,
    input_names: Sequence[str] | None,
) -> tuple[list[str], list[Any] | None, bool]:
    """(input names, example values in that order or None, whether to pass them by keyword)."""
    params = inspect.signature(model.forward).parameters
    positional = [
        n
        for n, p in params.items()
        if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    ]
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    if isinstance(example_inputs, Mapping):
        names = list(example_inputs)
        if input_names is not None and list(input_names) != names:
            raise InputMismatchError(
                f"input_names={list(input_names)} differ from the keys of example_inputs {names}: "
                "give one of them, or make them agree"
            )
        unknown = [n for n in names if n not in params]
        if unknown and not any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params.values()):
            raise InputMismatchError(
                f"example_inputs has keys {unknown} that {type(model).__name__}.forward does not accept "
                f"(its parameters: {list(params)})"
            )
        return names, list(example_inputs.values()), True
    values = list(example_inputs) if example_inputs is not None else None
    if input_names is None:
        if values is None:
            raise InputMismatchError(
                "give example_inputs (a tuple or a dict) or input_names to trace a model"
            )
        if len(values) > len(positional):
            raise InputMismatchError(
                f"{len(values)} example inputs given but {type(model).__name__}.forward takes "
                f"{len(positional)} positional inputs {positional}"
            )
        return positional[: len(values)], values, False
    names = list(input_names)
    if values is not None and len(values) != len(names):
        raise InputMismatchError(
            f"input_names has {len(names)} names {names} but {len(values)} example inputs were given: "
            "give one example value per name"
        )
    by_keyword = all(n in params for n in names) and names != positional[: len(names)]
    if not by_keyword and len(names) > len(positional):
        raise InputMismatchError(
            f"input_names={names} has more entries than {type(model).__name__}.forward's positional "
            f"parameters {positional}"
        )
    return names, values, by_keyword


def _leaf_predicate(model: nn.Module, leaf_modules: Sequence[LeafSpec]) -> Callable[[nn.Module, str], bool]:
    classes = tuple(x for x in leaf_modules if isinstance(x, type))
    names = {x for x in leaf_modules if isinstance(x, str)}
    for name in names:
        try:
            model.get_submodule(name)
        except AttributeError as exc:
            raise ValueError(f"leaf_modules names {name!r}, which is not a submodule of the model") from exc
    bad = [x for x in leaf_modules if not isinstance(x, (type, str))]
    if bad:
        raise ValueError(f"leaf_modules must hold module classes or qualified names, got {bad}")

    def is_leaf(module: nn.Module, qualname: str) -> bool:
        return (bool(classes) and isinstance(module, classes)) or qualname in names

    return is_leaf


class _Tracer(fx.Tracer):
    def __init__(
        self, is_leaf: Callable[[nn.Module, str], bool], leaf_functions: Sequence[Callable[..., Any]] = ()
    ) -> None:
        # autowrap_functions: fx wraps the functions where a traced forward's globals name them.
        super().__init__(autowrap_functions=tuple(leaf_functions))
        self._is_leaf = is_leaf
        self._leaf_functions = tuple(leaf_functions)

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if self._is_leaf(m, module_qualified_name):
            return True
        return super().is_leaf_module(m, module_qualified_name)

    def trace(self, root: Any, concrete_args: dict[str, Any] | None = None) -> fx.Graph:
        with _leaf_calls(self, self._leaf_functions):
            return super().trace(root, concrete_args)


# [Note: leaf functions] A leaf function (``trace(..., leaf_functions=...)``) must run when the graph
# runs, never while tracing: e.g. a hook that consults a context entered around each step (context
# parallel attention, the global positions of a rank's tokens). While fx traces, the function is
# replaced where a model reaches it: in its module and in each package above that re-exports it
# (``pkg.mod.fn``, ``pkg.fn``), by a call that records one ``call_function`` node of the function,
# even when no argument is traced (its value is decided at run time, so it is never a constant); fx's
# ``autowrap_functions`` covers a forward that imported it by name (it records a node when an
# argument is traced). The replacements are undone when the trace ends.


def _homes(fn: Callable[..., Any]) -> list[Any]:
    """The loaded modules that may hold ``fn`` as an attribute: its own and the packages above it."""
    parts = str(getattr(fn, "__module__", "") or "").split(".")
    names = [".".join(parts[:i]) for i in range(len(parts), 0, -1)]
    return [sys.modules[n] for n in names if n and n in sys.modules]


@contextlib.contextmanager
def _leaf_calls(tracer: fx.Tracer, functions: Sequence[Callable[..., Any]]) -> Iterator[None]:
    """Calls of ``functions`` become ``call_function`` nodes of ``tracer`` ([Note: leaf functions])."""
    patched: list[tuple[Any, str, Callable[..., Any]]] = []

    def recorder(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def record(*args: Any, **kwargs: Any) -> Any:
            return tracer.create_proxy("call_function", fn, args, kwargs)

        return record

    try:
        for fn in functions:
            record = recorder(fn)
            for module in _homes(fn):
                for name, value in list(vars(module).items()):
                    if value is fn:
                        patched.append((module, name, fn))
                        setattr(module, name, record)
        yield
    finally:
        for module, name, fn in reversed(patched):
            setattr(module, name, fn)


def _trace_fx(
    model: nn.Module,
    names: list[str],
    by_keyword: bool,
    leaf_modules: Sequence[LeafSpec],
    static_kwargs: Mapping[str, Any],
    leaf_functions: Sequence[Callable[..., Any]] = (),
) -> fx.GraphModule:
    tracer = _Tracer(_leaf_predicate(model, leaf_modules), leaf_functions)
    params = inspect.signature(model.forward).parameters
    concrete: dict[str, Any] = dict(static_kwargs)
    if by_keyword:
        for pname, p in params.items():
            if (
                pname not in names
                and pname not in concrete
                and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
            ):
                concrete[pname] = p.default if p.default is not inspect.Parameter.empty else None
    graph = tracer.trace(model, concrete_args=concrete or None)
    gm = fx.GraphModule(tracer.root, graph, type(model).__name__)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    # Concrete args leave placeholders that are not used; drop those not in `names`.
    kept = []
    for node in placeholders:
        if by_keyword and node.target not in names:
            if node.users:
                raise TraceError(f"input {node.target!r} is used by the model but not listed in input_names")
            gm.graph.erase_node(node)
        else:
            kept.append(node)
    if by_keyword:
        kept.sort(key=lambda n: names.index(str(n.target)))
    if len(kept) != len(names):
        if len(kept) < len(names):
            raise InputMismatchError(f"the traced forward has {len(kept)} inputs but input_names has {names}")
        for node in kept[len(names) :]:
            if node.users:
                raise InputMismatchError(
                    f"forward input {node.target!r} is used but not given: add it to input_names/example_inputs"
                )
            gm.graph.erase_node(node)
        kept = kept[: len(names)]
    _finish(gm, kept, names)
    return gm


EXPORT_LOGGERS = ("torch.export", "torch._export", "torch.fx.experimental.symbolic_shapes")
"""torch loggers that report a failed export at length (the error says it in a few lines)."""


@contextlib.contextmanager
def _quiet_export() -> Iterator[None]:
    """Keep a failing ``torch.export`` from printing its partial graph and warnings.

    [Note: quiet export] On an error, torch.export prints the partial graph to stderr (thousands of
    lines for a transformer, from every rank) and its loggers add warnings, before the fx fallback
    runs and :class:`TraceError` reports both tracers in a few lines. Here stderr is held back while
    export runs and written out only when it succeeds; the export loggers report errors only.
    """
    held = io.StringIO()
    levels = {name: logging.getLogger(name).level for name in EXPORT_LOGGERS}
    for name in EXPORT_LOGGERS:
        logging.getLogger(name).setLevel(logging.CRITICAL)
    try:
        with contextlib.redirect_stderr(held):
            yield
    finally:
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)
    sys.stderr.write(held.getvalue())  # only after a success (an exception skips this line)


def _trace_export(
    model: nn.Module,
    names: list[str],
    values: list[Any] | None,
    by_keyword: bool,
    static_kwargs: Mapping[str, Any],
    leaf_modules: Sequence[LeafSpec] = (),
) -> fx.GraphModule:
    if values is None:
        raise InputMismatchError(
            "method='export' needs example_inputs (meta tensors are fine for a meta model)"
        )
    device = _model_device(model)
    if device is not None and device.type == "meta":
        values = [v.to("meta") if isinstance(v, torch.Tensor) else v for v in values]
    if by_keyword:
        args: tuple[Any, ...] = ()
        kwargs = {**dict(zip(names, values, strict=True)), **dict(static_kwargs)}
    else:
        args, kwargs = tuple(values), dict(static_kwargs)
    with _quiet_export():
        if leaf_modules:
            from merak_graph._leaf_export import export_with_leaves

            gm = export_with_leaves(model, args, kwargs, _leaf_predicate(model, leaf_modules))
        else:
            gm = torch.export.export(model, args, kwargs=kwargs, strict=False).module()
    assert isinstance(gm, fx.GraphModule)
    for node in list(gm.graph.nodes):
        if is_export_guard_node(node):
            gm.graph.erase_node(node)
    if hasattr(gm, "_guards_fn"):
        delattr(gm, "_guards_fn")
    gm._forward_pre_hooks.clear()  # export's input-spec check; shapes are checked by merak_graph
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    # Placeholders follow the flattened (args, kwargs); static kwargs are constants and unused.
    kept = placeholders[: len(names)]
    for node in placeholders[len(names) :]:
        if node.users:
            raise TraceError(f"exported graph reads input {node.name!r} that is not one of {names}")
        gm.graph.erase_node(node)
    _finish(gm, kept, names)
    return gm


def _finish(gm: fx.GraphModule, placeholders: list[fx.Node], names: list[str]) -> None:
    """Name placeholders after the inputs, flatten the output, drop pytree codegen, recompile."""
    graph = gm.graph
    for node, name in zip(placeholders, names, strict=True):
        node.target = name
        node.name = name
        node.type = None
    # Order placeholders as `names`.
    first = next(iter(graph.nodes))
    for node in reversed(placeholders):
        first.prepend(node)
        first = node
    out = next(n for n in reversed(graph.nodes) if n.op == "output")
    leaves, output_names = _flatten_output(out.args[0])
    out.args = (leaves[0] if len(leaves) == 1 else tuple(leaves),)
    graph.set_codegen(fx.graph.CodeGen())
    graph.eliminate_dead_code()
    graph.lint()
    gm.recompile()
    gm.meta["merak_input_names"] = list(names)
    gm.meta["merak_output_names"] = output_names


def _flatten_output(value: Any, prefix: str = "output") -> tuple[list[Any], list[str]]:
    if isinstance(value, fx.Node) or value is None or isinstance(value, (int, float, bool)):
        if value is None:
            return [], []
        return [value], [prefix]
    leaves: list[Any] = []
    names: list[str] = []
    items: list[tuple[str, Any]]
    if isinstance(value, Mapping):
        items = [(str(k), v) for k, v in value.items()]
    elif isinstance(value, (tuple, list)):
        items = [(str(i), v) for i, v in enumerate(value)]
    else:
        items = []
        for k in getattr(value, "keys", lambda: [])():
            items.append((str(k), value[k]))
    for key, item in items:
        sub_leaves, sub_names = _flatten_output(item, key if prefix == "output" else f"{prefix}.{key}")
        leaves += sub_leaves
        names += sub_names
    return leaves, names


def _model_device(model: nn.Module) -> torch.device | None:
    for t in [*model.parameters(), *model.buffers()]:
        return t.device
    return None


def trace(
    model: nn.Module,
    *,
    example_inputs: Sequence[Any] | Mapping[str, Any] | torch.Tensor | None = None,
    input_names: Sequence[str] | None = None,
    leaf_modules: Sequence[LeafSpec] = (),
    method: str = "auto",
    static_kwargs: Mapping[str, Any] | None = None,
    leaf_functions: Sequence[Callable[..., Any]] = (),
) -> fx.GraphModule:
    """Trace ``model`` into a flat ``torch.fx.GraphModule`` whose inputs are ``input_names``.

    ``example_inputs``: a tuple in ``input_names`` order, or a dict name -> value
    (passed by keyword, e.g. ``{"input_ids": ids}`` for a transformers model).
    ``input_names`` alone (no example values) is enough for ``method="fx"``.
    ``leaf_modules``: module classes or qualified names kept as opaque calls (fx).
    ``static_kwargs``: keyword arguments fixed at trace time, e.g. ``{"use_cache": False}``.
    ``leaf_functions``: functions whose calls stay opaque ``call_function`` nodes that run when the
    graph runs ([Note: leaf functions]; fx only).
    ``method``: ``"auto"``, ``"export"`` or ``"fx"``.
    """
    if method not in ("auto", "export", "fx"):
        raise ValueError(f"method={method!r} is not one of 'auto', 'export', 'fx'")
    if leaf_functions and method == "export":
        raise ValueError(
            "leaf_functions need method='fx' or 'auto' (export would trace through them and keep "
            "their trace-time results): use method='fx'"
        )
    names, values, by_keyword = normalize_inputs(model, example_inputs, input_names)
    _leaf_predicate(model, leaf_modules)  # validates the leaf specs before any tracer runs
    static = dict(static_kwargs or {})
    if method == "auto" and leaf_functions:
        order = ["fx"]
    elif method == "auto":
        order = ["fx", "export"] if leaf_modules or values is None else ["export", "fx"]
    else:
        order = [method]
    errors: list[tuple[str, BaseException]] = []
    for how in order:
        try:
            if how == "fx":
                gm = _trace_fx(model, names, by_keyword, leaf_modules, static, leaf_functions)
            else:
                gm = _trace_export(model, names, values, by_keyword, static, leaf_modules)
            gm.meta["merak_trace_method"] = how
            logger.debug("traced %s with %s: %d nodes", type(model).__name__, how, len(gm.graph.nodes))
            return gm
        except (InputMismatchError, ValueError) as exc:
            if isinstance(exc, InputMismatchError):
                raise
            errors.append((how, exc))
        except Exception as exc:  # noqa: BLE001 - any tracer failure is reported with its location
            errors.append((how, exc))
    raise _trace_error(model, errors) from errors[-1][1]


def _trace_error(model: nn.Module, errors: list[tuple[str, BaseException]]) -> TraceError:
    lines = [f"could not trace {type(model).__name__}:"]
    culprit: tuple[str | None, str | None] | None = (
        None  # (qualified name, class) of the first located module
    )
    for how, exc in errors:
        where, mod_name, mod_cls = _locate(model, exc)
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        lines.append(f"  {how}: {type(exc).__name__}: {first[:300]}")
        if where:
            lines.append(f"    in module {mod_name!r} ({mod_cls}) at {where}")
            culprit = culprit or (mod_name, mod_cls)
    if culprit:
        lines.append(
            f"Fix: make that module opaque with trace(..., leaf_modules=({culprit[1]},), method='fx'), "
            "or partition with explicit split_points=[...] around it."
        )
    else:
        lines.append(
            "Fix: pass leaf_modules=(...) for the module that breaks tracing, or explicit split_points."
        )
    error = TraceError("\n".join(lines))
    if culprit:
        error.module_name, error.module_class = culprit
    return error


def _locate(model: nn.Module, exc: BaseException) -> tuple[str | None, str | None, str | None]:
    """The innermost frame of the traceback that runs a submodule of ``model``."""
    names = {id(m): n for n, m in model.named_modules()}
    found: tuple[str | None, str | None, str | None] = (None, None, None)
    tb = exc.__traceback__
    for frame, lineno in traceback.walk_tb(tb):
        owner = frame.f_locals.get("self")
        if isinstance(owner, nn.Module) and id(owner) in names:
            src = linecache.getline(frame.f_code.co_filename, lineno).strip()
            where = f"{frame.f_code.co_filename}:{lineno}: {src}"
            found = (where, names[id(owner)] or "<root>", type(owner).__name__)
    return found
