"""The p2p transport's NCCL behaviours: one Work per batch, tag 0, device checks, CPU timings.

NCCL's ``batch_isend_irecv`` returns one Work for the whole batch. Every owner of a batched
receive must wait on that Work before reading its buffer (the old code sliced the list per
owner, so every owner after the first got no Work at all).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from merak_pipe.comm import P2PTransport, TensorMeta, Transfer, distribute_works
from merak_pipe.runner import _common_device
from merak_pipe.stage import PipelineStage
from merak_pipe.timing import RoundClock
from tests.support.dist import run_on_ranks


class _Work:
    def __init__(self, name: str) -> None:
        self.name = name

    def wait(self, timeout: Any = None) -> bool:
        return True


def test_one_work_for_a_batch_goes_to_every_owner() -> None:
    work = _Work("batch")
    assert distribute_works([work], [2, 1, 0, 3]) == [[work], [work], [], [work]]


def test_one_work_per_op_is_sliced_per_owner() -> None:
    works = [_Work(str(i)) for i in range(4)]
    assert distribute_works(works, [1, 3]) == [works[:1], works[1:]]
    with pytest.raises(AssertionError, match="returned 2 works for 4 operations"):
        distribute_works(works[:2], [1, 3])


class _OneWork:
    """What NCCL returns: one Work for a whole batch. Counts the waits; completes the real works once."""

    waits = 0

    def __init__(self, works: list[Any]) -> None:
        self.works = works

    def wait(self, timeout: Any = None) -> bool:
        _OneWork.waits += 1
        for work in self.works:
            work.wait(timeout)
        self.works = []
        return True


def _fake_batch(ops: list[Any]) -> list[Any]:
    return [_OneWork(dist.batch_isend_irecv(ops))]


def one_work_body(nccl_rules: bool) -> dict[str, Any]:
    transport = P2PTransport(
        group=dist.group.WORLD,
        num_stages=2,
        num_microbatches=2,
        timeout=timedelta(seconds=20),
        device=torch.device("cpu"),
        nccl_rules=nccl_rules,
    )
    transport.batch_isend_irecv = _fake_batch
    _OneWork.waits = 0
    tags = [transport.tag(0, 0, m) for m in range(3)]
    if dist.get_rank() == 0:
        sends = [Transfer(True, 1, [torch.full((4,), float(m))], [tags[m]], f"send {m}") for m in range(3)]
        transport.issue(sends)
        transport.wait_sends()
        return {"waits": _OneWork.waits}
    metas = [TensorMeta((4,), torch.float32, False)] * 3
    recvs = [
        Transfer(False, 0, [transport.empty(meta)], [tags[m]], f"recv {m}") for m, meta in enumerate(metas)
    ]
    pendings = transport.issue(recvs)
    got = [transport.finish(p)[0].clone() for p in pendings]
    return {"waits": _OneWork.waits, "works": [len(p.works) for p in pendings], "got": got}


@pytest.mark.parametrize("nccl_rules", [False, True], ids=["tags", "nccl-rules"])
def test_every_owner_waits_on_the_batch_work(nccl_rules: bool) -> None:
    sender, receiver = run_on_ranks(2, one_work_body, nccl_rules)
    assert receiver["works"] == [1, 1, 1]  # each owner holds the batch's one Work
    assert receiver["waits"] == 3  # and waits on it before reading its buffer
    for m, tensor in enumerate(receiver["got"]):
        assert torch.equal(tensor, torch.full((4,), float(m)))
    assert sender["waits"] == 3


def tag_body() -> list[int]:
    transport = P2PTransport(
        group=dist.group.WORLD,
        num_stages=4,
        num_microbatches=8,
        timeout=timedelta(seconds=5),
        device=torch.device("cpu"),
        nccl_rules=True,
    )
    header = transport.header_transfer(send=True, stage=1, peer=0, what="h", changed=True, nbytes=3)
    return [*transport.data_tags(True, 2, 5, 3), *header.tags]


def test_nccl_rules_put_every_op_on_tag_zero() -> None:
    assert run_on_ranks(2, tag_body) == [[0, 0, 0, 0]] * 2


def test_runner_device_must_match_the_stages() -> None:
    stage = PipelineStage(torch.nn.Linear(2, 2), stage_index=0, num_stages=2)
    assert _common_device([stage], None) == torch.device("cpu")
    assert _common_device([stage], "cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match=r"PipelineRunner\(device=meta\) but the stages are on \['cpu'\]"):
        _common_device([stage], "meta")


def test_cpu_round_clock_is_the_host_clock() -> None:
    clock = RoundClock(torch.device("cpu"))
    clock.start_round(anchor=True)
    first, second = clock.mark(), clock.mark()
    assert isinstance(first, float) and clock.seconds(first) == first <= clock.seconds(second)
