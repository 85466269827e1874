"""Flattening of nested outputs for a torch without ``torch.utils._pytree`` (used by ``_compat`` only).

The subset merak_graph needs, with torch's results for it: tuples, lists, dicts (insertion order, a
dict subclass rebuilt by its class), named tuples; everything else (``None`` included) is a leaf.
Key paths use torch's attribute names: ``idx`` (sequences), ``key`` (mappings), ``name`` (named tuples).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class SequenceKey:
    idx: int


@dataclass(frozen=True)
class MappingKey:
    key: Any


@dataclass(frozen=True)
class GetAttrKey:
    name: str


@dataclass(frozen=True)
class TreeSpec:
    """``kind`` is None for a leaf; ``context`` the dict keys or the named-tuple class."""

    kind: type | None
    context: Any
    children: tuple[TreeSpec, ...]

    @property
    def num_leaves(self) -> int:
        return 1 if self.kind is None else sum(c.num_leaves for c in self.children)


_LEAF = TreeSpec(None, None, ())


def _is_namedtuple(value: Any) -> bool:
    return isinstance(value, tuple) and hasattr(type(value), "_fields")


def _children(value: Any) -> tuple[type | None, Any, list[tuple[Any, Any]]]:
    """(kind, context, [(key entry, child)]) of one level; kind None for a leaf."""
    if _is_namedtuple(value):
        return type(value), type(value), [(GetAttrKey(f), getattr(value, f)) for f in type(value)._fields]
    if isinstance(value, (tuple, list)) and type(value) in (tuple, list):
        return type(value), None, [(SequenceKey(i), v) for i, v in enumerate(value)]
    if isinstance(value, dict):
        return type(value), list(value), [(MappingKey(k), v) for k, v in value.items()]
    return None, None, []


def tree_flatten_with_path(tree: Any) -> tuple[list[tuple[tuple[Any, ...], Any]], TreeSpec]:
    kind, context, items = _children(tree)
    if kind is None:
        return [((), tree)], _LEAF
    leaves: list[tuple[tuple[Any, ...], Any]] = []
    specs = []
    for entry, child in items:
        child_leaves, child_spec = tree_flatten_with_path(child)
        leaves.extend(((entry, *path), leaf) for path, leaf in child_leaves)
        specs.append(child_spec)
    return leaves, TreeSpec(kind, context, tuple(specs))


def tree_flatten(tree: Any) -> tuple[list[Any], TreeSpec]:
    leaves, spec = tree_flatten_with_path(tree)
    return [leaf for _, leaf in leaves], spec


def tree_unflatten(leaves: Any, spec: TreeSpec) -> Any:
    values = list(leaves)
    if len(values) != spec.num_leaves:
        raise ValueError(f"tree_unflatten: {len(values)} leaves for a structure of {spec.num_leaves}")
    return _build(iter(values), spec)


def _build(values: Any, spec: TreeSpec) -> Any:
    if spec.kind is None:
        return next(values)
    children = [_build(values, child) for child in spec.children]
    if spec.kind in (tuple, list):
        return spec.kind(children)
    if isinstance(spec.context, type):  # a named tuple
        return spec.context(*children)
    if spec.kind is dict:
        return dict(zip(spec.context, children, strict=True))
    try:
        return spec.kind(zip(spec.context, children, strict=True))
    except TypeError:  # a dict subclass whose constructor takes keywords only
        return spec.kind(**dict(zip(spec.context, children, strict=True)))
