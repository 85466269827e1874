"""The send and receive-buffer bookkeeping of the pipeline transport ([Note: buffer lifetime]).

:class:`_TransportBooks` is the part of :class:`merak_pipe.comm.P2PTransport` that remembers what
is in flight and what can be reused: the sends issued and not yet known complete (reaped without
blocking, waited once proven matched, waited at the round's end), the pool of receive buffers per
shape and dtype, the received buffers that a pending send still shares, and the reused buffers of
the round headers ([Note: header buffers]). It issues nothing and waits only through the
transport's ``wait`` (which names rank, stage and action on failure).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

_Key = tuple[tuple[int, ...], torch.dtype]


@dataclass
class _Pending:
    """An issued transfer: its works, its tensors, and what it is for (for error messages)."""

    works: list[Any]
    tensors: list[torch.Tensor]
    what: str


@dataclass
class _HeaderSlot:
    """One reusable send header: ``host`` (int64[2], pinned on CUDA) and ``device``, what is sent
    (``host`` itself on CPU); ``copied``: the CUDA event recorded after each copy host -> device
    (None elsewhere: the copy blocks)."""

    host: torch.Tensor
    device: torch.Tensor
    copied: Any = None


def _completed(work: Any) -> bool:
    """Whether ``work`` has finished, without blocking (a Work without ``is_completed``: not known, False)."""
    probe = getattr(work, "is_completed", None)
    return bool(probe()) if probe is not None else False


def _plain(t: torch.Tensor) -> torch.Tensor:
    """``t`` without autograd ties: a received leaf keeps its object (so whoever tracks it sees it
    pooled) but drops its grad flag and its ``.grad``; anything else is detached."""
    if t.grad_fn is not None:
        return t.detach()
    if t.requires_grad:
        t.requires_grad_(False)
    t.grad = None
    return t


class _TransportBooks:
    """Outstanding sends and the receive-buffer pool of one transport (see the module docstring)."""

    device: torch.device

    def __init__(self) -> None:
        self._sends: list[_Pending] = []
        self._pool: dict[_Key, list[torch.Tensor]] = {}
        self._in_use: dict[_Key, int] = {}
        self._pool_limit: dict[_Key, int] = {}
        self._aliased: list[torch.Tensor] = []
        self.buffers_allocated = 0
        """Receive buffers allocated so far (statistics)."""
        self.buffers_reused = 0
        """Receive buffers taken from the pool instead (statistics)."""
        self._header_slots: list[_HeaderSlot] = []
        self._header_recv: dict[int, torch.Tensor] = {}
        self.header_buffers_allocated = 0
        """Header buffers (send slots and per-stage receive buffers) allocated so far (statistics)."""

    def wait(self, works: list[Any], what: str) -> None:  # pragma: no cover - the transport's
        raise NotImplementedError

    # ------------------------------------------------------------------ sends

    def reap_sends(self) -> None:
        """Let go of every send whose Work has completed, without blocking ([Note: buffer lifetime]).

        A completed send is still waited on, so a failed one raises here, named.
        """
        if not self._sends:
            return
        pending_sends = []
        for pending in self._sends:
            if pending.works and all(_completed(work) for work in pending.works):
                self.wait(pending.works, pending.what)
            else:
                pending_sends.append(pending)
        self._sends = pending_sends
        self._recycle_aliased()

    def complete_send(self, pending: _Pending) -> None:
        """Wait on one send known to be matched ([Note: settled sends]) and let its tensors go."""
        if any(p is pending for p in self._sends):
            self.wait(pending.works, pending.what)
            self._sends = [p for p in self._sends if p is not pending]
            self._recycle_aliased()

    def wait_sends(self) -> None:
        """Wait for every outstanding send of this round."""
        sends, self._sends = self._sends, []
        for pending in sends:
            self.wait(pending.works, pending.what)
        self._recycle_aliased()

    def drop_sends(self) -> None:
        """Forget the outstanding sends (after a failed round)."""
        self._sends = []
        self._aliased = []

    @property
    def pending_sends(self) -> int:
        """Sends issued and not yet known to have completed."""
        return len(self._sends)

    # ------------------------------------------------------------------ headers

    # [Note: header buffers]
    # A round header is two int64 values, sent once per round by each sending stage. It is never
    # built from a Python list per send (on CUDA that is a pageable host-to-device copy that blocks
    # the host): the values are written into a reused host buffer, pinned on CUDA, and copied
    # without blocking into a reused device buffer, which is what is sent. A send slot is reused
    # once nothing can still read it: no pending send holds its device buffer (the round's end waits
    # for every send, and the wait orders the compute stream after it) and the copy from its host
    # buffer has run (its event, queried without blocking). Otherwise another slot is taken (or
    # made): a rank holds as many slots as headers it has in flight, one per sending stage in
    # steady state. A received header is read as soon as its unit is issued, so each receiving
    # stage keeps one receive buffer.

    def _send_header_buffer(self, values: tuple[int, int]) -> torch.Tensor:
        """The device tensor holding ``values`` to send as a header ([Note: header buffers])."""
        slot = self._free_header_slot()
        slot.host[0], slot.host[1] = values
        if slot.device is not slot.host:
            slot.device.copy_(slot.host, non_blocking=slot.copied is not None)
        if slot.copied is not None:
            slot.copied.record(torch.cuda.current_stream(self.device))
        return slot.device

    def _free_header_slot(self) -> _HeaderSlot:
        for slot in self._header_slots:
            copied = slot.copied is None or slot.copied.query()
            if copied and not self._sent_storage(slot.device):
                return slot
        cuda = self.device.type == "cuda" and torch.cuda.is_available()
        host = torch.zeros(2, dtype=torch.int64, pin_memory=cuda)
        if self.device.type == "cpu":
            slot = _HeaderSlot(host, host)
        else:  # a never-recorded event reads as done
            device = torch.zeros(2, dtype=torch.int64, device=self.device)
            slot = _HeaderSlot(host, device, torch.cuda.Event() if cuda else None)
        self._header_slots.append(slot)
        self.header_buffers_allocated += 1
        return self._header_slots[-1]

    def _recv_header_buffer(self, stage: int) -> torch.Tensor:
        """The receive buffer of the headers of sending ``stage`` ([Note: header buffers])."""
        buffer = self._header_recv.get(stage)
        if buffer is None:
            buffer = self._header_recv[stage] = torch.empty(2, dtype=torch.int64, device=self.device)
            self.header_buffers_allocated += 1
        return buffer

    # ------------------------------------------------------------------ buffers

    # [Note: buffer lifetime]
    # A boundary tensor is held only while the schedule needs it, so a rank's boundary memory follows
    # the schedule's in-flight count, not the number of microbatches:
    # - a sent tensor until its Work completes (:meth:`reap_sends` polls at every issue and after every
    #   compute action; the round's end waits for the rest);
    # - a received activation or gradient until no stage of this rank holds autograd state of its
    #   microbatch any more (after B, or after W under a split backward; the runner releases it then);
    #   a stage that passes its input through may still be sending it: such a buffer waits in
    #   ``_aliased`` until no pending send shares its storage;
    # - the pool keeps per shape and dtype at most as many buffers as were in use at once, so it never
    #   exceeds what the schedule holds in flight.
    # Evaluation returns no buffer to the pool (the last stage's outputs may be its inputs).

    def _take_buffer(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A receive buffer of ``shape`` and ``dtype`` (from the pool when one is free)."""
        key = (shape, dtype)
        in_use = self._in_use[key] = self._in_use.get(key, 0) + 1
        self._pool_limit[key] = max(self._pool_limit.get(key, 0), in_use)
        free = self._pool.get(key)
        if free:
            self.buffers_reused += 1
            return free.pop()
        self.buffers_allocated += 1
        return torch.empty(shape, dtype=dtype, device=self.device)

    def release(self, tensors: Sequence[torch.Tensor]) -> None:
        """Give receive buffers back for reuse; the caller is done with them (no autograd state of
        theirs is left). One that a pending send shares waits for that send ([Note: buffer lifetime])."""
        for t in tensors:
            t = _plain(t)
            if self._sent_storage(t):
                self._aliased.append(t)
            else:
                self._to_pool(t)

    def discard(self, tensors: Sequence[torch.Tensor]) -> None:
        """Forget receive buffers without pooling them (evaluation: the outputs may be the inputs)."""
        for t in tensors:
            self._done_with((tuple(t.shape), t.dtype))

    @property
    def pooled_buffers(self) -> int:
        """Receive buffers waiting in the pool."""
        return sum(len(bucket) for bucket in self._pool.values())

    def clear_pool(self) -> None:
        """Drop every cached buffer (e.g. after a failed round)."""
        self._pool.clear()
        self._in_use.clear()
        self._aliased = []

    def _done_with(self, key: _Key) -> None:
        if self._in_use.get(key, 0) > 0:
            self._in_use[key] -= 1

    def _to_pool(self, t: torch.Tensor) -> None:
        key = (tuple(t.shape), t.dtype)
        self._done_with(key)
        bucket = self._pool.setdefault(key, [])
        if len(bucket) < self._pool_limit.get(key, 0):
            bucket.append(t)

    def _sent_storage(self, t: torch.Tensor) -> bool:
        if not self._sends or t.numel() == 0:
            return False
        ptr = t.untyped_storage().data_ptr()
        return any(x.untyped_storage().data_ptr() == ptr for p in self._sends for x in p.tensors)

    def _recycle_aliased(self) -> None:
        if not self._aliased:
            return
        waiting, self._aliased = self._aliased, []
        for t in waiting:
            if self._sent_storage(t):
                self._aliased.append(t)
            else:
                self._to_pool(t)
