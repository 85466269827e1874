"""Evaluation over every sample: the last partial batch padded, the padding masked.

[Note: eval weighting] The eval loader keeps the last partial global batch and pads it by
wrapping around (so every batch, and every microbatch, keeps the shape the stages were built
for); each rank's batch says how many of its leading rows are real (``StageBatch.num_real``).
A full batch of ``B`` rows contributes the pipeline's loss (the mean over its microbatches of
``loss_fn``) with weight ``B``; in a padded batch each microbatch with ``r > 0`` real rows
contributes ``loss_fn`` of its real rows alone with weight ``r``. So ``eval_loss`` is the mean over
microbatches of ``loss_fn``, weighted by real samples, and equals the mean over samples of a
per-sample loss (a loss that averages over samples, e.g. cross-entropy without ignored
positions) exactly as a single process over the whole set computes it. ``compute_metrics``
values are per example: the real rows are summed and divided by the number of real samples.

With the default loss (token-mean cross-entropy, -100 ignored) on integer labels, each
microbatch's loss is weighted by its counted labels instead (every microbatch's loss computed
from the outputs of its real rows): ``eval_loss`` is then the mean negative log-likelihood over
every counted token of the set, whatever the layout and the microbatch size, as for a single
process over the whole set, also when samples count different numbers of tokens (prompt
masking, padding); ``exp(eval_loss)`` is the per-token perplexity.

Not done here: building the loader (``StageAwareDataLoader(..., drop_last=False)``) and choosing
the eval microbatch size (the trainer).
"""

from __future__ import annotations

import contextlib
import logging
import traceback
import typing
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from merak_core.data.loader import StageBatch

logger = logging.getLogger(__name__)


def rows(value: Any, lo: int, hi: int) -> Any:
    """Rows ``[lo, hi)`` (dim 0) of every tensor in ``value`` (a tensor, tuple/list or mapping of them),
    in a container of the same kind: a transformers ``ModelOutput`` stays one, so a ``loss_fn`` reading
    ``output.logits`` gets the rows of a padded batch as it gets a full batch."""
    if isinstance(value, torch.Tensor):
        return value[lo:hi]
    if isinstance(value, (tuple, list)):
        return type(value)(rows(v, lo, hi) for v in value)
    if isinstance(value, Mapping):
        cut = {k: rows(v, lo, hi) for k, v in value.items()}
        if type(value) is dict:
            return cut
        try:  # a ModelOutput (a dataclass of its keys) or another mapping built from keywords
            return type(value)(**cut)
        except TypeError:
            return cut
    return value


def _batch_rows(labels: Any) -> int:
    first = labels
    while isinstance(first, (tuple, list)):
        first = first[0]
    if isinstance(first, Mapping):
        first = next(iter(first.values()))
    return int(first.shape[0])


class EvalSums:
    """Sample-weighted sums of one evaluation on this rank (see [Note: eval weighting])."""

    def __init__(self) -> None:
        self.loss = 0.0
        self.loss_count = 0.0
        self.metrics: dict[str, float] = {}
        self.metric_count = 0.0

    def add_loss(self, value: float, weight: float) -> None:
        self.loss += value * weight
        self.loss_count += weight

    def add_metrics(self, values: Mapping[str, torch.Tensor], real: int) -> None:
        for name, v in values.items():
            per_example = v.double().reshape(-1)[:real] if v.dim() > 0 else v.double().reshape(1)
            self.metrics[f"eval_{name}"] = self.metrics.get(f"eval_{name}", 0.0) + float(per_example.sum())
        self.metric_count += real


def evaluate_loader(
    loader: Iterable[StageBatch],
    *,
    run: Callable[[StageBatch, bool], Any],
    loss_fn: Callable[[Any, Any], torch.Tensor],
    compute_metrics: Callable[[torch.Tensor, torch.Tensor], Any] | None,
    num_microbatches: int,
    tp_rank: int,
    device: torch.device,
    autocast: Callable[[], contextlib.AbstractContextManager[Any]],
) -> dict[str, float]:
    """``eval_loss`` and ``eval_<metric>`` over every real sample of ``loader``; collective over all ranks.

    ``run(batch, return_outputs)`` evaluates one batch with the pipeline and returns what
    ``PipelineRunner.evaluate`` returns (None off the last stage).
    """
    from merak_core.run.engine import default_loss

    sums = EvalSums()
    failure: str | None = (
        None  # the metrics function's error: the pass goes on (the pipeline needs it), then all raise
    )
    for batch in loader:
        partial = batch.num_real is not None
        by_token = (
            loss_fn is default_loss
            and isinstance(batch.labels, torch.Tensor)
            and not batch.labels.is_floating_point()
        )
        per_micro = partial or by_token
        result = run(batch, compute_metrics is not None or per_micro)
        if result is None:
            continue
        loss, outputs = result if (compute_metrics is not None or per_micro) else (result, None)
        labels = typing.cast(torch.Tensor, batch.labels).to(device)
        total = _batch_rows(labels)
        real = total if batch.num_real is None else batch.num_real
        if per_micro:
            _add_partial_loss(
                sums, outputs, labels, real, total // num_microbatches, loss_fn, autocast, by_token=by_token
            )
        else:
            sums.add_loss(float(loss), total)
        if compute_metrics is not None and real > 0 and failure is None:
            if isinstance(outputs, Mapping) and "logits" in outputs:  # a ModelOutput or a dict
                outputs = outputs["logits"]
            logits = typing.cast(torch.Tensor, getattr(outputs, "logits", outputs))
            values, failure = _call_metrics(compute_metrics, logits, labels)
            if values is not None:
                sums.add_metrics(values, real)
    if tp_rank != 0:  # TP ranks of a stage hold the same values: count them once
        sums = _zeroed(sums)
    names, failure = agree_names(sorted(sums.metrics), failure)
    if failure is not None:
        raise ValueError(failure)  # on every rank, with the last stage's words
    vec = torch.tensor(
        [sums.loss, sums.loss_count, sums.metric_count] + [sums.metrics.get(n, 0.0) for n in names],
        dtype=torch.float64,
        device=device,
    )
    dist.all_reduce(vec)
    out = {"eval_loss": float(vec[0]) / float(vec[1]) if float(vec[1]) > 0 else float("nan")}
    for i, name in enumerate(names):
        out[name] = float(vec[3 + i]) / max(1.0, float(vec[2]))
    return out


def agree_names(names: list[str], failure: str | None = None) -> tuple[list[str], str | None]:
    """Metric names (and a metrics function's failure) are only known on last-stage ranks: share them, so
    every rank reduces the same vector, or raises the same error."""
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (names, failure))
    failures = [f for _, f in gathered if f is not None]
    return max((n for n, _ in gathered), key=len), (failures[0] if failures else None)


def _call_metrics(
    fn: Callable[[torch.Tensor, torch.Tensor], Any], logits: torch.Tensor, labels: torch.Tensor
) -> tuple[Mapping[str, torch.Tensor] | None, str | None]:
    """``fn``'s per-example values as a mapping, or the error (naming ``fn``) that ends the evaluation."""
    name = getattr(fn, "__qualname__", None) or repr(fn)
    shapes = f"logits {list(logits.shape)}, labels {list(labels.shape)}"
    try:
        values = fn(logits, labels)
    except Exception as exc:  # noqa: BLE001 - reported once, by every rank, with the function's name
        frames = traceback.extract_tb(exc.__traceback__)
        where = f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""
        return None, (
            f"compute_metrics {name} failed in evaluation ({shapes}): {type(exc).__name__}: {exc}{where}; "
            "fix the function: it gets (logits, labels) and returns per-example values"
        )
    named = {"metric": values} if isinstance(values, torch.Tensor) else values
    if not isinstance(named, Mapping) or not all(isinstance(v, torch.Tensor) for v in named.values()):
        return None, (
            f"compute_metrics {name} returned {type(values).__name__} in evaluation ({shapes}): return a tensor "
            "of per-example values, or a dict of name -> such tensors"
        )
    return named, None


def shapes_specialised(module: torch.nn.Module, device: torch.device, args: Any) -> bool:
    """Whether any rank's stages were traced by torch.export with fixed shapes (merak_graph ``strict_shapes``).

    Such stages only take the training microbatch, so evaluation then runs in microbatches of the
    training size (logged once). Collective: every rank takes the same decision.
    """
    mine = any(getattr(m, "strict_shapes", False) for m in module.modules())
    flag = torch.tensor([1.0 if mine else 0.0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    specialised = bool(flag.item())
    if specialised and dist.get_rank() == 0:
        logger.info(
            "evaluate: the stages were traced by torch.export with the training microbatch of %d "
            "(shapes specialised), so evaluation runs in microbatches of %d instead of "
            "per_device_eval_batch_size=%d",
            args.micro_batch_size,
            args.micro_batch_size,
            args.per_device_eval_batch_size,
        )
    return specialised


def _zeroed(sums: EvalSums) -> EvalSums:
    empty = EvalSums()
    empty.metrics = dict.fromkeys(sums.metrics, 0.0)
    return empty


def _add_partial_loss(
    sums: EvalSums,
    outputs: Any,
    labels: torch.Tensor,
    real: int,
    micro: int,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    autocast: Callable[[], contextlib.AbstractContextManager[Any]],
    *,
    by_token: bool = False,
) -> None:
    """Each microbatch's loss over its real rows, weighted by their number (padding rows dropped),
    or (``by_token``) by their labels other than -100."""
    for lo in range(0, real, micro):
        hi = min(lo + micro, real)
        counted = int((labels[lo:hi] != -100).sum()) if by_token else hi - lo
        if counted == 0:
            continue  # nothing counted: the token mean of these rows is not defined (NaN), and weighs 0
        with autocast():
            value = loss_fn(rows(outputs, lo, hi), rows(labels, lo, hi))
        sums.add_loss(float(value), counted)


__all__ = ["EvalSums", "agree_names", "evaluate_loader", "rows", "shapes_specialised"]
