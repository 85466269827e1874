"""merak_tp.ring: each ring pass is posted before the block it overlaps is computed, forward and backward,
and the passes follow NCCL's rules (merak_tp.ring [Note: ring overlap]).

One causal ring attention at cp=4 (the smallest ring with a middle step, where the backward's batch
carries a key/value block and a block's gradients at once) under ``record_overlap_events``, with
``torch.distributed.batch_isend_irecv`` wrapped to log every batch it is given. Per rank the log must
show, for every step but the last, the step's pass posted (a real batch, with the block the next step
computes) before the step's block is computed and waited for after it; the backward used to compute
each block first and then pass it on synchronously. Across ranks the batches must pair as NCCL pairs
them: by issue order alone (every op on tag 0), batch ``n`` of a rank sending to its peer exactly the
tensors, in order and shape, that batch ``n`` of the peer receives from it. Exactness is
``test_context_attention.py``'s.
"""

from __future__ import annotations

from typing import Any
from unittest import mock

import torch
import torch.distributed as dist

from merak_tp import record_overlap_events
from merak_tp.context import ring_attention, shard_positions
from tests.support.dist import run_on_ranks

B, H, G, S, D = 1, 4, 2, 16, 4
CP = 4


def _logged_run() -> list[tuple[Any, ...]]:
    """One forward and backward of causal ring attention on this rank; the event log with the batches."""
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(3)
    q, k, v, grad = (torch.randn(B, n, S, D, generator=gen, dtype=torch.float64) for n in (H, G, G, H))
    pos = shard_positions(S, CP, rank, balanced=True)
    q, k, v = (t[:, :, pos].clone().requires_grad_() for t in (q, k, v))
    real = dist.batch_isend_irecv

    with record_overlap_events() as events:

        def logged(ops: list[dist.P2POp]) -> Any:
            events.append(
                (
                    "p2p",
                    tuple(
                        ("send" if op.op is dist.isend else "recv", op.peer, op.tag, tuple(op.tensor.shape))
                        for op in ops
                    ),
                )
            )
            return real(ops)

        with mock.patch.object(dist, "batch_isend_irecv", logged):
            out = ring_attention(q, k, v, dist.group.WORLD, causal=True)
            out.backward(grad[:, :, pos])
    return [e for e in events if e[0] == "p2p" or e[2] == "ring"]


def _index(events: list[tuple[Any, ...]], kind: str, phase: str, step: int) -> int:
    matches = [i for i, e in enumerate(events) if e[:2] == (kind, phase) and e[3] == str(step)]
    assert len(matches) == 1, f"expected one {kind} of {phase} step {step}, found {len(matches)} in {events}"
    return matches[0]


def _check_overlap(events: list[tuple[Any, ...]], rank: int) -> None:
    kv_shape = (2, B, G, S // CP, D)
    for phase in ("fwd", "bwd"):
        for step in range(CP - 1):
            launch = _index(events, "launch", phase, step)
            compute = _index(events, "compute", phase, step)
            wait = _index(events, "wait", phase, step)
            assert launch < compute < wait, (
                f"rank {rank}, {phase} step {step}: the pass of the next block must be posted before this "
                f"block's compute and waited for after it; order was launch@{launch} compute@{compute} wait@{wait}"
            )
            kind, ops = events[launch - 1]
            received = [shape for verb, _, _, shape in ops if verb == "recv"]
            assert kind == "p2p" and kv_shape in received, (phase, step, events[launch - 1])


def _units(events: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    return [e[1] for e in events if e[0] == "p2p"]


def _check_nccl_pairing(logs: list[list[tuple[Any, ...]]]) -> None:
    units = [_units(log) for log in logs]
    assert len({len(u) for u in units}) == 1, [len(u) for u in units]
    for rank, rank_units in enumerate(units):
        for n, unit in enumerate(rank_units):
            assert all(tag == 0 for _, _, tag, _ in unit), unit
            for peer in range(len(units)):  # every channel rank -> peer, receives without a send included
                sent = [shape for verb, p, _, shape in unit if verb == "send" and p == peer]
                got = [shape for verb, p, _, shape in units[peer][n] if verb == "recv" and p == rank]
                assert sent == got, (
                    f"batch {n}: rank {rank} sends {sent} to rank {peer}, which receives {got}"
                )


def test_ring_posts_each_pass_before_the_block_it_overlaps() -> None:
    logs = run_on_ranks(CP, _logged_run)
    for rank, log in enumerate(logs):
        _check_overlap(log, rank)
    _check_nccl_pairing(logs)
