"""One rank's side of the stage-boundary traffic of a round: what to send, what was received.

:class:`BoundaryExchange` sits between the runner and the transport. The runner hands it the
outputs of forwards and the input gradients of backwards that go to another rank, asks it to
run each p2p unit of the issue order ([Note: issue order] in ``p2p_order.py``), and takes the
received inputs and output gradients when a compute action consumes them. It keeps the
boundary specs: those of this round, and the last one sent or received per stage for the
"spec changed" header ([Note: boundary values] in ``comm.py``).

It never posts anything outside the unit it is asked to run: a value that is consumed before
its receive was issued is an error in the schedule, reported as such.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from merak_pipe.comm import P2PTransport, PipelineCommError, TensorMeta, Transfer, _Pending, spec_metas
from merak_pipe.ir import Action
from merak_pipe.p2p_order import DATA_B, DATA_F, HEADER, SPEC, P2POp, Step

__all__ = ["BoundaryExchange"]


class BoundaryExchange:
    """Per-round p2p state of one pipeline rank over a :class:`~merak_pipe.comm.P2PTransport`."""

    def __init__(self, transport: P2PTransport) -> None:
        self.transport = transport
        self.rank = transport.rank
        self.position: Step | None = None
        """The compute action or p2p unit this rank runs now (set by the runner and :meth:`run_unit`;
        read from another thread by watchdogs, :func:`merak_pipe.p2p_order.describe_step`)."""
        # Specs that persist across rounds (for the "spec changed" header).
        self._last_sent_spec: dict[int, Any] = {}
        self._last_recv_spec: dict[int, Any] = {}
        # (stage, "in" or "out") -> (spec, its tensor metas): a spec is walked once, not once per microbatch.
        self._metas: dict[tuple[int, str], tuple[Any, list[TensorMeta]]] = {}
        # id(op) -> (description, tag of its first tensor) for the ops of the plans given to
        # prepare(): worked out once per runner, not once per op of every round.
        self._wires: dict[int, tuple[str, int]] = {}
        self._prepared: list[list[Step]] = []
        self.reset_round()

    def prepare(self, plans: Iterable[Sequence[Step]]) -> None:
        """Work out, once, what every p2p op of ``plans`` needs each round: its description and
        its first tag. The table is keyed by the ops' identity, so it keeps the plans alive; an op
        it does not know is worked out on the spot."""
        self._prepared = [list(plan) for plan in plans]
        for plan in self._prepared:
            for step in plan:
                if isinstance(step, tuple):
                    for op in step:
                        self._wires[id(op)] = self._wire(op)

    def _wire(self, op: P2POp) -> tuple[str, int]:
        a = op.action
        what = self.transport.describe(a.stage, a.kind.value, a.microbatch, op.peer)
        if op.kind in (DATA_F, DATA_B):
            return what, self.transport.data_tags(op.kind == DATA_B, op.stage, op.microbatch, 1)[0]
        return what, 0

    def reset_round(
        self, settles: dict[tuple[str, int, int], tuple[tuple[str, int, int], ...]] | None = None
    ) -> None:
        """Forget this round's messages (called at the start of every round). ``settles``: for each
        message received, the sends it proves matched ([Note: settled sends] in ``p2p_order.py``)."""
        self.position = None
        self._settles = settles or {}
        self._sent: dict[tuple[str, int, int], _Pending] = {}
        # Sends proven matched before this rank issued them ([Note: early receives] in p2p_order.py),
        # and those of them issued since, to be waited after the next compute action.
        self._proven: set[tuple[str, int, int]] = set()
        self._proven_issued: list[_Pending] = []
        self.out_spec: dict[int, Any] = {}
        """Sending stage -> spec of its outputs this round."""
        self.in_spec: dict[int, Any] = {}
        """Receiving stage -> spec of its inputs this round."""
        self._fwd_out: dict[tuple[int, int], list[torch.Tensor]] = {}
        self._bwd_out: dict[tuple[int, int], list[torch.Tensor]] = {}
        self._fwd_recv: dict[tuple[int, int], _Pending] = {}
        self._bwd_recv: dict[tuple[int, int], _Pending] = {}
        self._header: dict[int, tuple[bool, int]] = {}
        self._payload: dict[int, bytes | None] = {}

    # ------------------------------------------------------------------ values from compute

    def put_forward_output(self, stage: int, microbatch: int, tensors: list[torch.Tensor]) -> None:
        """Outputs of ``stage`` for ``microbatch``, to be sent by its SEND_F."""
        self._fwd_out[(stage, microbatch)] = tensors

    def put_input_grads(self, stage: int, microbatch: int, grads: list[torch.Tensor]) -> None:
        """Input gradients of ``stage`` for ``microbatch``, to be sent by its SEND_B."""
        self._bwd_out[(stage, microbatch)] = grads

    def take_forward_input(
        self, stage: int, microbatch: int, action: Action
    ) -> tuple[Any, list[torch.Tensor]]:
        """(spec, tensors) received for the forward of ``stage``; waits for them."""
        tensors = self._take_received(self._fwd_recv, DATA_F, stage, microbatch, action)
        return self.in_spec[stage], tensors

    def take_output_grads(self, stage: int, microbatch: int, action: Action) -> list[torch.Tensor]:
        """The gradients received for the outputs of ``stage``; waits for them."""
        return self._take_received(self._bwd_recv, DATA_B, stage, microbatch, action)

    def _take_received(
        self,
        received: dict[tuple[int, int], _Pending],
        kind: str,
        stage: int,
        microbatch: int,
        action: Action,
    ) -> list[torch.Tensor]:
        """Wait for the data message ``stage`` receives for ``microbatch`` (its ``kind``: ``DATA_F``
        from the stage before, ``DATA_B`` from the one after); settle the sends it proves matched."""
        pending = received.pop((stage, microbatch), None)
        peer = stage - 1 if kind == DATA_F else stage + 1
        if pending is None:
            what, recv = ("outputs of", "RECV_F") if kind == DATA_F else ("gradients from", "RECV_B")
            raise RuntimeError(
                f"pipeline rank {self.rank}: {action} needs the {what} stage {peer}, but no "
                f"{stage}{recv}{microbatch} was issued before it; lower the schedule with merak_pipe.lower()"
            )
        tensors = self.transport.finish(pending)
        self._settle((kind, peer, microbatch))
        return tensors

    def _settle(self, message: tuple[str, int, int]) -> None:
        """``message`` arrived: wait on the sends it proves matched, and let them go."""
        for sent in self._settles.get(message, ()):
            pending = self._sent.pop(sent, None)
            if pending is not None:
                self.transport.complete_send(pending)
            else:  # the peer posted its receive before this rank sent it (early receives)
                self._proven.add(sent)

    def settle_proven(self) -> None:
        """Wait on the sends issued after a message had proven them matched, and let them go (their
        receive was posted before they were sent, so the wait does not depend on the peer's progress)."""
        issued, self._proven_issued = self._proven_issued, []
        for pending in issued:
            self.transport.complete_send(pending)

    def leftovers(self) -> list[str]:
        """What was produced for another rank but never sent."""
        out = []
        if self._fwd_out:
            out.append(f"outputs never sent: {sorted(self._fwd_out)}")
        if self._bwd_out:
            out.append(f"input gradients never sent: {sorted(self._bwd_out)}")
        return out

    # ------------------------------------------------------------------ one unit

    def run_unit(self, unit: tuple[P2POp, ...]) -> list[Action]:
        """Issue one unit as one batch; read received control messages at once. Returns the
        SEND/RECV actions whose data messages it issued."""
        self.position = unit
        chosen = [(op, tr) for op in unit if (tr := self._transfer(op)) is not None]
        if not chosen:
            return []
        pendings = self.transport.issue([tr for _, tr in chosen])
        for (op, _), pending in zip(chosen, pendings, strict=True):
            if op.send:
                if op.message in self._proven:
                    self._proven.discard(op.message)
                    self._proven_issued.append(pending)
                else:
                    self._sent[op.message] = pending
                continue
            if op.kind == DATA_F:
                self._fwd_recv[(op.stage + 1, op.microbatch)] = pending
            elif op.kind == DATA_B:
                self._bwd_recv[(op.stage - 1, op.microbatch)] = pending
            elif op.kind == HEADER:
                self._read_header(op, pending)
            else:
                spec = self.transport.read_spec(pending)
                self.in_spec[op.stage + 1] = spec
                self._last_recv_spec[op.stage + 1] = spec
                self._settle(op.message)
        return [op.action for op, _ in chosen if op.kind in (DATA_F, DATA_B)]

    def _read_header(self, op: P2POp, pending: _Pending) -> None:
        changed, nbytes = self.transport.read_header(pending)
        self._settle(op.message)
        self._header[op.stage] = (changed, nbytes)
        receiver = op.stage + 1
        if not changed:
            last = self._last_recv_spec.get(receiver)
            if last is None:
                raise PipelineCommError(
                    f"{pending.what}: the sender reported an unchanged shape spec "
                    "but none was received before (mismatched runners?)"
                )
            self.in_spec[receiver] = last

    def _what(self, op: P2POp) -> str:
        wire = self._wires.get(id(op))
        return (wire or self._wire(op))[0]

    def _tags(self, op: P2POp, count: int) -> list[int]:
        """Tags of a data message of ``count`` tensors (consecutive from the first; all 0 under NCCL's rules)."""
        wire = self._wires.get(id(op))
        first = (wire or self._wire(op))[1]
        return [first] * count if self.transport.nccl_rules else list(range(first, first + count))

    def metas(self, stage: int, spec: Any, side: str = "in") -> list[TensorMeta]:
        """The tensor metas of ``spec``, the spec of ``stage``'s inputs (``side="in"``) or outputs
        (``"out"``), walked once per new spec."""
        known = self._metas.get((stage, side))
        if known is None or known[0] is not spec:
            known = self._metas[(stage, side)] = (spec, spec_metas(spec))
        return known[1]

    def _transfer(self, op: P2POp) -> Transfer | None:
        t = self.transport
        if op.kind == HEADER:
            if not op.send:
                return t.header_transfer(send=False, stage=op.stage, peer=op.peer, what=self._what(op))
            spec = self.out_spec[op.stage]
            changed = self._last_sent_spec.get(op.stage) != spec
            payload = pickle.dumps(spec) if changed else None
            self._payload[op.stage] = payload
            self._last_sent_spec[op.stage] = spec
            return t.header_transfer(
                send=True,
                stage=op.stage,
                peer=op.peer,
                what=self._what(op),
                changed=changed,
                nbytes=len(payload or b""),
            )
        if op.kind == SPEC:
            if op.send:
                payload = self._payload.pop(op.stage)
                return (
                    None
                    if payload is None
                    else t.spec_transfer(
                        send=True, stage=op.stage, peer=op.peer, what=self._what(op), payload=payload
                    )
                )
            changed, nbytes = self._header[op.stage]
            return (
                t.spec_transfer(send=False, stage=op.stage, peer=op.peer, what=self._what(op), nbytes=nbytes)
                if changed
                else None
            )
        if op.send:
            return self._data_send(op)
        return self._data_recv(op)

    def _data_send(self, op: P2POp) -> Transfer:
        store = self._fwd_out if op.kind == DATA_F else self._bwd_out
        tensors = store.pop((op.stage, op.microbatch), None)
        if tensors is None:
            made_by = "F" if op.kind == DATA_F else "B/I"
            raise RuntimeError(
                f"pipeline rank {self.rank}: action {op.action} sends values that {made_by} has not produced"
            )
        ready = [x.detach().contiguous() for x in tensors]
        return Transfer(True, op.peer, ready, self._tags(op, len(ready)), self._what(op))

    def _data_recv(self, op: P2POp) -> Transfer:
        if op.kind == DATA_F:
            metas = self.metas(op.stage + 1, self.in_spec[op.stage + 1])
        else:
            own = op.stage - 1
            if own not in self.out_spec:
                raise RuntimeError(
                    f"pipeline rank {self.rank}: {op.action} comes before any forward of stage {own}"
                )
            metas = [meta for meta in self.metas(own, self.out_spec[own], "out") if meta.requires_grad]
        buffers = [self.transport.empty(m) for m in metas]
        return Transfer(False, op.peer, buffers, self._tags(op, len(buffers)), self._what(op))
