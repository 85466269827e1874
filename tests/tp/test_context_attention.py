"""merak_tp.context: ring and Ulysses attention at cp=2 against one process in float64.

Outputs and the gradients of q, k and v (every rank's local rows) equal full-sequence attention.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from merak_tp.context import ring_attention, shard_positions, ulysses_attention
from tests.support.dist import run_on_ranks

B, H, G, S, D = 2, 4, 2, 16, 8


def _full_inputs() -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(B, H, S, D, generator=gen, dtype=torch.float64)
    k = torch.randn(B, G, S, D, generator=gen, dtype=torch.float64)
    v = torch.randn(B, G, S, D, generator=gen, dtype=torch.float64)
    grad = torch.randn(B, H, S, D, generator=gen, dtype=torch.float64)
    return q, k, v, grad


def _reference(causal: bool) -> tuple[torch.Tensor, ...]:
    q, k, v, grad = _full_inputs()
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(
        q, k.repeat_interleave(H // G, 1), v.repeat_interleave(H // G, 1), is_causal=causal
    )
    out.backward(grad)
    assert q.grad is not None and k.grad is not None and v.grad is not None
    return out.detach(), q.grad, k.grad, v.grad


def _run_local(mode: str, causal: bool) -> tuple[torch.Tensor, ...]:
    group = dist.group.WORLD
    cp, rank = dist.get_world_size(), dist.get_rank()
    balanced = mode == "ring" and causal
    pos = shard_positions(S, cp, rank, balanced=balanced)
    q, k, v, grad = (t[:, :, pos].clone() for t in _full_inputs())
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    fn = ring_attention if mode == "ring" else ulysses_attention
    out = fn(q, k, v, group, causal=causal)
    out.backward(grad)
    return pos, out.detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize(
    ("mode", "causal", "cp"), [("ring", True, 2), ("ring", False, 2), ("ulysses", True, 2), ("ring", True, 4)]
)
def test_cp_attention_matches_one_process(mode: str, causal: bool, cp: int) -> None:
    ref = _reference(causal)
    results = run_on_ranks(cp, _run_local, mode, causal)
    seen = torch.cat([r[0] for r in results]).sort().values
    assert torch.equal(seen, torch.arange(S))
    for pos, *local in results:
        for name, got, want in zip(("out", "dq", "dk", "dv"), local, ref, strict=True):
            torch.testing.assert_close(got, want[:, :, pos], rtol=1e-10, atol=1e-12, msg=name)


def test_shard_positions_balanced_chunks() -> None:
    assert shard_positions(16, 2, 0, balanced=True).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert shard_positions(16, 2, 1, balanced=True).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert shard_positions(16, 2, 1, balanced=False).tolist() == list(range(8, 16))
    with pytest.raises(ValueError, match=r"sequence length 10 does not divide into 4 equal chunks"):
        shard_positions(10, 2, 0, balanced=True)


def _ulysses_refuses_heads() -> str:
    q = torch.zeros(1, 3, 4, 2)
    try:
        ulysses_attention(q, q, q, dist.group.WORLD)
    except ValueError as exc:
        return str(exc)
    return "accepted"


def test_ulysses_refuses_heads_cp_does_not_divide() -> None:
    for msg in run_on_ranks(2, _ulysses_refuses_heads):
        assert "cp=2" in msg and "3 query" in msg and "cp_mode='ring'" in msg
