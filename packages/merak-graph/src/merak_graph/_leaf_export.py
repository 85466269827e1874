"""torch.export with opaque leaf modules (private helper of ``tracing``).

[Note: leaf placeholders] ``torch.export`` inlines every module. To keep a leaf
module opaque, each leaf instance's ``forward`` is temporarily replaced by a
call to a placeholder custom op ``merak_leaf::leaf_<k>`` whose fake
implementation returns tensors of the shapes the leaf produced in an eager
pre-run with the same inputs (so the leaf's own code, with its data-dependent
branches or collectives, never runs under export). After export, each
placeholder call is replaced by a ``call_module`` node of the leaf, with the
leaf's original arguments. The placeholder op itself never runs.

[Note: leaf outputs] A leaf may return a tensor or any pytree (tuple, list,
dict) of tensors and ``None``s, e.g. transformers attention's
``(attn_output, None)``. The placeholder op returns only the tensors; the
``None``s are structure, rebuilt around them at the same places (they are
``None`` whatever the input values, as the eager pre-run shows for these
shapes). In the final graph the ``call_module`` node returns the leaf's own
structure, and each use of the k-th tensor reads it by its pytree path (a
chain of ``getitem``), not by its index among the tensors.

Limits: a leaf's outputs must be tensors or ``None`` (an int, a string or any
other value is refused: it could depend on the inputs and would be baked in);
its non-tensor arguments are baked in as constants; the eager pre-run needs
inputs and weights the leaf can run on (real ones, or meta when the leaf runs
on meta).
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from merak_graph._compat import (
    export_compiling_state,
    meta_collectives,
    tree_flatten,
    tree_flatten_with_path,
    tree_unflatten,
)

_LIB: torch.library.Library | None = None
_COUNTER = itertools.count()
_FAKE_SPECS: dict[str, list[list[tuple[tuple[int, ...], torch.dtype]]]] = {}


class _Call:
    """One recorded leaf call: its tensors' shapes, its output structure and where the tensors are in it."""

    def __init__(self, name: str, out: Any) -> None:
        flat, self.spec = tree_flatten(out)
        bad = [
            (i, type(v).__name__)
            for i, v in enumerate(flat)
            if v is not None and not isinstance(v, torch.Tensor)
        ]
        if bad:
            raise TypeError(
                f"leaf module {name!r} returns non-tensor values {bad} (flat output position, type); "
                "an opaque leaf returns tensors and None only (see [Note: leaf outputs])"
            )
        self.size = len(flat)
        self.tensor_pos = [i for i, v in enumerate(flat) if isinstance(v, torch.Tensor)]
        self.tensors = [(tuple(flat[i].shape), flat[i].dtype) for i in self.tensor_pos]
        paths = [path for path, _ in tree_flatten_with_path(out)[0]]
        self.paths = [paths[i] for i in self.tensor_pos]
        """The pytree key path of each tensor (``SequenceKey(idx)`` / ``MappingKey(key)`` entries)."""

    def rebuild(self, tensors: list[Any]) -> Any:
        flat: list[Any] = [None] * self.size
        for i, t in zip(self.tensor_pos, tensors, strict=True):
            flat[i] = t
        return tree_unflatten(flat, self.spec)


def _key(entry: Any) -> Any:
    for attr in ("idx", "key"):  # SequenceKey / MappingKey
        if hasattr(entry, attr):
            return getattr(entry, attr)
    raise TypeError(f"leaf output path entry {entry!r}: only tuples, lists and dicts are supported")


def _read_path(graph: fx.Graph, value: fx.Node, path: tuple[Any, ...]) -> fx.Node:
    import operator

    for entry in path:
        value = graph.call_function(operator.getitem, (value, _key(entry)))
    return value


def _library() -> torch.library.Library:
    global _LIB
    if _LIB is None:
        _LIB = torch.library.Library("merak_leaf", "FRAGMENT")
    return _LIB


def _new_op() -> tuple[str, Any]:
    name = f"leaf_{next(_COUNTER)}"
    lib = _library()
    lib.define(f"{name}(Tensor[] inputs, int call) -> Tensor[]")

    def fake(inputs: list[torch.Tensor], call: int) -> list[torch.Tensor]:
        device = inputs[0].device if inputs else torch.device("cpu")
        return [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in _FAKE_SPECS[name][call]]

    def never(inputs: list[torch.Tensor], call: int) -> list[torch.Tensor]:
        raise RuntimeError("merak_leaf placeholder ops only exist during tracing")

    lib.impl(name, never, "CompositeExplicitAutograd")
    torch.library.register_fake(f"merak_leaf::{name}", fake, lib=lib)
    return name, getattr(torch.ops.merak_leaf, name).default


def export_with_leaves(
    model: nn.Module,
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    is_leaf: Callable[[nn.Module, str], bool],
) -> fx.GraphModule:
    leaves: list[tuple[str, nn.Module]] = []
    for name, mod in model.named_modules():
        if name and is_leaf(mod, name) and not any(name.startswith(p + ".") for p, _ in leaves):
            leaves.append((name, mod))
    # 1. eager pre-run: record every leaf call's output shapes.
    records: dict[str, list[_Call]] = {n: [] for n, _ in leaves}
    hooks = []
    for name, mod in leaves:

        def hook(_m: nn.Module, _a: Any, out: Any, name: str = name) -> None:
            records[name].append(_Call(name, out))

        hooks.append(mod.register_forward_hook(hook))
    on_meta = any(t.is_meta for t in itertools.chain(model.parameters(), model.buffers()))
    try:
        # On meta, the pre-run takes export's own code path (values cannot be read; see export_compiling_state).
        with (
            torch.no_grad(),
            meta_collectives(),
            export_compiling_state() if on_meta else contextlib.nullcontext(),
        ):
            model(*args, **kwargs)
    finally:
        for h in hooks:
            h.remove()
    # 2. placeholder ops and patched forwards.
    ops: dict[Any, tuple[str, nn.Module]] = {}
    templates: dict[tuple[Any, int], tuple[Any, list[int]]] = {}
    originals: list[tuple[nn.Module, Any]] = []
    for name, mod in leaves:
        op_name, op = _new_op()
        _FAKE_SPECS[op_name] = [r.tensors for r in records[name]]
        ops[op] = (name, mod)
        counter = itertools.count()

        def forward(*a: Any, _op: Any = op, _name: str = name, _counter: Any = counter, **k: Any) -> Any:
            call = next(_counter)
            flat, spec = tree_flatten((a, k))
            tensor_pos = [i for i, v in enumerate(flat) if isinstance(v, torch.Tensor)]
            templates[(_op, call)] = (spec, flat)
            outs = _op([flat[i] for i in tensor_pos], call)
            return records[_name][call].rebuild(list(outs))

        originals.append((mod, mod.__dict__.get("forward")))
        mod.forward = forward  # type: ignore[method-assign]
    try:
        ep = torch.export.export(model, args, kwargs=dict(kwargs), strict=False)
    finally:
        for mod, original in originals:
            if original is None:
                del mod.forward
            else:
                mod.forward = original  # type: ignore[method-assign]
    gm = ep.module()
    assert isinstance(gm, fx.GraphModule)
    # 3. placeholder calls -> call_module nodes with the original arguments.
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in ops:
            continue
        name, mod = ops[node.target]
        tensor_nodes, call = node.args
        spec, flat = templates[(node.target, call)]
        it = iter(tensor_nodes)
        flat_args = [next(it) if isinstance(v, torch.Tensor) else v for v in flat]
        call_args, call_kwargs = tree_unflatten(flat_args, spec)
        _install_module(gm, name, mod)
        with gm.graph.inserting_before(node):
            new = gm.graph.call_module(name, tuple(call_args), dict(call_kwargs))
        new.meta = dict(node.meta)
        record = records[name][call]
        for user in list(
            node.users
        ):  # getitem(op, k): the k-th tensor, read by its path ([Note: leaf outputs])
            assert user.target.__name__ == "getitem" and isinstance(user.args[1], int)  # type: ignore[union-attr]
            with gm.graph.inserting_before(user):
                value = _read_path(gm.graph, new, record.paths[user.args[1]])
            if value is not new:
                value.meta = dict(user.meta)
            user.replace_all_uses_with(value)
            gm.graph.erase_node(user)
        gm.graph.erase_node(node)
    gm.graph.lint()
    gm.recompile()
    return gm


def _install_module(root: nn.Module, path: str, module: nn.Module) -> None:
    *prefix, last = path.split(".")
    mod = root
    for item in prefix:
        nxt = getattr(mod, item, None)
        if not isinstance(nxt, nn.Module):
            nxt = nn.Module()
            setattr(mod, item, nxt)
        mod = nxt
    setattr(mod, last, module)
