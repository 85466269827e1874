"""Split backward: ``I`` (input gradients only) now and ``W`` (parameter gradients) later.

[Note: split backward]
``I`` computes only the gradients of the stage inputs (``torch.autograd.grad``, graph
retained): autograd then skips the weight-gradient formulas. On the way it keeps the gradient
entering every *boundary* node, a node on the input path with a branch that leads only to
parameters (for ``y = x @ W.T + b``: the addmm node). ``W`` runs ``torch.autograd.grad`` from
those kept gradients to the branch's parameters only, so together ``I`` and ``W`` cost about
one ``B`` (the idea of torch.distributed.pipelining's ``stage_backward_weight``, written with
public autograd APIs). Graphs where that split would count a path twice (a parameter reachable
from both sides of a boundary, e.g. one weight used in two layers) fall back to
``backward(inputs=parameters)`` in ``W``: exact, but it walks the graph again.

This module is autograd-graph machinery only: which stage runs what, and when, is the schedule's
and the runner's business (``stage.py``, ``runner.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

__all__: list[str] = []


class _WeightPlan:
    """How ``W`` finds the parameter gradients of one autograd graph after ``I`` ([Note: split backward]).

    The graph from ``roots`` is walked once. A node on the input path (it reaches one of the
    ``targets`` of ``I``) whose other children lead only to parameters is a *boundary*: ``I``
    runs it (for the input path) and a pre-hook keeps the gradient entering it; ``W`` then runs
    ``torch.autograd.grad`` from that gradient to exactly those parameters, so only the
    parameter branches run again. Roots that do not reach the input path are differentiated
    whole in ``W``. When a parameter is reachable both from a boundary's parameter branch and
    from its input path (e.g. one weight used by two layers), running the branches separately
    would count a path twice, so the plan falls back to one ``backward(inputs=parameters)``.

    [Note: weight-gradient groups]
    Each ``torch.autograd.grad`` call has a fixed cost (a graph task, a walk of the graph below its
    outputs), so ``W`` runs boundaries together where that is exact: one call from several
    boundaries to the union of their branch parameters runs, from each boundary, every edge that
    leads to one of those parameters, so a boundary may join a group only when none of the group's
    branch parameters lies below its input path (and none of its own below theirs); then each
    boundary contributes through its branch alone, as in its own call. Sibling linears (an
    attention block's query, key and value) share a group; a chain (one layer's linears in
    sequence) does not. Parameter sets are bit masks (one bit per parameter), so the walk and the
    checks are integer operations.
    """

    def __init__(
        self,
        roots: list[torch.Tensor],
        grads: list[torch.Tensor] | None,
        targets: list[torch.Tensor],
        params: list[nn.Parameter],
    ) -> None:
        self.roots, self.grads, self.params = roots, grads, params
        self.fallback = not targets or not params
        self.boundaries: list[tuple[Any, list[nn.Parameter]]] = []
        self.groups: list[list[int]] = []
        """Indices into ``boundaries`` run by one ``torch.autograd.grad`` each ([Note: weight-gradient groups])."""
        self._group_params: list[list[nn.Parameter]] = []
        self.captured: dict[int, tuple[torch.Tensor | None, ...]] = {}
        self.pure_roots: list[tuple[torch.Tensor, torch.Tensor | None, list[nn.Parameter]]] = []
        if not self.fallback and roots:
            self._analyse(targets)

    def _params_of(self, mask: int) -> list[nn.Parameter]:
        return [p for i, p in enumerate(self.params) if mask >> i & 1]

    def _walk(
        self, targets: list[torch.Tensor]
    ) -> tuple[list[Any], dict[Any, list[Any]], dict[Any, bool], dict[Any, int]]:
        """Iterative post-order walk from the roots: children, reaches-a-target and parameter mask below every node."""
        get_edge = torch.autograd.graph.get_gradient_edge
        target_nodes = {get_edge(t).node for t in targets}
        param_bit = {get_edge(p).node: 1 << i for i, p in enumerate(self.params)}
        root_nodes = [r.grad_fn if r.grad_fn is not None else get_edge(r).node for r in self.roots]
        reaches: dict[Any, bool] = {}
        below: dict[Any, int] = {}
        children: dict[Any, list[Any]] = {}
        stack: list[tuple[Any, bool]] = [(n, False) for n in root_nodes]
        while stack:
            node, done = stack.pop()
            if node in reaches:
                continue
            if not done:
                kids = [c for c, _ in node.next_functions if c is not None]
                children[node] = kids
                stack.append((node, True))
                stack.extend((c, False) for c in kids if c not in reaches)
                continue
            hit = node in target_nodes
            mask = param_bit.get(node, 0)
            for c in children[node]:
                hit = hit or reaches[c]
                mask |= below[c]
            reaches[node] = hit
            below[node] = mask
        return root_nodes, children, reaches, below

    def _analyse(self, targets: list[torch.Tensor]) -> None:
        root_nodes, children, reaches, below = self._walk(targets)
        sides: list[tuple[int, int]] = []  # per boundary: (branch mask, input-side mask)
        for node, kids in children.items():
            if not reaches[node]:
                continue
            branch = input_side = 0
            for c in kids:
                if reaches[c]:
                    input_side |= below[c]
                else:
                    branch |= below[c]
            if not branch:
                continue
            if branch & input_side:
                self.fallback = True
                return
            self.boundaries.append((node, self._params_of(branch)))
            sides.append((branch, input_side))
        self._group(sides)
        for k, (root, node) in enumerate(zip(self.roots, root_nodes, strict=True)):
            if not reaches[node] and below[node]:
                grad = None if self.grads is None else self.grads[k]
                self.pure_roots.append((root, grad, self._params_of(below[node])))

    def _group(self, sides: list[tuple[int, int]]) -> None:
        """Greedy groups of boundaries that one ``torch.autograd.grad`` runs exactly ([Note: weight-gradient groups])."""
        groups: list[tuple[list[int], int, int]] = []  # members, union of branches, union of input sides
        for k, (branch, side) in enumerate(sides):
            for g, (members, branches, inputs) in enumerate(groups):
                if not (side & branches or branch & inputs):
                    groups[g] = (members + [k], branches | branch, inputs | side)
                    break
            else:
                groups.append(([k], branch, side))
        self.groups = [members for members, _, _ in groups]
        self._group_params = [self._params_of(branches) for _, branches, _ in groups]

    def run_input(self, compute: Callable[[], list[torch.Tensor | None]]) -> list[torch.Tensor | None]:
        """Run ``I`` (``compute``) with the pre-hooks that keep the boundary gradients."""
        if self.fallback:
            return compute()
        handles = []
        for node, _ in self.boundaries:

            def keep(grad_outputs: tuple[torch.Tensor | None, ...], key: int = id(node)) -> None:
                self.captured[key] = tuple(grad_outputs)

            handles.append(node.register_prehook(keep))
        try:
            return compute()
        finally:
            for handle in handles:
                handle.remove()

    def run_weight(self) -> None:
        """Run ``W``: accumulate the parameter gradients of this graph."""
        if self.fallback:
            _backward(self.roots, self.grads, inputs=list(self.params))
            return
        edge = torch.autograd.graph.GradientEdge
        get_edge = torch.autograd.graph.get_gradient_edge
        for members, params in zip(self.groups, self._group_params, strict=True):
            outs, seeds = [], []
            for b in members:
                node = self.boundaries[b][0]
                captured = self.captured.get(id(node))
                if captured is None:
                    continue  # the node did not run in I (no gradient reached it): nothing to add
                for k, g in enumerate(captured):
                    if g is not None:
                        outs.append(edge(node, k))
                        seeds.append(g)
            if outs:
                _accumulate(
                    params,
                    torch.autograd.grad(
                        outs, [get_edge(p) for p in params], seeds, retain_graph=True, allow_unused=True
                    ),
                )
        for root, grad, root_params in self.pure_roots:
            _accumulate(
                root_params,
                torch.autograd.grad(
                    [root],
                    [get_edge(p) for p in root_params],
                    None if grad is None else [grad],
                    retain_graph=True,
                    allow_unused=True,
                ),
            )
        self.captured.clear()
        self.boundaries.clear()
        self.groups.clear()
        self._group_params.clear()
        self.pure_roots.clear()


def _accumulate(params: list[nn.Parameter], grads: Sequence[torch.Tensor | None]) -> None:
    with torch.no_grad():
        for param, grad in zip(params, grads, strict=True):
            if grad is None:
                continue
            if param.grad is None:
                param.grad = grad
            else:
                param.grad += grad


def _backward(
    roots: list[torch.Tensor], grads: list[torch.Tensor] | None, inputs: list[nn.Parameter] | None
) -> None:
    if not roots:
        return
    if inputs is not None:
        if not inputs:
            return
        torch.autograd.backward(roots, grads, inputs=inputs)
    else:
        torch.autograd.backward(roots, grads)


def _grad(
    roots: list[torch.Tensor], grads: list[torch.Tensor] | None, inputs: list[torch.Tensor]
) -> list[torch.Tensor | None]:
    if not roots or not inputs:
        return [None] * len(inputs)
    out = torch.autograd.grad(roots, inputs, grads, retain_graph=True, allow_unused=True)
    return list(out)
