"""merak_graph's private torch APIs, each removed in turn: the fallback gives torch's results (issue 25, item 2).

- flop counting (``torch.utils._python_dispatch.TorchDispatchMode`` + ``flop_counter.flop_registry``):
  without either, the public ``FlopCounterMode`` counts; every node's cost annotation is the same;
- ``torch._export.utils._compiling_state_context``: without it, torch.compiler's public predicates
  answer True inside (and False again after), as they do under torch's context;
- ``torch.utils._pytree``: without it, merak_graph's own flattening gives torch's leaves, key paths
  and rebuilt values, and a model with opaque leaves returning nested outputs traces exactly.
"""

from __future__ import annotations

import collections
import sys
from typing import Any

import pytest
import torch
import torch._export.utils
import torch.utils._python_dispatch
import torch.utils._pytree as torch_pytree
import torch.utils.flop_counter
from torch import nn

from merak_graph import _compat, _leaf_export, _pytree_fallback, annotate_costs, trace
from tests.graph.test_leaf_outputs import Nested, Net, WithNone
from tests.support.compare import assert_tensors_close


class _Block(nn.Module):
    def __init__(self, dim: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, s, d))
        return x + self.mlp(x) + torch.bmm(x, x.transpose(1, 2)) @ x


def _node_flops(gm: torch.fx.GraphModule, x: torch.Tensor) -> dict[str, int]:
    annotate_costs(gm, [x])
    return {n.name: n.meta["merak_cost"].flops for n in gm.graph.nodes}


def _without_flop_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    # torch's FlopCounterMode reads the table under its module name itself: removing the attribute
    # would break torch too, so the lookup _compat makes is what fails here.
    real_import = __import__

    def fake_import(
        name: str, globals: Any = None, locals: Any = None, fromlist: Any = (), level: int = 0
    ) -> Any:
        if name == "torch.utils.flop_counter" and fromlist and "flop_registry" in fromlist:
            raise ImportError("cannot import name 'flop_registry' from 'torch.utils.flop_counter'")
        return real_import(name, globals, locals, fromlist, level)

    monkeypatch.setattr("builtins.__import__", fake_import)


def _without_dispatch_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(torch.utils._python_dispatch, "TorchDispatchMode")


@pytest.mark.parametrize("remove", [_without_flop_registry, _without_dispatch_mode])
def test_flop_counts_without_a_private_piece(monkeypatch: pytest.MonkeyPatch, remove: Any) -> None:
    x = torch.randn(2, 8, 16)
    gm = trace(_Block(), example_inputs=(x,))
    private = _node_flops(gm, x)
    assert sum(private.values()) > 0
    with torch.device("meta"):
        a, b = torch.randn(3, 5), torch.randn(5, 7)
    with _compat.FlopCountingMode() as mode:
        a @ b
    assert isinstance(mode._mode, torch.utils._python_dispatch.TorchDispatchMode)  # the private path ran
    remove(monkeypatch)
    with _compat.FlopCountingMode() as fallback:
        a @ b
    assert isinstance(fallback._mode, torch.utils.flop_counter.FlopCounterMode)
    assert fallback.flops == mode.flops == 2 * 3 * 5 * 7
    assert _node_flops(gm, x) == private


def _predicates() -> tuple[bool, bool]:
    return torch.compiler.is_compiling(), torch.compiler.is_exporting()


def test_compiling_state_without_the_private_context(monkeypatch: pytest.MonkeyPatch) -> None:
    with _compat.export_compiling_state():
        private = _predicates()
    assert private == (True, True)
    monkeypatch.delattr(torch._export.utils, "_compiling_state_context")
    with _compat.export_compiling_state():
        assert _predicates() == private
    assert _predicates() == (False, False)
    with pytest.raises(KeyError), _compat.export_compiling_state():  # restored on an error too
        raise KeyError("x")
    assert _predicates() == (False, False)


Pair = collections.namedtuple("Pair", "left right")

TREES = [
    None,
    torch.ones(2),
    (1, [2, None], {"b": 3, "a": (4,)}),
    {"skip": None, "pair": (None, torch.zeros(1), torch.ones(1))},
    [Pair(1, {"x": [2, 3]}), collections.OrderedDict(z=1, y=(2, None))],
    ((), [], {}),
]


def _keys(path: tuple[Any, ...]) -> list[tuple[str, Any]]:
    return [(type(e).__name__, getattr(e, "idx", getattr(e, "key", getattr(e, "name", None)))) for e in path]


@pytest.mark.parametrize("tree", TREES, ids=range(len(TREES)))
def test_pytree_without_torch_pytree(monkeypatch: pytest.MonkeyPatch, tree: Any) -> None:
    monkeypatch.setitem(sys.modules, "torch.utils._pytree", None)  # the import fails
    flatten, flatten_with_path, unflatten = _compat._load_pytree()
    assert flatten is _pytree_fallback.tree_flatten
    monkeypatch.undo()
    leaves, spec = flatten(tree)
    ref_leaves, _ = torch_pytree.tree_flatten(tree)
    assert len(leaves) == len(ref_leaves) and all(a is b for a, b in zip(leaves, ref_leaves, strict=True))
    paths = [_keys(p) for p, _ in flatten_with_path(tree)[0]]
    assert paths == [_keys(p) for p, _ in torch_pytree.tree_flatten_with_path(tree)[0]]
    rebuilt = unflatten(leaves, spec)
    assert type(rebuilt) is type(tree)
    assert repr(rebuilt) == repr(torch_pytree.tree_unflatten(ref_leaves, torch_pytree.tree_flatten(tree)[1]))


def test_leaf_export_with_the_fallback_pytree(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("tree_flatten", "tree_flatten_with_path", "tree_unflatten"):
        monkeypatch.setattr(_leaf_export, name, getattr(_pytree_fallback, name))
    torch.manual_seed(0)
    model = Net().double()
    x = torch.randn(4, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    gm = trace(model, example_inputs=(x,), leaf_modules=(WithNone, Nested), method="export")
    assert {str(n.target) for n in gm.graph.nodes if n.op == "call_module"} >= {"first", "second"}
    assert_tensors_close(gm(x), model(x), name="traced output", rtol=0, atol=0)


@pytest.mark.parametrize("table", ["torch", "missing"])
def test_gradient_hooks_carried_with_or_without_torchs_hook_table(
    monkeypatch: pytest.MonkeyPatch, table: str
) -> None:
    """[Note: gradient hooks] a hook recorded on a meta parameter (as merak-tp's register_grad_hook does)
    runs exactly once on the materialised parameter and on a built stage's copy, whether torch's private
    hook table is read or missing (a renamed attribute)."""
    from merak_graph import empty_init, materialize, partition
    from tests.support.models import GPT, REFERENCE_MODELS, init_like_gpt2

    if table == "missing":
        monkeypatch.setattr(_compat, "_TENSOR_HOOKS", "_renamed_backward_hooks")
    with empty_init():
        model = GPT()

    def plus_one(g: torch.Tensor) -> torch.Tensor:
        return g + 1

    for p in model.parameters():
        p.register_hook(plus_one)
        p.__dict__.setdefault(_compat.RECORDED_GRAD_HOOKS, []).append(plus_one)
    x = REFERENCE_MODELS["gpt"].make_inputs(2, 8, 0)
    part = partition(model, 2, example_inputs=tuple(t.to("meta") for t in x), input_names=("input_ids",))
    stage = part.build_stage(1, device="cpu", init_fn=init_like_gpt2)
    materialize(model, device="cpu", init_fn=init_like_gpt2)
    for module in (model, stage):
        params = [p for p in module.parameters() if p.requires_grad]
        assert params
        (sum((p * p).sum() for p in params)).backward()  # type: ignore[union-attr]
        for p in params:
            assert p.grad is not None
            assert torch.equal(p.grad, 2 * p.detach() + 1), "the hook ran not exactly once"


class _Buffers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.register_buffer("kept", torch.full((4,), 2.0))
        self.register_buffer("scratch", torch.full((4,), 3.0), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x) * self.kept) + self.scratch


@pytest.mark.parametrize("table", ["torch", "missing"])
def test_buffer_persistence_with_or_without_the_private_set(
    monkeypatch: pytest.MonkeyPatch, table: str
) -> None:
    """Shards keep a non-persistent buffer out of their state dict, whether nn.Module's private set of
    non-persistent names is read or missing (renamed): the state dict decides then."""
    from merak_graph import shard

    if table == "missing":
        monkeypatch.setattr(_compat, "_NON_PERSISTENT", "_renamed_non_persistent")
    model = _Buffers()
    assert [_compat.is_persistent(model, n) for n in ("kept", "scratch", "a", "missing")] == [
        True,
        False,
        True,
        True,
    ]
    x = torch.randn(3, 4)
    sharded = shard(trace(model, example_inputs=(x,)), 2, example_inputs=(x,), model=model)
    keys = {k.rsplit(".", 1)[-1] for s in sharded.shards for k in s.module.state_dict()}
    buffers = {n.rsplit(".", 1)[-1] for s in sharded.shards for n, _ in s.module.named_buffers()}
    assert "scratch" in buffers and "scratch" not in keys
    assert "kept" in keys
    assert_tensors_close(sharded.run(x), model(x), name="sharded output", rtol=0, atol=0)
