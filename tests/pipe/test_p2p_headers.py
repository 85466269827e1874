"""The round headers of the p2p transport are sent from reused buffers ([Note: header buffers]).

A header (``int64[2] = (changed, nbytes)``) goes out once per round of each sending stage. It used
to be built per send from a Python list (on CUDA a pageable host-to-device copy that blocks the
host); now every header of a stage goes out of the same buffer (pinned host memory copied without
blocking on CUDA; on CPU the host buffer itself), and each receiving stage reads into one buffer.
Checked over four steps of a 2-stage 1F1B pipeline whose sequence length changes once (so the
header says "changed" in steps 1 and 3): the same tensor object every send and receive, one buffer
per rank, the values as sent, and the losses of the one-process reference.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from merak_pipe.comm import _HEADER
from tests.pipe._runtime_bodies import batch_for, build_runner, make_schedule, reference
from tests.support.dist import run_on_ranks

CASE: dict[str, Any] = dict(
    model="gpt",
    schedule="1f1b",
    num_stages=2,
    num_microbatches=2,
    recompute=None,
    seqs=[8, 8, 12, 12],
    batch=4,
)


def header_body(case: dict[str, Any]) -> dict[str, Any]:
    model, runner = build_runner(case, make_schedule(case, dist.get_world_size()))
    transport = runner.transport
    header_tags = {transport.tag(_HEADER, stage, 0) for stage in range(case["num_stages"])}
    seen: list[torch.Tensor] = []  # every header tensor sent or received, kept alive (ids stay unique)
    sent_values: list[list[int]] = []
    batch = transport.batch_isend_irecv

    def recording_batch(ops: list[Any]) -> Any:
        for op in ops:
            if op.tag in header_tags:
                seen.append(op.tensor)
                if op.op is dist.isend:
                    sent_values.append(op.tensor.tolist())
        return batch(ops)

    transport.batch_isend_irecv = recording_batch
    read_values: list[list[int]] = []
    read = transport.read_header

    def recording_read(pending: Any) -> tuple[bool, int]:
        changed, nbytes = read(pending)
        read_values.append([int(changed), nbytes])
        return changed, nbytes

    transport.read_header = recording_read  # type: ignore[method-assign]
    losses = []
    for step, seq in enumerate(case["seqs"]):
        model.zero_grad(set_to_none=True)
        ids, labels = batch_for(case, step, seq)
        losses.append(
            runner.step(
                ids if runner.holds_first_stage else None, labels if runner.holds_last_stage else None
            )
        )
    return {
        "headers": len(seen),
        "distinct_objects": len({id(t) for t in seen}),
        "allocated": getattr(transport, "header_buffers_allocated", None),  # (statistics)
        "sent": sent_values,
        "read": read_values,
        "losses": losses,
    }


def test_headers_go_out_of_one_reused_buffer_per_stage() -> None:
    sender, receiver = run_on_ranks(2, header_body, CASE)
    assert sender["headers"] == receiver["headers"] == len(CASE["seqs"])  # one per round
    assert sender["distinct_objects"] == receiver["distinct_objects"] == 1
    assert sender["allocated"] == receiver["allocated"] == 1
    assert [changed for changed, _ in sender["sent"]] == [1, 0, 1, 0]
    assert sender["sent"][0][1] > 0 and sender["sent"][1][1] == 0
    assert receiver["read"] == sender["sent"]
    want = [float(r["loss"]) for r in reference(CASE)]
    assert [float(x) for x in receiver["losses"]] == pytest.approx(want, rel=1e-12)
