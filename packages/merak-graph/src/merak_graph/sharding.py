"""Graph sharding: cut a traced graph into a chain of shard modules.

[Note: boundary values] Walk the graph's compute nodes in topological order.
The *boundary* at the position between two nodes is the set of values produced
before it (model inputs count as produced before everything) and used after it.
A position is a valid cut only when every boundary value is a tensor (shape
arithmetic such as ``x.size(1)`` must not cross a cut). ``shard`` cuts at valid
positions with a small boundary so that shards have about equal cost; shard k
takes boundary k as positional arguments and returns boundary k+1 as a tuple,
so a value that skips several shards (a residual, an attention mask, rotary
tables) is passed through the shards in between and the chain runs as a plain
sequence. Broadcast values are carried, never recomputed.

Parameters and buffers (``get_attr`` nodes) are not boundary values: each shard
that reads one holds it under its original fully-qualified name (the same
tensor object as the model's), which is how a tied weight ends up in two shards.

Not done here: assigning shards to stages (see ``partitioning``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from merak_graph._compat import is_persistent
from merak_graph.costs import NodeCost, ValueSpec, annotate_costs
from merak_graph.errors import PartitionError

__all__ = ["BoundaryValue", "Shard", "ShardedGraph", "shard", "module_path", "natural_shard_count"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BoundaryValue:
    """One value crossing a cut: its graph name, shape and dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype | None

    @property
    def nbytes(self) -> int:
        return ValueSpec(True, self.shape, self.dtype).nbytes


@dataclass
class Shard:
    """One link of the chain: a GraphModule over a contiguous run of nodes."""

    index: int
    module: fx.GraphModule
    inputs: list[BoundaryValue]
    outputs: list[BoundaryValue]
    node_names: list[str]
    time_s: float
    flops: int
    param_bytes: int
    activation_bytes: int
    returns_model_output: bool = False


@dataclass
class ShardedGraph:
    """The shard chain of a traced graph, plus where it was cut."""

    graph_module: fx.GraphModule
    shards: list[Shard]
    cut_positions: list[int]
    input_names: list[str]
    output_names: list[str]
    valid_positions: int = 0
    notes: list[str] = field(default_factory=list)

    def run(self, *inputs: Any) -> Any:
        """Run the chain in sequence (a reference for tests)."""
        values: Any = inputs
        for s in self.shards:
            values = s.module(*values)
        return values


def module_path(node: fx.Node) -> str:
    """The qualified name of the innermost module that produced ``node`` ('' for the root)."""
    if node.op == "call_module":
        return str(node.target)
    stack = node.meta.get("nn_module_stack")
    if stack:
        last = list(stack.values())[-1]
        path = last[0] if isinstance(last, tuple) else str(last)
        return "" if path.startswith("L__self__") and path == "L__self__" else str(path)
    return ""


def _spec_of(node: fx.Node) -> ValueSpec:
    spec = node.meta.get("merak_value")
    if not isinstance(spec, ValueSpec):
        raise RuntimeError(f"node {node.name} has no merak_value: run annotate_costs first")
    return spec


def _cost_of(node: fx.Node) -> NodeCost:
    cost = node.meta.get("merak_cost")
    return cost if isinstance(cost, NodeCost) else NodeCost(0, 0, 0, 0.0)


class _Analysis:
    """Per-position boundary sizes and prefix costs of a graph's compute nodes."""

    def __init__(self, gm: fx.GraphModule) -> None:
        nodes = list(gm.graph.nodes)
        self.placeholders = [n for n in nodes if n.op == "placeholder"]
        self.body = [n for n in nodes if n.op not in ("placeholder", "get_attr", "output")]
        self.output = next(n for n in nodes if n.op == "output")
        n_body = len(self.body)
        self.index = {n: i for i, n in enumerate(self.body)}
        self.index.update({n: -1 for n in self.placeholders})
        # Position p (0..n_body) lies before body[p]; a value defined at d, last used at u crosses d < p <= u.
        self.last_use: dict[fx.Node, int] = {}
        values = self.placeholders + self.body
        for v in values:
            last = -2
            for user in v.users:
                last = max(last, n_body if user.op == "output" else self.index.get(user, -2))
            self.last_use[v] = last
        delta_bytes = [0] * (n_body + 2)
        delta_bad = [0] * (n_body + 2)
        for v in values:
            d, u = self.index[v], self.last_use[v]
            if u <= d:
                continue
            spec = _spec_of(v)
            lo, hi = d + 1, u  # inclusive range of positions crossed
            delta_bytes[lo] += spec.nbytes
            delta_bytes[hi + 1] -= spec.nbytes
            if not spec.is_tensor:
                delta_bad[lo] += 1
                delta_bad[hi + 1] -= 1
        self.boundary_bytes = [0] * (n_body + 1)
        self.valid = [False] * (n_body + 1)
        acc_b = acc_bad = 0
        for p in range(n_body + 1):
            acc_b += delta_bytes[p]
            acc_bad += delta_bad[p]
            self.boundary_bytes[p] = acc_b
            self.valid[p] = acc_bad == 0 and 0 < p < n_body
        self.prefix = [0.0] * (n_body + 1)
        for i, n in enumerate(self.body):
            self.prefix[i + 1] = self.prefix[i] + _cost_of(n).time_s

    def crossing(self, p: int) -> list[fx.Node]:
        """Values crossing position p, in definition order (model inputs first)."""
        if p == 0:
            return list(self.placeholders)
        out = [v for v in self.placeholders if self.last_use[v] >= p]
        out += [v for v in self.body[:p] if self.last_use[v] >= p]
        return out


_NEIGHBOURHOOD = 16  # nodes on each side within which a natural cut has the smallest boundary


def _natural_positions(an: _Analysis) -> list[int]:
    """Valid positions whose boundary is the smallest within +-_NEIGHBOURHOOD nodes (one per plateau)."""
    n = len(an.valid)
    out: list[int] = []
    for p in range(n):
        if not an.valid[p]:
            continue
        lo, hi = max(0, p - _NEIGHBOURHOOD), min(n, p + _NEIGHBOURHOOD + 1)
        floor = min(an.boundary_bytes[q] for q in range(lo, hi) if an.valid[q])
        if an.boundary_bytes[p] > floor:
            continue
        if out and an.prefix[out[-1]] == an.prefix[p] and an.boundary_bytes[out[-1]] == an.boundary_bytes[p]:
            continue  # same cut in effect: no cost between them
        out.append(p)
    return out


def _choose_cuts(an: _Analysis, num_shards: int) -> list[int]:
    """Cuts nearest to equal-cost targets, smallest boundary first within a target's window.

    Only natural positions are used while they suffice for ``num_shards``; otherwise any valid one.
    """
    natural = _natural_positions(an)
    valid = [p for p in range(len(an.valid)) if an.valid[p]]
    # Natural cuts only, unless more shards are asked than there are natural cuts.
    candidates = natural if len(natural) + 1 >= num_shards else valid
    if not candidates or num_shards <= 1:
        return []
    if num_shards > len(candidates):
        return candidates
    total = an.prefix[-1]
    if total <= 0:  # no cost information: cut by node count
        prefix = [float(i) for i in range(len(an.prefix))]
        total = float(len(an.body))
    else:
        prefix = an.prefix
    target = total / num_shards
    cuts: list[int] = []
    last = 0
    for j in range(1, num_shards):
        goal = j * target
        later = [p for p in candidates if p > last and prefix[p] > prefix[last]]
        if not later:
            break
        window = [p for p in later if abs(prefix[p] - goal) <= target / 2]
        if window:
            best = min(window, key=lambda p: (an.boundary_bytes[p], abs(prefix[p] - goal)))
        else:
            best = min(later, key=lambda p: (abs(prefix[p] - goal), an.boundary_bytes[p]))
        if prefix[best] >= total:
            break
        cuts.append(best)
        last = best
    # Greedy windows can leave fewer cuts than asked: split the most expensive shards further.
    unused = sorted(set(candidates) - set(cuts))
    while len(cuts) < num_shards - 1 and unused:
        bounds = [0, *sorted(cuts), len(an.body)]
        spans = sorted(range(len(bounds) - 1), key=lambda k: prefix[bounds[k]] - prefix[bounds[k + 1]])
        added = False
        for k in spans:
            lo, hi = bounds[k], bounds[k + 1]
            inside = [p for p in unused if lo < p < hi]
            if inside:
                mid = (prefix[lo] + prefix[hi]) / 2
                best = min(inside, key=lambda p: (abs(prefix[p] - mid), an.boundary_bytes[p]))
                cuts.append(best)
                unused.remove(best)
                added = True
                break
        if not added:
            break
    return sorted(cuts)


def natural_shard_count(gm: fx.GraphModule) -> int:
    """How many shards the graph has when cut at every natural position (annotated graph)."""
    return len(_natural_positions(_Analysis(gm))) + 1


def _split_point_cuts(an: _Analysis, split_points: Sequence[str]) -> list[int]:
    cuts = []
    for name in split_points:
        pos = next(
            (
                i
                for i, n in enumerate(an.body)
                if module_path(n) == name or module_path(n).startswith(name + ".")
            ),
            None,
        )
        if pos is None:
            raise PartitionError(
                f"split point {name!r} matches no module in the traced graph: give a module name "
                "such as 'layers.4' (see model.named_modules())"
            )
        if pos == 0:
            continue
        if not an.valid[pos]:
            crossing = [v.name for v in an.crossing(pos) if not _spec_of(v).is_tensor]
            raise PartitionError(
                f"split point {name!r} falls at a position where non-tensor values {crossing} cross the cut: "
                "choose the enclosing module or a neighbour"
            )
        cuts.append(pos)
    return sorted(set(cuts))


def _boundary(values: list[fx.Node]) -> list[BoundaryValue]:
    out = []
    for v in values:
        spec = _spec_of(v)
        out.append(BoundaryValue(v.name, spec.shape, spec.dtype))
    return out


def _install(root: nn.Module, path: str, value: Any, persistent: bool = True) -> None:
    *prefix, last = path.split(".")
    mod = root
    for item in prefix:
        nxt = getattr(mod, item, None)
        if nxt is None:
            nxt = nn.Module()
            setattr(mod, item, nxt)
        mod = nxt
    if hasattr(mod, last) and getattr(mod, last) is value:
        return
    if isinstance(value, nn.Parameter):
        mod.register_parameter(last, value)
    elif isinstance(value, torch.Tensor):
        mod.register_buffer(last, value, persistent=persistent)
    else:
        setattr(mod, last, value)


def _attribute_candidates(
    gm: fx.GraphModule, model: nn.Module | None, target: str
) -> Iterator[tuple[Any, nn.Module, str]]:
    """``(object, owner, attribute name)`` at dotted ``target`` in the original model, then in ``gm``."""
    *prefix, last = target.split(".")
    for source in (model, gm):
        if source is None:
            continue
        try:
            owner = source.get_submodule(".".join(prefix)) if prefix else source
            obj = getattr(owner, last)
        except AttributeError:
            continue
        yield obj, owner, last


def _resolve(gm: fx.GraphModule, model: nn.Module | None, target: str) -> tuple[Any, bool]:
    """The object at ``target``, preferring the original model's (same identity); and its persistence."""
    for obj, owner, last in _attribute_candidates(gm, model, target):
        return obj, is_persistent(owner, last)
    raise RuntimeError(f"graph attribute {target!r} not found on the model")


def _build_shard_module(
    gm: fx.GraphModule,
    model: nn.Module | None,
    an: _Analysis,
    lo: int,
    hi: int,
    index: int,
    last: bool,
    canonical: dict[int, str],
) -> tuple[fx.GraphModule, list[fx.Node], list[fx.Node]]:
    def canonical_target(target: str) -> str:
        obj, _ = _resolve(gm, model, target)
        return canonical.get(id(obj), target)

    inputs = an.crossing(lo)
    outputs = [] if last else an.crossing(hi)
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for v in inputs:
        env[v] = g.placeholder(v.name)
        env[v].meta = dict(v.meta)
    attrs: dict[str, fx.Node] = {}

    def lookup(x: fx.Node) -> fx.Node:
        if x.op == "get_attr":
            target = canonical_target(str(x.target))
            if target not in attrs:
                attrs[target] = g.get_attr(target)
                attrs[target].meta = dict(x.meta)
            return attrs[target]
        return env[x]

    modules: list[str] = []
    for node in an.body[lo:hi]:
        env[node] = g.node_copy(node, lookup)
        if node.op == "call_module":
            modules.append(str(node.target))
    if last:
        g.output(fx.node.map_arg(an.output.args[0], lookup))
    else:
        g.output(tuple(env[v] for v in outputs))
    root = nn.Module()
    for target in modules:
        obj, _ = _resolve(gm, model, target)
        _install(root, target, obj)
    for target in attrs:
        obj, persistent = _resolve(gm, model, target)
        _install(root, target, obj, persistent)
    sm = fx.GraphModule(root, g, class_name=f"Shard{index}")
    # GraphModule registers plain tensors as persistent buffers; restore non-persistence.
    for target in attrs:
        _, persistent = _resolve(gm, model, target)
        if not persistent:
            *prefix, name = target.split(".")
            owner = sm.get_submodule(".".join(prefix)) if prefix else sm
            owner.register_buffer(name, owner.get_buffer(name), persistent=False)
    return sm, inputs, outputs


def shard(
    gm: fx.GraphModule,
    num_shards: int | None = None,
    *,
    example_inputs: Sequence[Any] | None = None,
    split_points: Sequence[str] | None = None,
    model: nn.Module | None = None,
) -> ShardedGraph:
    """Cut ``gm`` into a chain of shards (see [Note: boundary values]).

    ``num_shards``: how many shards to aim for, at most (and by default) the number of natural
    cuts: valid positions whose boundary is the smallest among nearby positions.
    ``split_points``: module names; the graph is cut right before the first node of
    each, instead of the automatic choice.
    ``example_inputs``: needed when ``gm`` is not yet annotated by ``annotate_costs``.
    ``model``: the original model, so shards hold its tensors (same objects, same names).
    """
    if any("merak_value" not in n.meta for n in gm.graph.nodes if n.op != "output"):
        if example_inputs is None:
            raise ValueError(
                "the graph has no cost annotation: pass example_inputs or call annotate_costs first"
            )
        annotate_costs(gm, example_inputs)
    if num_shards is not None and num_shards < 1:
        raise ValueError(f"num_shards={num_shards} must be >= 1")
    an = _Analysis(gm)
    n_valid = sum(an.valid)
    if split_points:
        cuts = _split_point_cuts(an, split_points)
    else:
        cuts = _choose_cuts(an, num_shards or len(_natural_positions(an)) + 1)
    bounds = [0, *cuts, len(an.body)]
    canonical: dict[int, str] = {}
    if model is not None:
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            canonical.setdefault(id(t), name)
    shards: list[Shard] = []
    for k in range(len(bounds) - 1):
        lo, hi = bounds[k], bounds[k + 1]
        last = k == len(bounds) - 2
        module, ins, outs = _build_shard_module(gm, model, an, lo, hi, k, last, canonical)
        seen: set[int] = set()
        param_bytes = 0
        for t in [*module.parameters(), *module.buffers()]:
            if id(t) not in seen:
                seen.add(id(t))
                param_bytes += ValueSpec(True, tuple(t.shape), t.dtype).nbytes
        costs = [_cost_of(n) for n in an.body[lo:hi]]
        shards.append(
            Shard(
                index=k,
                module=module,
                inputs=_boundary(ins),
                outputs=_boundary(outs),
                node_names=[n.name for n in an.body[lo:hi]],
                time_s=sum(c.time_s for c in costs),
                flops=sum(c.flops for c in costs),
                param_bytes=param_bytes,
                activation_bytes=sum(c.output_bytes for c in costs),
                returns_model_output=last,
            )
        )
    if shards:
        model_out = an.output.args[0]
        out_nodes = [
            x
            for x in (model_out if isinstance(model_out, (tuple, list)) else (model_out,))
            if isinstance(x, fx.Node)
        ]
        shards[-1].outputs = _boundary(out_nodes)
    logger.debug(
        "sharded %d nodes into %d shards (%d valid cut positions)", len(an.body), len(shards), n_valid
    )
    return ShardedGraph(
        graph_module=gm,
        shards=shards,
        cut_positions=cuts,
        input_names=list(gm.meta.get("merak_input_names", [p.name for p in an.placeholders])),
        output_names=list(gm.meta.get("merak_output_names", ["output"])),
        valid_positions=n_valid,
    )
