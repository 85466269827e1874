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
  forward message of a round on each channel (a sending stage) is preceded by a fixed-size
  header ``int64[2] = (changed, nbytes)``; when the spec differs from the one sent last time,
  the pickled spec follows as a ``uint8[nbytes]`` message. Microbatches of one round share
  the spec (they are equal slices of one batch); a microbatch whose spec differs raises.
  So a new sequence length is picked up on the next step without the user declaring shapes.
- Every message has its own tag, so receives can be posted in any order (gloo matches by
  (peer, tag)). NCCL ignores tags and matches in issue order; running over NCCL therefore
  needs schedules whose send and receive orders agree per pair of ranks (the built-in
  lowering produces such orders).

Every wait has a timeout, and a failed or timed-out wait raises :class:`PipelineCommError`
naming this rank, the stage, the action and the microbatch. This module does not decide
*when* to communicate; the runner does (``merak_pipe.runner``).
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

    def walk(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            meta = TensorMeta(tuple(v.shape), v.dtype, bool(v.requires_grad))
            tensors.append(v)
            return _Leaf(len(tensors) - 1, meta)
        if isinstance(v, tuple):
            return ("tuple", tuple(walk(x) for x in v))
        if isinstance(v, list):
            return ("list", tuple(walk(x) for x in v))
        if isinstance(v, dict):
            for key in v:
                if not isinstance(key, str):
                    raise TypeError(
                        f"stage boundary dict key {key!r} is a {type(key).__name__}; "
                        "use string keys (a dict boundary is passed as keyword arguments)"
                    )
            return ("dict", tuple((k, walk(x)) for k, x in v.items()))
        if isinstance(v, _CONSTANT_TYPES):
            return ("const", v)
        raise TypeError(
            f"stage boundary holds a {type(v).__name__}; a boundary may hold tensors, tuples, lists, "
            "dicts with string keys and int/float/bool/str/None constants"
        )

    spec = walk(value)
    if len(tensors) > _MAX_TENSORS:
        raise ValueError(f"stage boundary holds {len(tensors)} tensors; at most {_MAX_TENSORS} are supported")
    return spec, tensors


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
class _Pending:
    """An in-flight receive: its works, its buffers, and what it is for (for error messages)."""

    works: list[Any]
    tensors: list[torch.Tensor]
    what: str


class P2PTransport:
    """Tagged, timed isend/irecv between the stages of one pipeline.

    ``group`` is the pipeline process group (possibly a subgroup of the world); peers are
    given as pipeline (group) ranks and translated with ``dist.get_global_rank``.
    """

    def __init__(
        self, *, group: dist.ProcessGroup, num_stages: int, num_microbatches: int,
        timeout: timedelta, device: torch.device,
    ) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.global_rank = dist.get_rank()
        self.num_stages = num_stages
        self.num_microbatches = num_microbatches
        self.timeout = timeout
        self.device = device
        self._sends: list[tuple[list[Any], list[torch.Tensor], str]] = []
        self._batch: list[dist.P2POp] | None = None
        self._batch_owners: list[tuple[str, list[Any]]] = []
        self._pool: dict[tuple[tuple[int, ...], torch.dtype], list[torch.Tensor]] = {}
        self.buffers_allocated = 0
        """Receive buffers allocated so far (statistics)."""
        self.buffers_reused = 0
        """Receive buffers taken from the pool instead (statistics)."""

    # ------------------------------------------------------------------ tags and peers

    def _tag(self, kind: int, stage: int, microbatch: int, index: int = 0) -> int:
        return ((kind * self.num_stages + stage) * self.num_microbatches + microbatch) * _MAX_TENSORS + index

    def _peer(self, pipeline_rank: int) -> int:
        return dist.get_global_rank(self.group, pipeline_rank)

    def describe(self, stage: int, action: str, microbatch: int, peer: int) -> str:
        """How messages and errors name a transfer."""
        return (
            f"pipeline rank {self.rank} (global rank {self.global_rank}), stage {stage}, "
            f"action {stage}{action}{microbatch} (microbatch {microbatch}), peer pipeline rank {peer}"
        )

    # ------------------------------------------------------------------ batching

    def begin_batch(self) -> None:
        """Collect the following sends/receives into one ``batch_isend_irecv`` call."""
        self._batch = []
        self._batch_owners = []

    def end_batch(self) -> None:
        """Issue the collected operations at once and hand each its works."""
        ops, owners = self._batch or [], self._batch_owners
        self._batch = None
        self._batch_owners = []
        if not ops:
            return
        works = dist.batch_isend_irecv(ops)
        cursor = 0
        for _, sink in owners:
            n = len(sink)
            sink[:] = works[cursor:cursor + n]
            cursor += n

    def _issue(self, op: Any, tensors: list[torch.Tensor], peer: int, tags: list[int]) -> list[Any]:
        """isend/irecv each tensor (or queue them into the open batch); returns the works list."""
        global_peer = self._peer(peer)
        if self._batch is not None:
            sink: list[Any] = [None] * len(tensors)
            for t, tag in zip(tensors, tags, strict=True):
                self._batch.append(dist.P2POp(op, t, global_peer, self.group, tag))
            self._batch_owners.append(("", sink))
            return sink
        return [op(t, global_peer, group=self.group, tag=tag) for t, tag in zip(tensors, tags, strict=True)]

    # ------------------------------------------------------------------ waiting

    def _wait(self, works: list[Any], what: str) -> None:
        for work in works:
            if work is None:
                raise AssertionError(f"{what}: a batched operation was never issued")
            try:
                ok = work.wait(self.timeout)
            except Exception as exc:  # noqa: BLE001 - re-raised with the pipeline context
                text = str(exc)
                cls = PipelineTimeoutError if "imed out" in text or "imeout" in text else PipelineCommError
                reason = (
                    f"did not complete within the timeout of {self.timeout.total_seconds():g} s"
                    if cls is PipelineTimeoutError else "failed (is the peer alive?)"
                )
                raise cls(f"{what}: {reason}: {text.splitlines()[0] if text else type(exc).__name__}") from exc
            if ok is False:
                raise PipelineTimeoutError(
                    f"{what}: did not complete within the timeout of {self.timeout.total_seconds():g} s"
                )

    # ------------------------------------------------------------------ buffers

    def _empty(self, meta: TensorMeta) -> torch.Tensor:
        free = self._pool.get((meta.shape, meta.dtype))
        if free:
            self.buffers_reused += 1
            return free.pop()
        self.buffers_allocated += 1
        return torch.empty(meta.shape, dtype=meta.dtype, device=self.device)

    def release(self, tensors: Sequence[torch.Tensor]) -> None:
        """Give receive buffers back for reuse (only once no autograd graph refers to them)."""
        for t in tensors:
            if t.requires_grad or t.grad_fn is not None:
                t = t.detach()
            key = (tuple(t.shape), t.dtype)
            bucket = self._pool.setdefault(key, [])
            if len(bucket) < 2 * self.num_microbatches:
                bucket.append(t)

    def clear_pool(self) -> None:
        """Drop every cached buffer (e.g. after a shape change)."""
        self._pool.clear()

    # ------------------------------------------------------------------ sends

    def send_header(self, *, stage: int, microbatch: int, peer: int, spec: Any, changed: bool) -> None:
        """Send the per-round header (and the pickled spec when it changed) for ``stage``'s outputs."""
        payload = pickle.dumps(spec) if changed else b""
        header = torch.tensor([1 if changed else 0, len(payload)], dtype=torch.int64)
        what = self.describe(stage, "SEND_F", microbatch, peer) + " [shape header]"
        tensors = [header]
        tags = [self._tag(_HEADER, stage, 0)]
        if changed:
            tensors.append(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
            tags.append(self._tag(_SPEC, stage, 0))
        works = [dist.isend(t, self._peer(peer), group=self.group, tag=tag) for t, tag in zip(tensors, tags, strict=True)]
        self._sends.append((works, tensors, what))

    def send_tensors(self, *, backward: bool, stage: int, microbatch: int, peer: int,
                     tensors: list[torch.Tensor], action: str) -> None:
        """Send a forward boundary (``backward=False``) or the input gradients of ``stage``."""
        kind = _BWD if backward else _FWD
        ready = [t.detach().contiguous() for t in tensors]
        tags = [self._tag(kind, stage, microbatch, i) for i in range(len(ready))]
        works = self._issue(dist.isend, ready, peer, tags)
        self._sends.append((works, ready, self.describe(stage, action, microbatch, peer)))

    def wait_sends(self) -> None:
        """Wait for every outstanding send of this round."""
        sends, self._sends = self._sends, []
        for works, _tensors, what in sends:
            self._wait(works, what)

    # ------------------------------------------------------------------ receives

    def recv_header(self, *, stage: int, microbatch: int, peer: int, action: str) -> _Pending:
        """Post the receive of a round header for the boundary into ``stage`` (from ``stage - 1``)."""
        header = torch.empty(2, dtype=torch.int64)
        tag = self._tag(_HEADER, stage - 1, 0)
        work = dist.irecv(header, self._peer(peer), group=self.group, tag=tag)
        return _Pending([work], [header], self.describe(stage, action, microbatch, peer) + " [shape header]")

    def finish_header(self, pending: _Pending, *, stage: int, peer: int, last_spec: Any) -> tuple[Any, bool]:
        """Wait for a header; return (spec, changed), receiving the pickled spec if it changed."""
        self._wait(pending.works, pending.what)
        changed, nbytes = (int(x) for x in pending.tensors[0].tolist())
        if not changed:
            if last_spec is None:
                raise PipelineCommError(f"{pending.what}: the sender reported an unchanged shape spec "
                                        "but none was received before (mismatched runners?)")
            return last_spec, False
        buf = torch.empty(nbytes, dtype=torch.uint8)
        work = dist.irecv(buf, self._peer(peer), group=self.group, tag=self._tag(_SPEC, stage - 1, 0))
        self._wait([work], pending.what)
        return pickle.loads(buf.numpy().tobytes()), True  # noqa: S301 - peer ranks of one job

    def recv_tensors(self, *, backward: bool, stage: int, microbatch: int, peer: int,
                     metas: Sequence[TensorMeta], action: str) -> _Pending:
        """Post the receives of one boundary message; the tag is keyed by the *sending* stage."""
        kind = _BWD if backward else _FWD
        sender = stage + 1 if backward else stage - 1
        buffers = [self._empty(m) for m in metas]
        tags = [self._tag(kind, sender, microbatch, i) for i in range(len(buffers))]
        works = self._issue(dist.irecv, buffers, peer, tags)
        return _Pending(works, buffers, self.describe(stage, action, microbatch, peer))

    def finish(self, pending: _Pending) -> list[torch.Tensor]:
        """Wait for a posted receive and return its buffers."""
        self._wait(pending.works, pending.what)
        return pending.tensors
