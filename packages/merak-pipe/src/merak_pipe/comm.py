"""Point-to-point transport of stage-boundary values over torch.distributed.

What crosses a stage boundary ([Note: boundary values]): a tensor, a tuple/list or a dict
(string keys) of tensors, nested freely, plus non-tensor constants (int, float, bool, str,
None). :func:`flatten_boundary` splits such a value into a picklable *spec* (the structure
with every tensor replaced by its :class:`TensorMeta` and constants kept inline) and the
flat list of tensors; :func:`unflatten_boundary` rebuilds it.

[Note: boundary values]
- Forward messages carry every tensor of the boundary. Backward messages carry one gradient
  per tensor whose meta says ``requires_grad`` (the sender's tensor required grad), in
  flattened order, so both sides agree on the message without extra metadata.
- Shapes and dtypes are exchanged per *round* (one ``step`` or ``evaluate`` call): the first
  forward message of a round of each sending stage is preceded by a fixed-size header
  ``int64[2] = (changed, nbytes)``; when the spec differs from the one sent last time, the
  pickled spec follows as a ``uint8[nbytes]`` message. Both live on the pipeline's device, so an
  NCCL group carries them like any tensor; a header is sent from a reused buffer, copied from
  pinned host memory without blocking on CUDA ([Note: header buffers] in ``_p2p_books.py``). Microbatches of one round share the spec (they are
  equal slices of one batch); a microbatch whose spec differs raises. So a new sequence length
  is picked up on the next step without the user declaring shapes.
- Messages of a pair of ranks are matched by issue order alone, as on NCCL: the runner issues
  the units of :func:`merak_pipe.p2p_order.issue_orders`, which both sides derive from the same
  schedule ([Note: issue order]).

A failed or timed-out wait raises :class:`PipelineCommError` naming this rank, the stage, the
action and the microbatch (on CUDA, waits do not block the host and the process group's
timeout guards instead). This module does not decide *when* to communicate; the runner does
(``merak_pipe.runner``).
"""

from __future__ import annotations

import logging
import pickle
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from merak_pipe._p2p_books import _completed, _Pending, _TransportBooks

__all__ = [
    "PipelineCommError",
    "PipelineTimeoutError",
    "TensorMeta",
    "flatten_boundary",
    "unflatten_boundary",
]

logger = logging.getLogger(__name__)

_CONSTANT_TYPES = (int, float, bool, str, type(None))

# Message kinds (part of the tag): forward data, backward data, header, pickled spec.
_FWD, _BWD, _HEADER, _SPEC = 0, 1, 2, 3
_MAX_TENSORS = 1024


class PipelineCommError(RuntimeError):
    """A pipeline send/receive failed. The message names rank, stage, action and microbatch."""


class PipelineTimeoutError(PipelineCommError):
    """A pipeline send/receive did not complete within the runner's timeout."""


@dataclass(frozen=True)
class TensorMeta:
    """Shape, dtype and grad flag of one boundary tensor (what the receiver must allocate)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool


@dataclass(frozen=True)
class _Leaf:
    """Placeholder for the ``index``-th tensor in a spec."""

    index: int
    meta: TensorMeta


def flatten_boundary(value: Any) -> tuple[Any, list[torch.Tensor]]:
    """Split a boundary value into (spec, tensors); see [Note: boundary values]."""
    tensors: list[torch.Tensor] = []
    # A module-level walk, not a nested recursive function: that one refers to itself through its
    # closure, a reference cycle that keeps ``tensors`` (stage outputs, and through their grad_fn a
    # graph retained for a split backward) alive until the cyclic garbage collector runs.
    spec = _flatten_into(value, tensors)
    if len(tensors) > _MAX_TENSORS:
        raise ValueError(f"stage boundary holds {len(tensors)} tensors; at most {_MAX_TENSORS} are supported")
    return spec, tensors


def _flatten_into(v: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(v, torch.Tensor):
        meta = TensorMeta(tuple(v.shape), v.dtype, bool(v.requires_grad))
        tensors.append(v)
        return _Leaf(len(tensors) - 1, meta)
    if isinstance(v, tuple):
        return ("tuple", tuple(_flatten_into(x, tensors) for x in v))
    if isinstance(v, list):
        return ("list", tuple(_flatten_into(x, tensors) for x in v))
    if isinstance(v, dict):
        for key in v:
            if not isinstance(key, str):
                raise TypeError(
                    f"stage boundary dict key {key!r} is a {type(key).__name__}; "
                    "use string keys (a dict boundary is passed as keyword arguments)"
                )
        return ("dict", tuple((k, _flatten_into(x, tensors)) for k, x in v.items()))
    if isinstance(v, _CONSTANT_TYPES):
        return ("const", v)
    raise TypeError(
        f"stage boundary holds a {type(v).__name__}; a boundary may hold tensors, tuples, lists, "
        "dicts with string keys and int/float/bool/str/None constants"
    )


def unflatten_boundary(spec: Any, tensors: Sequence[torch.Tensor]) -> Any:
    """Rebuild the value that :func:`flatten_boundary` split."""
    if isinstance(spec, _Leaf):
        return tensors[spec.index]
    tag, payload = spec
    if tag == "tuple":
        return tuple(unflatten_boundary(x, tensors) for x in payload)
    if tag == "list":
        return [unflatten_boundary(x, tensors) for x in payload]
    if tag == "dict":
        return {k: unflatten_boundary(x, tensors) for k, x in payload}
    if tag == "const":
        return payload
    raise AssertionError(f"corrupt boundary spec {spec!r}")


def describe_spec(spec: Any) -> str:
    """A boundary spec's tensors for error messages, e.g. ``[(2, 8, 16) float32]``."""
    metas = spec_metas(spec)
    return "[" + ", ".join(f"{tuple(m.shape)} {str(m.dtype).replace('torch.', '')}" for m in metas) + "]"


def spec_metas(spec: Any) -> list[TensorMeta]:
    """The tensor metas of a spec, in flattened order."""
    out: list[tuple[int, TensorMeta]] = []

    def walk(s: Any) -> None:
        if isinstance(s, _Leaf):
            out.append((s.index, s.meta))
            return
        tag, payload = s
        if tag in ("tuple", "list"):
            for x in payload:
                walk(x)
        elif tag == "dict":
            for _, x in payload:
                walk(x)

    walk(spec)
    out.sort(key=lambda item: item[0])
    return [m for _, m in out]


@dataclass
class Transfer:
    """One message of a batch: its tensors go to (``send``) or come from ``peer`` (a pipeline rank)."""

    send: bool
    peer: int
    tensors: list[torch.Tensor]
    tags: list[int]
    what: str


class _BatchWork:
    """The single Work an NCCL batch returns, emulated over the works of a backend that gives one per op.

    Every owner of the batch waits on it; the works under it are waited once (a gloo Work must
    not be waited twice: each wait consumes one completion).
    """

    def __init__(self, works: list[Any]) -> None:
        self._works = works

    def wait(self, timeout: timedelta | None = None) -> bool:
        while self._works:
            work = self._works[0]
            ok = work.wait() if timeout is None else work.wait(timeout)
            if ok is False:
                return False
            self._works.pop(0)
        return True

    def is_completed(self) -> bool:
        return all(_completed(work) for work in self._works)


def distribute_works(works: Sequence[Any], counts: Sequence[int]) -> list[list[Any]]:
    """Hand each owner of a batch (``counts[i]`` ops) its works.

    A backend returns one Work per op (gloo) or one Work for the whole batch (NCCL): then every
    owner gets that Work and waits on it before reading its buffers.
    """
    total = sum(counts)
    if len(works) == total:
        out, cursor = [], 0
        for n in counts:
            out.append(list(works[cursor : cursor + n]))
            cursor += n
        return out
    if len(works) == 1:
        return [[works[0]] if n else [] for n in counts]
    raise AssertionError(f"batch_isend_irecv returned {len(works)} works for {total} operations")


class P2PTransport(_TransportBooks):
    """Batched isend/irecv between the stages of one pipeline, matched per pair of ranks in issue order.

    Every operation, a single one included, goes through ``batch_isend_irecv`` on ``group`` (the
    pipeline process group, possibly a subgroup; peers are pipeline ranks), so all of them use
    the group's one communicator. The runner issues the units of
    :func:`merak_pipe.p2p_order.issue_orders` in order, so messages need no tags. With
    ``nccl_rules`` (always on a CUDA device) every op uses tag 0 and a batch yields one Work, as
    on NCCL; otherwise (gloo) each message keeps a distinct tag, so a disagreement about the order
    shows as a named timeout instead of swapped data. Control data (headers, specs) lives on
    ``device`` like the data. Waits on CUDA are stream waits (``work.wait()``): the host does not
    block, and the process-group timeout and NCCL's watchdog stand guard; elsewhere every wait has
    ``timeout`` and a failure raises :class:`PipelineCommError` naming rank, stage, action and
    microbatch.
    """

    def __init__(
        self,
        *,
        group: dist.ProcessGroup,
        num_stages: int,
        num_microbatches: int,
        timeout: timedelta,
        device: torch.device,
        nccl_rules: bool | None = None,
    ) -> None:
        super().__init__()
        self.group = group
        self.rank = dist.get_rank(group)
        self.global_rank = dist.get_rank()
        # Looked up once: every op of every round needs its peer's global rank.
        self._global_ranks = [dist.get_global_rank(group, r) for r in range(dist.get_world_size(group))]
        self.num_stages = num_stages
        self.num_microbatches = num_microbatches
        self.timeout = timeout
        self.device = torch.device(device)
        # Any accelerator backend (NCCL) matches by issue order and returns one Work per batch.
        self.nccl_rules = self.device.type != "cpu" or bool(nccl_rules)
        self.host_waits = self.device.type != "cuda"
        """True where waits block the host with a timeout (CPU); False on CUDA (stream waits)."""
        self.batch_isend_irecv: Any = dist.batch_isend_irecv
        """The batch call (replaceable, e.g. by a test's fake)."""

    # ------------------------------------------------------------------ tags and peers

    def tag(self, kind: int, stage: int, microbatch: int, index: int = 0) -> int:
        """The tag of one tensor of a message (0 under NCCL's rules)."""
        if self.nccl_rules:
            return 0
        return ((kind * self.num_stages + stage) * self.num_microbatches + microbatch) * _MAX_TENSORS + index

    def data_tags(self, backward: bool, stage: int, microbatch: int, count: int) -> list[int]:
        """Tags of a data message of the *sending* ``stage``."""
        kind = _BWD if backward else _FWD
        return [self.tag(kind, stage, microbatch, i) for i in range(count)]

    def describe(self, stage: int, action: str, microbatch: int, peer: int) -> str:
        """How messages and errors name a transfer."""
        return (
            f"pipeline rank {self.rank} (global rank {self.global_rank}), stage {stage}, "
            f"action {stage}{action}{microbatch} (microbatch {microbatch}), peer pipeline rank {peer}"
        )

    # ------------------------------------------------------------------ issuing

    def issue(self, transfers: Sequence[Transfer]) -> list[_Pending]:
        """Issue ``transfers`` as one batch; return one pending per transfer (sends are also kept
        until they completed: see :meth:`reap_sends`)."""
        self.reap_sends()
        ops = []
        for tr in transfers:
            op = dist.isend if tr.send else dist.irecv
            global_peer = self._global_ranks[tr.peer]
            ops += [
                dist.P2POp(op, t, global_peer, self.group, tag)
                for t, tag in zip(tr.tensors, tr.tags, strict=True)
            ]
        pendings = [_Pending([], tr.tensors, tr.what) for tr in transfers]
        if ops:
            works = list(self.batch_isend_irecv(ops))
            if self.nccl_rules and len(works) > 1:
                works = [_BatchWork(works)]
            for pending, own in zip(
                pendings, distribute_works(works, [len(tr.tensors) for tr in transfers]), strict=True
            ):
                pending.works = own
        self._sends += [p for p, tr in zip(pendings, transfers, strict=True) if tr.send]
        return pendings

    # ------------------------------------------------------------------ waiting

    def wait(self, works: list[Any], what: str) -> None:
        """Wait for ``works`` (see the class docstring for the CUDA and CPU behaviour)."""
        for work in works:
            try:
                ok = work.wait(self.timeout) if self.host_waits else work.wait()
            except Exception as exc:  # noqa: BLE001 - re-raised with the pipeline context
                text = str(exc)
                cls = PipelineTimeoutError if "imed out" in text or "imeout" in text else PipelineCommError
                reason = (
                    f"did not complete within the timeout of {self.timeout.total_seconds():g} s"
                    if cls is PipelineTimeoutError
                    else "failed (is the peer alive?)"
                )
                raise cls(
                    f"{what}: {reason}: {text.splitlines()[0] if text else type(exc).__name__}"
                ) from exc
            if ok is False:
                raise PipelineTimeoutError(
                    f"{what}: did not complete within the timeout of {self.timeout.total_seconds():g} s"
                )

    def finish(self, pending: _Pending) -> list[torch.Tensor]:
        """Wait for an issued receive and return its buffers."""
        self.wait(pending.works, pending.what)
        return pending.tensors

    def empty(self, meta: TensorMeta) -> torch.Tensor:
        """A receive buffer for ``meta`` (from the pool when one is free; [Note: buffer lifetime]
        in ``_p2p_books.py``)."""
        return self._take_buffer(meta.shape, meta.dtype)

    # ------------------------------------------------------------------ control messages

    def header_transfer(
        self, *, send: bool, stage: int, peer: int, what: str, changed: bool = False, nbytes: int = 0
    ) -> Transfer:
        """The round header ``int64[2] = (changed, nbytes)`` of the sending ``stage``, on the device, in a
        reused buffer ([Note: header buffers] in ``_p2p_books.py``)."""
        if send:
            header = self._send_header_buffer((1 if changed else 0, nbytes))
        else:
            header = self._recv_header_buffer(stage)
        return Transfer(send, peer, [header], [self.tag(_HEADER, stage, 0)], what + " [shape header]")

    def spec_transfer(
        self, *, send: bool, stage: int, peer: int, what: str, payload: bytes = b"", nbytes: int = 0
    ) -> Transfer:
        """The pickled spec of the sending ``stage`` as ``uint8[nbytes]``, on the device."""
        if send:
            tensor = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
            if self.device.type == "cuda" and torch.cuda.is_available():  # only when a spec changed
                tensor = tensor.pin_memory()
            tensor = tensor.to(self.device, non_blocking=True)
        else:
            tensor = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return Transfer(send, peer, [tensor], [self.tag(_SPEC, stage, 0)], what + " [shape spec]")

    def read_header(self, pending: _Pending) -> tuple[bool, int]:
        """Wait for a received header; (changed, nbytes). Reading it waits for the device."""
        self.wait(pending.works, pending.what)
        changed, nbytes = (int(x) for x in pending.tensors[0].tolist())
        return bool(changed), nbytes

    def read_spec(self, pending: _Pending) -> Any:
        """Wait for a received spec and unpickle it (peer ranks of one job)."""
        self.wait(pending.works, pending.what)
        return pickle.loads(pending.tensors[0].cpu().numpy().tobytes())  # noqa: S301 - peer ranks of one job
