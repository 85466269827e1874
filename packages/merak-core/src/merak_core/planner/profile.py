"""Measured costs of a model: :class:`ModelProfile` and :func:`profile_model`.

A profile holds per-layer costs for one sample (forward and backward seconds, activation bytes,
parameter bytes), a fixed per-microbatch overhead, the optimizer's cost per parameter byte, and
what constrains tensor parallelism (heads, kv heads, vocabulary). :func:`profile_model` measures
one on the local device by running the model (forward times and saved-activation bytes per layer
through hooks); profiles are cached as JSON keyed by a model fingerprint and the device.

[Note: device clocks] On CUDA a kernel launch returns before the kernel runs, so every time
taken here reads the host clock after ``torch.cuda.synchronize`` (:func:`_now`); per-layer
hooks synchronise too, which serialises the profiled run but makes each layer's time its own.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

logger = logging.getLogger(__name__)

__all__ = ["ModelProfile", "measure_contention", "model_fingerprint", "profile_model"]


@dataclass(kw_only=True)
class ModelProfile:
    """Per-layer costs of one sample, the sizes that constrain TP, and where they came from."""

    layer_forward_s: list[float]
    """Forward seconds of each layer for one sample."""
    layer_backward_s: list[float]
    """Backward seconds of each layer for one sample (without recomputation)."""
    layer_activation_bytes: list[float]
    """Bytes each layer keeps for backward, for one sample."""
    layer_param_bytes: list[float]
    """Parameter bytes of each layer (embeddings and head counted in the first / last layer)."""
    shared_param_bytes: float = 0.0
    """Bytes of parameters counted in both the first and the last layer (a tied embedding and head):
    a stage holding both layers holds them once."""
    microbatch_overhead_s: float = 0.0
    """Fixed seconds per microbatch and stage (forward + backward) that do not grow with the batch."""
    boundary_bytes: float = 0.0
    """Bytes of a layer's output for one sample (the pipeline message and the TP all-reduce size)."""
    optimizer_s_per_byte: float = 0.0
    """Seconds of one optimizer step (gradient clipping and AdamW) per parameter byte."""
    tp_scale: dict[int, float] = field(default_factory=dict)
    """Per TP degree (1 included: no TP): measured / modelled forward-and-backward time of the layers
    (compute and TP all-reduces), from short runs of the real model in the pure DP x TP layouts with
    every rank busy (``merak_core.tp_probe``); 1 where absent. Small layers split over ranks do not
    run tp times faster on a CPU: this says how much slower they run."""
    overhead_scale: float = 1.0
    """Measured / modelled time outside the pipeline (DP all-reduce, optimizer, clipping, the per-step
    all-reduces and the ranks' skew), from the same probe runs; 1: not measured."""
    num_heads: int | None = None
    """Attention heads (tp must divide it); None: no constraint."""
    num_kv_heads: int | None = None
    """Key/value heads (tp must divide it); None: same as ``num_heads``."""
    vocab_size: int | None = None
    """Vocabulary size (tp must divide it); None: no constraint."""
    fingerprint: str = ""
    """Model fingerprint (see :func:`model_fingerprint`)."""
    device: str = "cpu"
    """Device the costs were measured on, or ``estimate``."""

    def __post_init__(self) -> None:
        n = len(self.layer_forward_s)
        if n < 1:
            raise ValueError(
                "ModelProfile.layer_forward_s is empty: expected one value per layer (at least one)"
            )
        for name in ("layer_backward_s", "layer_activation_bytes", "layer_param_bytes"):
            values = getattr(self, name)
            if len(values) != n:
                raise ValueError(
                    f"ModelProfile.{name} has {len(values)} values but layer_forward_s has {n}: "
                    "give one value per layer"
                )
        for name in ("layer_forward_s", "layer_backward_s", "layer_activation_bytes", "layer_param_bytes"):
            for v in getattr(self, name):
                if not v >= 0 or math.isinf(v):
                    raise ValueError(f"ModelProfile.{name} holds {v!r}: expected finite values >= 0")
        scales = {}
        for k, v in dict(self.tp_scale).items():  # JSON gives string keys
            if int(k) < 1 or not (float(v) > 0 and math.isfinite(float(v))):
                raise ValueError(
                    f"ModelProfile.tp_scale[{k!r}]={v!r}: expected a TP degree >= 1 and a finite factor > 0"
                )
            scales[int(k)] = float(v)
        self.tp_scale = scales
        if not (self.overhead_scale > 0 and math.isfinite(self.overhead_scale)):
            raise ValueError(
                f"ModelProfile.overhead_scale={self.overhead_scale!r}: expected a finite factor > 0"
            )
        if not self.optimizer_s_per_byte >= 0 or math.isinf(self.optimizer_s_per_byte):
            raise ValueError(
                f"ModelProfile.optimizer_s_per_byte={self.optimizer_s_per_byte}: expected finite seconds >= 0"
            )
        if not self.microbatch_overhead_s >= 0:
            raise ValueError(
                f"ModelProfile.microbatch_overhead_s={self.microbatch_overhead_s}: expected seconds >= 0"
            )
        if self.boundary_bytes < 0:
            raise ValueError(f"ModelProfile.boundary_bytes={self.boundary_bytes}: expected >= 0")
        for name in ("num_heads", "num_kv_heads", "vocab_size"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 1):
                raise ValueError(
                    f"ModelProfile.{name}={v!r}: expected a positive int or None (no constraint)"
                )

    @property
    def num_layers(self) -> int:
        return len(self.layer_forward_s)

    def tp_allowed(self, tp: int) -> bool:
        """Whether ``tp`` divides heads, kv heads and vocabulary."""
        kv = self.num_kv_heads if self.num_kv_heads is not None else self.num_heads
        return all(v is None or v % tp == 0 for v in (self.num_heads, kv, self.vocab_size))

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> ModelProfile:
        return cls(**json.loads(text))

    def save(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(self.to_json())

    @classmethod
    def load(cls, path: str | Path) -> ModelProfile:
        return cls.from_json(Path(path).read_text())


def _now(device: torch.device | None = None) -> float:
    """Host seconds, after the device's queued work is done on CUDA (a kernel launch returns at once)."""
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _timed(fn: Any, repeats: int, device: torch.device | None = None) -> float:
    """Mean seconds of ``fn()`` over ``repeats`` calls after a warm-up (synchronised on CUDA)."""
    fn()  # warm-up
    t0 = _now(device)
    for _ in range(repeats):
        fn()
    return (_now(device) - t0) / repeats


def _device_of(sample: torch.Tensor | Mapping[str, torch.Tensor]) -> torch.device:
    first = sample if isinstance(sample, torch.Tensor) else next(iter(sample.values()))
    return first.device


def model_fingerprint(model: nn.Module, sample_shape: Sequence[Any]) -> str:
    """A hash of the module tree (class names, parameter names, shapes, dtypes) and the sample shape."""
    h = hashlib.sha256()
    for name, mod in model.named_modules():
        h.update(f"{name}:{type(mod).__name__};".encode())
    for name, p in model.named_parameters():
        h.update(f"{name}:{tuple(p.shape)}:{p.dtype};".encode())
    h.update(repr(tuple(sample_shape)).encode())
    return h.hexdigest()[:16]


def _find_layers(model: nn.Module) -> nn.ModuleList:
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
    if not lists:
        raise ValueError("profile_model: the model has no nn.ModuleList of layers; pass layers= explicitly")
    return max(lists, key=len)


def _find_attr(model: nn.Module, names: Sequence[str]) -> int | None:
    for obj in [model, getattr(model, "config", None), getattr(model, "cfg", None)]:
        for n in names:
            v = getattr(obj, n, None) if obj is not None else None
            if isinstance(v, int) and not isinstance(v, bool):
                return v
    for m in model.modules():
        for n in names:
            v = getattr(m, n, None)
            if isinstance(v, int) and not isinstance(v, bool):
                return v
    return None


def _forward_backward(model: nn.Module, sample: torch.Tensor | Mapping[str, torch.Tensor]) -> None:
    """One forward and backward of ``model(sample)`` (the first tensor of a dict / ModelOutput)."""
    model.zero_grad(set_to_none=True)
    y = model(sample) if isinstance(sample, torch.Tensor) else model(**sample)
    if not isinstance(y, torch.Tensor):
        y = next(v for v in y.values() if isinstance(v, torch.Tensor))
    y.float().sum().backward()


def _step_seconds(model: nn.Module, sample: torch.Tensor | Mapping[str, torch.Tensor], repeats: int) -> float:
    return _timed(lambda: _forward_backward(model, sample), repeats, _device_of(sample))


def measure_contention(
    model: nn.Module,
    sample: torch.Tensor | Mapping[str, torch.Tensor],
    *,
    seconds: float = 0.5,
    rounds: int = 3,
) -> float:
    """How much slower the model's forward and backward run when every rank runs it at once (collective).

    Rank 0 runs ``model(sample)`` forward and backward alone for ``seconds`` (the others wait),
    then every rank runs it for three times as long at the same time (rank 0 counts only the steps
    of the middle third, when all ranks are surely running); the result is rank 0's median step
    together over its median step alone (later steps only), the median over ``rounds`` such pairs
    (the ratio is noisy on shared cores): 1 when each rank has a core or a device
    of its own, about ranks / cores or more when processes share cores. It is the same on every
    rank. ``world_size / measure_contention(...)`` is the planner's ``compute_slots`` for the real
    model (small operators share cores worse than large ones). Gradients and the random stream are
    left as they were.
    """
    import torch.distributed as dist

    if not seconds > 0 or rounds < 1:
        raise ValueError(
            f"measure_contention: seconds={seconds!r}, rounds={rounds!r}; expected seconds > 0 and "
            "rounds >= 1"
        )
    from merak_core.layout import collective_device

    first = sample if isinstance(sample, torch.Tensor) else next(iter(sample.values()))
    dev = first.device

    def step() -> None:
        _forward_backward(model, sample)

    def per_step(duration: float, window: tuple[float, float]) -> float:
        """Median seconds of the steps that ran entirely inside ``window`` (fractions of ``duration``)."""
        start = _now(dev)
        begin, end = start + window[0] * duration, start + window[1] * duration
        inside: list[float] = []
        while (now := _now(dev)) < start + duration:
            step()
            after = _now(dev)
            if now >= begin and after <= end:
                inside.append(after - now)
        return statistics.median(inside) if inside else _now(dev) - start

    with torch.random.fork_rng(devices=[first.device] if first.device.type == "cuda" else []):
        try:
            step()  # warm-up
            ratios = []
            for _ in range(rounds):
                dist.barrier()
                alone = per_step(seconds, (0.2, 1.0)) if dist.get_rank() == 0 else 0.0
                dist.barrier()
                together = per_step(seconds * 3, (0.33, 0.67))
                ratios.append(together / alone if alone > 0 else 1.0)
        finally:
            model.zero_grad(set_to_none=True)
    ratio = torch.tensor([statistics.median(ratios)], dtype=torch.float64, device=collective_device())
    dist.broadcast(ratio, 0)
    return min(max(float(ratio), 1.0), float(dist.get_world_size()))


def profile_model(
    model: nn.Module,
    sample: torch.Tensor | Mapping[str, torch.Tensor],
    *,
    layers: nn.ModuleList | None = None,
    repeats: int = 3,
    cache_dir: str | Path | None = None,
) -> ModelProfile:
    """Measure a per-sample :class:`ModelProfile` by running ``model(sample)`` forward and backward.

    ``sample`` is a batch (its first dimension is the batch size), or a mapping passed by keyword; per-layer forward time comes
    from hooks on ``layers`` (default: the model's longest ``nn.ModuleList``), kept bytes from
    saved-tensor hooks (parameters excluded, each storage once; before the first layer: the first
    layer's, after the last one: the last layer's, plus one tensor the size of the output for the
    loss). Forward time outside the layers goes to the first layer, except what runs after the last
    one (final norm, head: the last layer's). A one-sample run splits the step time into a fixed
    per-microbatch overhead and a per-sample part (the layer times are scaled to the latter). Backward time
    is measured for the whole model and spread over layers in proportion to forward time.
    With ``cache_dir`` the profile is read from / written to ``<fingerprint>-<device>.json``.
    """
    first = sample if isinstance(sample, torch.Tensor) else next(iter(sample.values()))
    batch = int(first.shape[0])
    device = str(first.device)
    shapes = (
        tuple(sample.shape)
        if isinstance(sample, torch.Tensor)
        else tuple((k, tuple(v.shape)) for k, v in sorted(sample.items()))
    )
    key = model_fingerprint(model, shapes)
    path = Path(cache_dir) / f"{key}-{device.replace(':', '_')}.json" if cache_dir is not None else None
    if path is not None and path.is_file():
        logger.info("planner: profile cache hit %s", path)
        return ModelProfile.load(path)
    if repeats < 1:
        raise ValueError(f"profile_model: repeats={repeats}; expected >= 1")
    # The caller's random stream and gradients are left as they were: profiling must not make
    # the rank that profiles diverge from the others.
    with torch.random.fork_rng(devices=[first.device] if first.device.type == "cuda" else []):
        try:
            prof = _measure(
                model,
                sample,
                layers if layers is not None else _find_layers(model),
                repeats,
                batch,
                key,
                device,
            )
            prof = dataclasses.replace(prof, optimizer_s_per_byte=_optimizer_s_per_byte(model, repeats))
        finally:
            model.zero_grad(set_to_none=True)
    if path is not None:
        prof.save(path)
        logger.info("planner: profile written to %s", path)
    return prof


def _optimizer_s_per_byte(model: nn.Module, repeats: int) -> float:
    """Seconds per parameter byte of gradient clipping plus an AdamW step, timed on copies of the
    parameters and gradients."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        return 0.0
    copies = []
    for p in params:
        c = p.detach().clone().requires_grad_()
        c.grad = p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
        copies.append(c)
    opt = torch.optim.AdamW(copies, lr=1e-3)

    def step() -> None:  # what a Trainer step does per parameter besides the pipeline
        torch.nn.utils.clip_grad_norm_(copies, 1.0)
        opt.step()

    seconds = _timed(step, repeats, params[0].device)
    nbytes = sum(p.numel() * p.element_size() for p in params)
    return seconds / max(nbytes, 1)


def _measure(
    model: nn.Module,
    sample: torch.Tensor | Mapping[str, torch.Tensor],
    layers: nn.ModuleList,
    repeats: int,
    batch: int,
    key: str,
    device: str,
) -> ModelProfile:
    n = len(layers)
    fwd = [0.0] * n
    act = [0.0] * n
    out_bytes = [0.0]
    current = [-1]  # -1: outside the layers
    starts: dict[int, float] = {}
    outside_act = [0.0, 0.0]  # saved before the first layer / after the last one
    after = [False]  # the last layer has run: what follows (final norm, head, loss) is the last layer's
    used_after: set[int] = set()
    used_before: set[int] = set()

    param_ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved_storages: set[int] = set()
    dev = _device_of(sample)

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = t.untyped_storage().data_ptr()
        if key in param_ptrs:  # a saved weight is a parameter, counted in layer_param_bytes
            if current[0] < 0:
                (used_after if after[0] else used_before).add(key)
            return t
        if key in saved_storages:  # saved again (or a view of a saved tensor): held once
            return t
        saved_storages.add(key)
        nbytes = float(t.untyped_storage().nbytes())
        if current[0] >= 0:
            act[current[0]] += nbytes
        else:
            outside_act[1 if after[0] else 0] += nbytes
        return t

    in_layer_modules = {id(m) for layer in layers for m in layer.modules()}

    def outside_module(m: nn.Module, _a: Any) -> None:  # a module outside the layers: its weights' place
        if current[0] < 0:
            (used_after if after[0] else used_before).update(
                p.untyped_storage().data_ptr() for p in m.parameters(recurse=False)
            )

    handles = []
    for i, layer in enumerate(layers):

        def pre(_m: nn.Module, _a: Any, i: int = i) -> None:
            current[0] = i
            starts[i] = _now(dev)

        def post(_m: nn.Module, _a: Any, out: Any, i: int = i) -> None:
            now = _now(dev)
            fwd[i] += now - starts[i]
            current[0] = -1
            after[0] = i == n - 1
            last_end[0] = now
            if isinstance(out, torch.Tensor):
                out_bytes[0] = float(out.numel() * out.element_size())

        handles.append(layer.register_forward_pre_hook(pre))
        handles.append(layer.register_forward_hook(post))
    for m in model.modules():
        if id(m) not in in_layer_modules and any(True for _ in m.parameters(recurse=False)):
            handles.append(m.register_forward_pre_hook(outside_module))
    total_f = total_b = 0.0
    fwd_sum = [0.0] * n
    last_end = [0.0]
    tail_f = 0.0  # forward seconds after the last layer (final norm, head)
    try:
        for rep in range(repeats + 1):  # the first run warms up
            fwd[:] = [0.0] * n
            act[:] = [0.0] * n
            outside_act[:] = [0.0, 0.0]
            saved_storages.clear()
            after[0] = False
            model.zero_grad(set_to_none=True)
            t0 = _now(dev)
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                y = model(sample) if isinstance(sample, torch.Tensor) else model(**sample)
            t1 = _now(dev)
            if not isinstance(y, torch.Tensor):  # a dict / ModelOutput: its first tensor (logits or loss)
                y = next(v for v in y.values() if isinstance(v, torch.Tensor))
            if y.is_floating_point():  # a training loss (cross-entropy) keeps one tensor the output's size
                outside_act[1] += float(y.numel() * y.element_size())
            loss = y.float().sum()
            loss.backward()
            t2 = _now(dev)
            if rep > 0:
                total_f += (t1 - t0) / repeats
                total_b += (t2 - t1) / repeats
                fwd_sum = [a + f / repeats for a, f in zip(fwd_sum, fwd, strict=True)]
                tail_f += max(t1 - last_end[0], 0.0) / repeats
    finally:
        for h in handles:
            h.remove()
    per_layer_f = list(fwd_sum)
    # Outside the layers: the head after the last layer is the last layer's, the rest (embedding) the first's.
    tail_f = min(tail_f, max(total_f - sum(per_layer_f), 0.0))
    per_layer_f[-1] += tail_f
    per_layer_f[0] += max(total_f - sum(per_layer_f), 0.0)
    per_layer_b = [total_b * f / max(sum(per_layer_f), 1e-12) for f in per_layer_f]
    act[0] += outside_act[0]
    act[-1] += outside_act[1]
    params = [float(sum(p.numel() * p.element_size() for p in layer.parameters())) for layer in layers]
    in_layers = {id(p) for layer in layers for p in layer.parameters()}
    # Outside the layers: a parameter used only after the last layer (final norm, untied head) is the
    # last layer's; one used before and after (a tied embedding) is held by both; the rest the first's.
    shared = 0.0
    for p in model.parameters():
        if id(p) in in_layers:
            continue
        nbytes = float(p.numel() * p.element_size())
        late = p.untyped_storage().data_ptr() in used_after
        early = p.untyped_storage().data_ptr() in used_before or not late
        if late:
            params[-1] += nbytes
        if early and not (late and n == 1):
            params[0] += nbytes
        if late and early and n > 1:
            shared += nbytes
    vocab = None
    for m in model.modules():
        if isinstance(m, nn.Embedding):
            vocab = m.num_embeddings
            break
    heads = _find_attr(model, ("num_heads", "heads", "n_head", "num_attention_heads"))
    kv = _find_attr(model, ("num_key_value_heads", "num_kv_heads", "n_kv_heads"))
    prof = ModelProfile(
        layer_forward_s=[f / batch for f in per_layer_f],
        layer_backward_s=[b / batch for b in per_layer_b],
        layer_activation_bytes=[a / batch for a in act],
        layer_param_bytes=params,
        shared_param_bytes=shared,
        boundary_bytes=out_bytes[0] / batch,
        num_heads=heads,
        num_kv_heads=kv,
        vocab_size=vocab,
        fingerprint=key,
        device=device,
    )
    if batch > 1:  # time(b) = overhead + b * per_sample: a one-sample run gives the overhead
        one = sample[:1] if isinstance(sample, torch.Tensor) else {k: v[:1] for k, v in sample.items()}
        t_one = _step_seconds(model, one, repeats)
        per_sample = (total_f + total_b - t_one) / (batch - 1)
        overhead = max(t_one - per_sample, 0.0)
        if per_sample > 0:
            scale = per_sample / ((total_f + total_b) / batch)
            prof = dataclasses.replace(
                prof,
                microbatch_overhead_s=overhead,
                layer_forward_s=[f * scale for f in prof.layer_forward_s],
                layer_backward_s=[b * scale for b in prof.layer_backward_s],
            )
    return prof
