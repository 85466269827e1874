"""Global gradient clipping across DP/TP/PP against torch.nn.utils.clip_grad_norm_ in one process.

A logical "model" of named float64 gradients is cut by hand the way merak-tp and a
pipeline would: column/row-parallel weights sharded over TP (tagged
a ``ShardSpec`` with a dim), replicated biases and norms, a tied embedding held by the first
and the last stage (counted on stage 0), and a parameter without a gradient. Every
layout's global norm and clipped gradients (re-assembled from the shards) must equal
the single-process reference.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from torch import nn

from merak_core.parallel.clip import clip_grad_norm_, global_grad_norm
from merak_core.parallel.layout import ParallelLayout
from merak_core.parallel.rank_grid import coords_of
from merak_tp.shard_spec import ShardSpec, set_shard_spec
from tests.support.compare import assert_tensors_close
from tests.support.dist import run_on_ranks

# name: (shape, TP-sharded dim or None, pipeline stages (of 2) holding it)
SPEC: dict[str, tuple[tuple[int, ...], int | None, tuple[int, ...]]] = {
    "embed.weight": ((8, 6), 0, (0, 1)),  # vocab-parallel, tied with the head on the last stage
    "l0.weight": ((8, 6), 0, (0,)),  # column-parallel
    "l0.bias": ((8,), 0, (0,)),
    "l1.weight": ((6, 8), 1, (0,)),  # row-parallel
    "l1.bias": ((6,), None, (0,)),  # replicated over TP
    "norm.weight": ((6,), None, (1,)),
    "l2.weight": ((4, 6), 0, (1,)),
    "l2.bias": ((4,), 0, (1,)),
    "unused.weight": ((4, 4), 0, (1,)),  # never receives a gradient
}


def _full_grads() -> dict[str, torch.Tensor | None]:
    g = torch.Generator().manual_seed(9)
    return {
        name: None if name.startswith("unused") else torch.randn(shape, generator=g, dtype=torch.float64)
        for name, (shape, _, _) in SPEC.items()
    }


def _reference(max_norm: float, norm_type: float) -> tuple[float, dict[str, torch.Tensor]]:
    params = []
    for name, grad in _full_grads().items():
        p = nn.Parameter(torch.zeros(SPEC[name][0], dtype=torch.float64))
        p.grad = None if grad is None else grad.clone()
        params.append((name, p))
    total = torch.nn.utils.clip_grad_norm_([p for _, p in params], max_norm, norm_type=norm_type)
    return total.item(), {n: p.grad for n, p in params if p.grad is not None}


def _clip_on_rank(
    dp: int, tp: int, pp: int, max_norm: float, norm_type: float
) -> tuple[tuple[int, int, int], float, float, dict[str, torch.Tensor]]:
    layout = ParallelLayout.build(dp, tp, pp, device="cpu")
    params: dict[str, nn.Parameter] = {}
    for name, grad in _full_grads().items():
        shape, tp_dim, stages = SPEC[name]
        if layout.pp_rank not in {s % pp for s in stages}:
            continue
        p = nn.Parameter(torch.zeros(shape, dtype=torch.float64))
        if grad is not None:
            p.grad = grad.clone()
        if tp_dim is not None:
            p = nn.Parameter(p.detach().chunk(tp, tp_dim)[layout.tp_rank].clone())
            if grad is not None:
                p.grad = grad.chunk(tp, tp_dim)[layout.tp_rank].clone()
            set_shard_spec(p, ShardSpec(tp_dim))
        params[name] = p
    shared = {params["embed.weight"]: 0} if pp > 1 else None
    # Pass the tied parameter twice: duplicates must be counted once (as torch does).
    plist = list(params.values()) + ([params["embed.weight"]] if layout.is_first_stage else [])
    norm_only = global_grad_norm(plist, norm_type=norm_type, layout=layout, shared_params=shared).item()
    total = clip_grad_norm_(plist, max_norm, norm_type=norm_type, layout=layout, shared_params=shared)
    grads = {n: p.grad for n, p in params.items() if p.grad is not None}
    return (layout.pp_rank, layout.dp_rank, layout.tp_rank), norm_only, total.item(), grads


LAYOUTS = [(1, 2, 1), (1, 1, 2), (2, 1, 1), (1, 2, 2), (2, 2, 1), (2, 1, 2)]


@pytest.mark.parametrize("dp,tp,pp", LAYOUTS)
@pytest.mark.parametrize("max_norm,norm_type", [(1.0, 2.0), (1e4, 2.0), (0.5, 1.0), (0.1, math.inf)])
def test_clip_matches_single_process(dp: int, tp: int, pp: int, max_norm: float, norm_type: float) -> None:
    ref_total, ref_grads = _reference(max_norm, norm_type)
    world = dp * tp * pp
    results = run_on_ranks(world, _clip_on_rank, dp, tp, pp, max_norm, norm_type)
    for rank, (coords, norm_only, total, _) in enumerate(results):
        assert coords == coords_of(rank, dp=dp, tp=tp)
        assert_tensors_close(torch.tensor(total), torch.tensor(ref_total), name=f"norm rank {rank}")
        assert norm_only == total
    # Re-assemble the TP shards of each stage and compare with the reference, on every DP replica.
    for d in range(dp):
        for name, ref in ref_grads.items():
            _, tp_dim, stages = SPEC[name]
            for stage in {s % pp for s in stages}:
                shards = [results[(stage * dp + d) * tp + t][3][name] for t in range(tp)]
                got = shards[0] if tp_dim is None else torch.cat(shards, dim=tp_dim)
                if tp_dim is None:
                    for t in range(1, tp):
                        assert torch.equal(shards[t], shards[0]), f"{name} diverged over TP"
                assert_tensors_close(got, ref, name=f"{name} (stage {stage}, dp {d})")
    if max_norm < 1e3:
        assert ref_total > max_norm  # the reference really clipped


def test_counting_rules_matter() -> None:
    # Without the TP tags every shard would be counted as a replicated parameter on TP rank 0
    # only: a different (wrong) norm. This guards against a test that cannot fail.
    ref_total, _ = _reference(1.0, 2.0)
    results = run_on_ranks(2, _untagged_norm)
    assert all(abs(r - ref_total) > 1e-3 for r in results)


def _untagged_norm() -> float:
    layout = ParallelLayout.build(1, 2, 1, device="cpu")
    params = []
    for name, grad in _full_grads().items():
        shape, tp_dim, _ = SPEC[name]
        if grad is None:
            continue
        g = grad if tp_dim is None else grad.chunk(2, tp_dim)[layout.tp_rank]
        p = nn.Parameter(torch.zeros_like(g))
        p.grad = g.clone()
        params.append(p)
    return global_grad_norm(params, layout=layout).item()


def test_rejects_bad_arguments() -> None:
    p = nn.Parameter(torch.zeros(2))
    p.grad = torch.ones(2)
    with pytest.raises(ValueError, match="max_norm must be > 0, got 0"):
        clip_grad_norm_([p], 0.0)
    with pytest.raises(ValueError, match="norm_type must be > 0 or inf, got -1.0"):
        global_grad_norm([p], norm_type=-1)
    p.grad = torch.tensor([float("nan"), 1.0])
    with pytest.raises(RuntimeError, match="non-finite"):
        clip_grad_norm_([p], 1.0, error_if_nonfinite=True)


def test_single_process_equals_torch() -> None:
    ref_total, ref_grads = _reference(1.0, 2.0)
    params = []
    for name, grad in _full_grads().items():
        p = nn.Parameter(torch.zeros(SPEC[name][0], dtype=torch.float64))
        p.grad = None if grad is None else grad.clone()
        params.append((name, p))
    total = clip_grad_norm_([p for _, p in params], 1.0)
    assert_tensors_close(total, torch.tensor(ref_total, dtype=torch.float64), name="norm")
    for name, p in params:
        if p.grad is not None:
            assert_tensors_close(p.grad, ref_grads[name], name=name)


def _mixed_params() -> list[nn.Parameter]:
    """Gradients of three dtypes (one norm kernel each), large enough to clip."""
    g = torch.Generator().manual_seed(3)
    params = []
    for i, dtype in enumerate([torch.float32, torch.bfloat16, torch.float64, torch.float32, torch.bfloat16]):
        p = nn.Parameter(torch.zeros(5 + i, 3, dtype=dtype))
        p.grad = (torch.randn(5 + i, 3, generator=g) * 4).to(dtype)
        params.append(p)
    return params


def _clip_counting_kernels(
    max_norm: float, norm_type: float
) -> tuple[torch.Tensor, list[torch.Tensor], Counter]:
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: Counter = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            self.ops[func.overloadpacket.__name__] += 1
            return func(*args, **(kwargs or {}))

    params = _mixed_params()
    with Count() as count:
        total = clip_grad_norm_(params, max_norm, norm_type=norm_type)
    return total, [p.grad for p in params], count.ops


@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf])
def test_clipping_runs_one_kernel_per_dtype_and_equals_the_per_parameter_loop(
    monkeypatch: pytest.MonkeyPatch, norm_type: float
) -> None:
    total, grads, ops = _clip_counting_kernels(0.5, norm_type)
    # Five gradients of three dtypes: three norm kernels and three scaling kernels, none per parameter.
    assert ops["_foreach_norm"] == 3 and ops["_foreach_mul_"] == 3, ops
    assert ops["linalg_vector_norm"] == 0 and ops["mul_"] == 0, ops
    # Without torch's multi-tensor kernels (removed): the per-parameter loop, the same clipping.
    monkeypatch.delattr(torch, "_foreach_norm")
    monkeypatch.delattr(torch, "_foreach_mul_")
    loop_total, loop_grads, loop_ops = _clip_counting_kernels(0.5, norm_type)
    assert loop_ops["linalg_vector_norm"] == 5 and loop_ops["mul_"] == 5, loop_ops
    assert total.dtype == loop_total.dtype == torch.float64
    assert_tensors_close(total, loop_total, name="norm", rtol=1e-6, atol=0)
    assert total.item() > 0.5  # it clipped
    for i, (got, ref) in enumerate(zip(grads, loop_grads, strict=True)):
        assert got.dtype == ref.dtype
        assert_tensors_close(
            got.double(),
            ref.double(),
            name=f"grad {i} ({got.dtype})",
            rtol=1e-2 if got.dtype == torch.bfloat16 else 1e-6,
            atol=0,
        )
