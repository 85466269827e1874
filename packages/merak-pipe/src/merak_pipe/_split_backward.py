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
        self.captured: dict[int, tuple[torch.Tensor | None, ...]] = {}
        self.pure_roots: list[tuple[torch.Tensor, torch.Tensor | None, list[nn.Parameter]]] = []
        if not self.fallback and roots:
            self._analyse(targets)

    def _analyse(self, targets: list[torch.Tensor]) -> None:
        get_edge = torch.autograd.graph.get_gradient_edge
        target_nodes = {get_edge(t).node for t in targets}
        param_of = {get_edge(p).node: i for i, p in enumerate(self.params)}
        root_nodes = [r.grad_fn if r.grad_fn is not None else get_edge(r).node for r in self.roots]
        # Iterative post-order walk: reaches_target and the parameters below every node.
        reaches: dict[Any, bool] = {}
        below: dict[Any, frozenset[int]] = {}
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
            kids = children[node]
            reaches[node] = node in target_nodes or any(reaches[c] for c in kids)
            own = frozenset([param_of[node]]) if node in param_of else frozenset()
            below[node] = own.union(*(below[c] for c in kids))
        for node, kids in children.items():
            if not reaches[node]:
                continue
            branch = frozenset().union(*(below[c] for c in kids if not reaches[c]))
            if not branch:
                continue
            input_side = frozenset().union(*(below[c] for c in kids if reaches[c]))
            if branch & input_side:
                self.fallback = True
                return
            self.boundaries.append((node, [self.params[i] for i in sorted(branch)]))
        for k, (root, node) in enumerate(zip(self.roots, root_nodes, strict=True)):
            if not reaches[node] and below[node]:
                grad = None if self.grads is None else self.grads[k]
                self.pure_roots.append((root, grad, [self.params[i] for i in sorted(below[node])]))

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
        for node, params in self.boundaries:
            captured = self.captured.get(id(node))
            if captured is None:
                continue  # the node did not run in I (no gradient reached it): nothing to add
            outs = [edge(node, k) for k, g in enumerate(captured) if g is not None]
            seeds = [g for g in captured if g is not None]
            if outs:
                _accumulate(
                    params,
                    torch.autograd.grad(
                        outs, [get_edge(p) for p in params], seeds, retain_graph=True, allow_unused=True
                    ),
                )
        for root, grad, params in self.pure_roots:
            _accumulate(
                params,
                torch.autograd.grad(
                    [root],
                    [get_edge(p) for p in params],
                    None if grad is None else [grad],
                    retain_graph=True,
                    allow_unused=True,
                ),
            )
        self.captured.clear()
        self.boundaries.clear()
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
