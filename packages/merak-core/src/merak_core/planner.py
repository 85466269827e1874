"""The planner: choose the (dp, tp, pp) layout, schedule, microbatches and recomputation from a cost model.

A :class:`ModelProfile` holds per-layer costs for one sample (forward and backward seconds,
activation bytes, parameter bytes) plus what constrains tensor parallelism (heads, kv heads,
vocabulary). :func:`profile_model` measures one on the local device by running the model once
(forward times and saved-activation bytes per layer through hooks); profiles are cached as JSON
keyed by a model fingerprint and the device. A :class:`CommModel` prices point-to-point messages
and all-reduces (ring formula); its defaults are assumptions, :func:`measure_comm` measures one
with the real collectives of a process group.

:func:`plan` enumerates every layout with dp * tp * pp = world_size, every microbatch count that
divides the per-replica batch, every schedule the Trainer runs and recompute none / full /
stage_aware; it predicts the step time with :func:`merak_pipe.simulate` (stage costs scaled by
1 / tp plus TP all-reduces, then the DP gradient all-reduce of the slowest stage) and the
per-stage peak memory (weights + gradients + optimizer states, divided by dp under ZeRO-1, plus
the simulated activation peak), drops what does not fit and ranks the rest.

[Note: planner model limits] Layers are split contiguously to balance forward time; TP divides
every layer's compute, activations and parameters by tp and adds two all-reduces of the layer's
output per layer in forward and two in backward; the DP all-reduce is not overlapped with the
pipeline. Backward time is measured as a whole and spread over layers in proportion to forward.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

logger = logging.getLogger(__name__)

__all__ = ["Candidate", "CommModel", "ModelProfile", "format_plan", "measure_comm", "plan", "profile_model"]

PLANNER_SCHEDULES = ("gpipe", "1f1b", "zb_h1", "shifted_critical_path")
"""Schedules the Trainer runs with one stage per rank (config spelling)."""
RECOMPUTE_MODES = ("none", "full", "stage_aware")


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
    microbatch_overhead_s: float = 0.0
    """Fixed seconds per microbatch and stage (forward + backward) that do not grow with the batch."""
    boundary_bytes: float = 0.0
    """Bytes of a layer's output for one sample (the pipeline message and the TP all-reduce size)."""
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
            raise ValueError("ModelProfile.layer_forward_s is empty: expected one value per layer (at least one)")
        for name in ("layer_backward_s", "layer_activation_bytes", "layer_param_bytes"):
            values = getattr(self, name)
            if len(values) != n:
                raise ValueError(f"ModelProfile.{name} has {len(values)} values but layer_forward_s has {n}: "
                                 "give one value per layer")
        for name in ("layer_forward_s", "layer_backward_s", "layer_activation_bytes", "layer_param_bytes"):
            for v in getattr(self, name):
                if not v >= 0 or math.isinf(v):
                    raise ValueError(f"ModelProfile.{name} holds {v!r}: expected finite values >= 0")
        if not self.microbatch_overhead_s >= 0:
            raise ValueError(f"ModelProfile.microbatch_overhead_s={self.microbatch_overhead_s}: expected seconds >= 0")
        if self.boundary_bytes < 0:
            raise ValueError(f"ModelProfile.boundary_bytes={self.boundary_bytes}: expected >= 0")
        for name in ("num_heads", "num_kv_heads", "vocab_size"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 1):
                raise ValueError(f"ModelProfile.{name}={v!r}: expected a positive int or None (no constraint)")

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


@dataclass(kw_only=True)
class CommModel:
    """Communication costs: point-to-point and ring all-reduce (defaults are assumptions, not measured)."""

    p2p_latency_s: float = 50e-6
    """Latency of one point-to-point message, seconds."""
    p2p_bandwidth: float = 2e9
    """Point-to-point bytes per second."""
    allreduce_latency_s: float = 50e-6
    """Latency of one ring step of an all-reduce, seconds."""
    allreduce_bandwidth: float = 2e9
    """Bytes per second of one ring link."""

    def __post_init__(self) -> None:
        for name in ("p2p_latency_s", "allreduce_latency_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"CommModel.{name}={getattr(self, name)!r}: expected seconds >= 0")
        for name in ("p2p_bandwidth", "allreduce_bandwidth"):
            if not getattr(self, name) > 0:
                raise ValueError(f"CommModel.{name}={getattr(self, name)!r}: expected bytes/s > 0 (math.inf: free)")

    def allreduce_s(self, nbytes: float, group_size: int) -> float:
        """Ring all-reduce time: 2 (n - 1) latencies plus 2 (n - 1) / n of the bytes over one link; 0 for n = 1."""
        if group_size <= 1 or nbytes <= 0:
            return 0.0
        n = group_size
        return 2 * (n - 1) * self.allreduce_latency_s + 2 * (n - 1) / n * nbytes / self.allreduce_bandwidth


@dataclass(frozen=True)
class Candidate:
    """One planned configuration with its predictions."""

    dp: int
    tp: int
    pp: int
    schedule: str
    num_microbatches: int
    micro_batch_size: int
    recompute: str
    recompute_fractions: tuple[float, ...]
    stage_layers: tuple[int, ...]
    """Layers per stage (contiguous)."""
    step_time_s: float
    pipeline_s: float
    dp_allreduce_s: float
    peak_memory_bytes: tuple[float, ...]
    """Per stage: static (weights, gradients, optimizer) + simulated activation peak."""
    memory_per_device: float = field(default=0.0, repr=False)

    @property
    def layout(self) -> str:
        return f"dp{self.dp}-tp{self.tp}-pp{self.pp}"

    def training_fields(self) -> dict[str, Any]:
        """The job file's ``training`` fields for this choice."""
        out: dict[str, Any] = {"dp": self.dp, "tp": self.tp, "pp": self.pp, "schedule": self.schedule,
                               "per_device_train_batch_size": self.micro_batch_size,
                               "gradient_accumulation_steps": self.num_microbatches, "recompute": self.recompute}
        if self.recompute == "stage_aware":
            out["memory_budget"] = int(self.memory_per_device)
        return out


def _sort_key(c: Candidate) -> tuple[Any, ...]:
    return (float(f"{c.step_time_s:.9g}"), c.tp, c.layout, PLANNER_SCHEDULES.index(c.schedule), c.num_microbatches,
            RECOMPUTE_MODES.index(c.recompute))


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def split_layers(costs: Sequence[float], num_stages: int) -> list[int]:
    """Contiguous split of ``costs`` into ``num_stages`` non-empty parts minimising the largest sum.

    Ties go to the earliest cut; returns layers per stage.
    """
    n = len(costs)
    if not 1 <= num_stages <= n:
        raise ValueError(f"num_stages={num_stages}: expected 1..{n} (one layer at least per stage)")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = math.inf
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, num_stages + 1):
        for j in range(s, n - (num_stages - s) + 1):
            for i in range(s - 1, j):
                v = max(best[s - 1][i], prefix[j] - prefix[i])
                if v < best[s][j] - 1e-15 * max(1.0, abs(v)):
                    best[s][j], cut[s][j] = v, i
    sizes, j = [], n
    for s in range(num_stages, 0, -1):
        i = cut[s][j]
        sizes.append(j - i)
        j = i
    return sizes[::-1]


def plan(
    profile: ModelProfile,
    *,
    world_size: int,
    memory_per_device: float,
    global_batch_size: int,
    comm: CommModel | None = None,
    zero_stage: int = 0,
    optimizer_state_factor: float = 2.0,
    schedules: Sequence[str] = PLANNER_SCHEDULES,
    recompute_modes: Sequence[str] = RECOMPUTE_MODES,
    max_microbatches: int = 64,
) -> list[Candidate]:
    """Every feasible configuration, best predicted step time first.

    ``memory_per_device`` is bytes; ``optimizer_state_factor`` is optimizer-state bytes per
    parameter byte (2 for Adam in the parameters' dtype). Ties in step time are broken by fewer
    TP ranks, then the layout string, schedule, microbatches and recompute mode.
    Raises ValueError on invalid inputs, or when nothing fits (naming the least memory needed).
    """
    from merak_pipe import CostModel, build_schedule, simulate, stage_aware_plan
    from merak_pipe.recompute import RecomputePlan

    comm = comm or CommModel()
    for name, v in (("world_size", world_size), ("global_batch_size", global_batch_size),
                    ("max_microbatches", max_microbatches)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"plan: {name}={v!r}; expected an int >= 1")
    if not memory_per_device > 0:
        raise ValueError(f"plan: memory_per_device={memory_per_device!r}; expected bytes > 0")
    if zero_stage not in (0, 1):
        raise ValueError(f"plan: zero_stage={zero_stage!r}; expected 0 or 1")
    for s in schedules:
        if s not in PLANNER_SCHEDULES:
            raise ValueError(f"plan: schedule {s!r} is not one of {PLANNER_SCHEDULES}")
    for r in recompute_modes:
        if r not in RECOMPUTE_MODES:
            raise ValueError(f"plan: recompute mode {r!r} is not one of {RECOMPUTE_MODES}")

    out: list[Candidate] = []
    least_needed = math.inf
    layouts_tried = 0
    for tp in _divisors(world_size):
        if not profile.tp_allowed(tp):
            continue
        for pp in _divisors(world_size // tp):
            if pp > profile.num_layers:
                continue
            dp = world_size // (tp * pp)
            if global_batch_size % dp:
                continue
            layouts_tried += 1
            sizes = split_layers(profile.layer_forward_s, pp)
            bounds = [sum(sizes[:s]) for s in range(pp + 1)]
            stage = [range(bounds[s], bounds[s + 1]) for s in range(pp)]
            fwd1 = [sum(profile.layer_forward_s[i] for i in r) / tp for r in stage]
            bwd1 = [sum(profile.layer_backward_s[i] for i in r) / tp for r in stage]
            act1 = [[profile.layer_activation_bytes[i] / tp for i in r] for r in stage]
            params = [sum(profile.layer_param_bytes[i] for i in r) / tp for r in stage]
            opt_div = dp if zero_stage == 1 else 1
            static = [p * 2 + p * optimizer_state_factor / opt_div for p in params]
            dp_ar = max(comm.allreduce_s(p, dp) for p in params)
            per_dp = global_batch_size // dp
            for m in _divisors(per_dp):
                if m > max_microbatches or m < pp:  # the Trainer needs a microbatch per stage at least
                    continue
                b = per_dp // m
                tp_comm_f = [2 * len(r) * comm.allreduce_s(b * profile.boundary_bytes, tp) for r in stage]
                half = profile.microbatch_overhead_s / 2
                fwd = [half + b * f + c for f, c in zip(fwd1, tp_comm_f, strict=True)]
                bwd = [half + b * x + c for x, c in zip(bwd1, tp_comm_f, strict=True)]
                costs = CostModel(
                    forward=fwd, backward=bwd, recompute=fwd,
                    p2p_latency=comm.p2p_latency_s if pp > 1 else 0.0,
                    p2p_bandwidth=comm.p2p_bandwidth,
                    boundary_bytes=b * profile.boundary_bytes,
                    activation_bytes=[b * sum(a) for a in act1],
                    input_bytes=b * profile.boundary_bytes,
                )
                for sched in (schedules if pp > 1 else ("1f1b",)):
                    seen: set[tuple[float, ...]] = set()
                    for mode in recompute_modes:
                        if mode == "stage_aware":
                            if pp < 2:
                                continue
                            base = build_schedule(sched.replace("_", "-"), num_stages=pp, num_microbatches=m)
                            try:
                                rplan = stage_aware_plan(
                                    layer_activation_bytes=[[b * a for a in layer] for layer in act1],
                                    memory_budget=float(memory_per_device), static_bytes=static, schedule=base,
                                    input_bytes=b * profile.boundary_bytes)
                            except ValueError:
                                continue
                        elif mode == "full":
                            rplan = RecomputePlan.full(pp)
                        else:
                            rplan = RecomputePlan.none(pp)
                        fractions = tuple(float(rplan[s]) for s in range(pp))
                        if fractions in seen:
                            continue
                        seen.add(fractions)
                        schedule = build_schedule(sched.replace("_", "-"), num_stages=pp, num_microbatches=m,
                                                  recompute=rplan)
                        result = simulate(schedule, costs)
                        peak = tuple(st + a for st, a in zip(static, result.peak_memory, strict=True))
                        least_needed = min(least_needed, max(peak))
                        if max(peak) > memory_per_device:
                            continue
                        out.append(Candidate(
                            dp=dp, tp=tp, pp=pp, schedule=sched, num_microbatches=m, micro_batch_size=b,
                            recompute=mode, recompute_fractions=fractions, stage_layers=tuple(sizes),
                            step_time_s=result.makespan + dp_ar, pipeline_s=result.makespan, dp_allreduce_s=dp_ar,
                            peak_memory_bytes=peak, memory_per_device=float(memory_per_device)))
    if layouts_tried == 0:
        raise ValueError(
            f"plan: no (dp, tp, pp) with dp*tp*pp={world_size} suits this model: tp must divide heads="
            f"{profile.num_heads}, kv heads={profile.num_kv_heads}, vocab={profile.vocab_size}; pp <= layers="
            f"{profile.num_layers}; dp must divide global_batch_size={global_batch_size}. Change world_size or the "
            "batch size")
    if not out:
        raise ValueError(
            f"plan: nothing fits in memory_per_device={memory_per_device:.6g} bytes; the smallest configuration needs "
            f"{least_needed:.6g} bytes per device: raise the memory, add devices or shrink the batch")
    out.sort(key=_sort_key)
    return out


def why_best(cands: Sequence[Candidate]) -> str:
    """One line on why the first candidate wins."""
    if not cands:
        return ""
    top = cands[0]
    text = (f"{top.layout} {top.schedule} m={top.num_microbatches} recompute={top.recompute}: predicted "
            f"{top.step_time_s * 1e3:.3f} ms (pipeline {top.pipeline_s * 1e3:.3f} ms + DP all-reduce "
            f"{top.dp_allreduce_s * 1e3:.3f} ms), peak {max(top.peak_memory_bytes) / 2**20:.1f} MiB")
    other = next((c for c in cands[1:] if c.layout != top.layout), None)
    if other is not None:
        gain = 100 * (other.step_time_s / top.step_time_s - 1) if top.step_time_s > 0 else 0.0
        text += f"; {gain:.1f}% faster than the best other layout ({other.layout}, {other.schedule})"
    else:
        text += "; the only layout that fits"
    return text


def format_plan(cands: Sequence[Candidate], top: int = 10) -> str:
    """A ranked table of the first ``top`` candidates, then why the first wins."""
    lines = [f"{'#':>3} {'layout':<14} {'schedule':<22} {'m':>3} {'mbs':>4} {'recompute (per stage)':<28} "
             f"{'step ms':>9}  peak MiB per stage"]
    for i, c in enumerate(cands[:top], 1):
        rc = c.recompute if c.recompute != "stage_aware" else "sa:" + ",".join(f"{f:.2f}" for f in c.recompute_fractions)
        peaks = ",".join(f"{p / 2**20:.1f}" for p in c.peak_memory_bytes)
        lines.append(f"{i:>3} {c.layout:<14} {c.schedule:<22} {c.num_microbatches:>3} {c.micro_batch_size:>4} "
                     f"{rc:<28} {c.step_time_s * 1e3:>9.3f}  {peaks}")
    lines.append("why: " + why_best(cands))
    return "\n".join(lines)


# ------------------------------------------------------------------------------ profiling


def _timed(fn: Any, repeats: int) -> float:
    fn()  # warm-up
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t0) / repeats


def measure_comm(group: Any = None, *, small_bytes: int = 1024, large_bytes: int = 1 << 20,
                 repeats: int = 5) -> CommModel:
    """Measure a :class:`CommModel` with the real collectives of ``group`` (default: the world).

    Every rank of the group must call it. Point-to-point: ranks 0 and 1 of the group ping-pong a
    small and a large float32 message (one-way time = half the round trip); all-reduce: the whole
    group all-reduces both sizes. Latency and bandwidth are the intercept and slope of the two
    points (ring formula for the all-reduce). Every rank returns rank 0's numbers. A group of one
    rank returns the defaults.
    """
    import torch.distributed as dist

    if not 0 < small_bytes < large_bytes or repeats < 1:
        raise ValueError(f"measure_comm: small_bytes={small_bytes}, large_bytes={large_bytes}, repeats={repeats}; "
                         "expected 0 < small_bytes < large_bytes and repeats >= 1")
    n = dist.get_world_size(group)
    if n < 2:
        return CommModel()
    rank = dist.get_rank(group)
    peer0, peer1 = (dist.get_global_rank(group, r) if group is not None else r for r in (0, 1))
    results = []
    for nbytes in (small_bytes, large_bytes):
        buf = torch.zeros(max(nbytes // 4, 1))

        def ping(buf: torch.Tensor = buf) -> None:
            if rank == 0:
                dist.send(buf, peer1, group=group)
                dist.recv(buf, peer1, group=group)
            elif rank == 1:
                dist.recv(buf, peer0, group=group)
                dist.send(buf, peer0, group=group)

        one_way = _timed(ping, repeats) / 2
        dist.barrier(group=group)
        reduce_s = _timed(lambda buf=buf: dist.all_reduce(buf, group=group), repeats)
        results.append((one_way, reduce_s))
    (p_small, r_small), (p_large, r_large) = results
    delta = float(large_bytes - small_bytes)
    p_bw = delta / (p_large - p_small) if p_large > p_small else math.inf
    p_lat = max(p_small - small_bytes / p_bw, 0.0)
    ring = 2 * (n - 1) / n
    r_bw = ring * delta / (r_large - r_small) if r_large > r_small else math.inf
    r_lat = max(r_small - ring * small_bytes / r_bw, 0.0) / (2 * (n - 1))
    values = torch.tensor([p_lat, p_bw, r_lat, r_bw], dtype=torch.float64)
    dist.broadcast(values, peer0, group=group)
    p_lat, p_bw, r_lat, r_bw = (float(v) for v in values)
    logger.info("planner: measured p2p %.3g s + bytes / %.3g B/s; all-reduce step %.3g s, link %.3g B/s over %d ranks",
                p_lat, p_bw, r_lat, r_bw, n)
    return CommModel(p2p_latency_s=p_lat, p2p_bandwidth=p_bw, allreduce_latency_s=r_lat, allreduce_bandwidth=r_bw)


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


def _step_seconds(model: nn.Module, sample: torch.Tensor | Mapping[str, torch.Tensor], repeats: int) -> float:
    def step() -> None:
        model.zero_grad(set_to_none=True)
        y = model(sample) if isinstance(sample, torch.Tensor) else model(**sample)
        if not isinstance(y, torch.Tensor):
            y = next(v for v in y.values() if isinstance(v, torch.Tensor))
        y.float().sum().backward()

    return _timed(step, repeats)


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
    saved-tensor hooks (parameters excluded). A one-sample run splits the step time into a fixed
    per-microbatch overhead and a per-sample part (the layer times are scaled to the latter); time and memory outside the layers go to the first layer. Backward time
    is measured for the whole model and spread over layers in proportion to forward time.
    With ``cache_dir`` the profile is read from / written to ``<fingerprint>-<device>.json``.
    """
    first = sample if isinstance(sample, torch.Tensor) else next(iter(sample.values()))
    batch = int(first.shape[0])
    device = str(first.device)
    shapes = tuple(sample.shape) if isinstance(sample, torch.Tensor) else tuple(
        (k, tuple(v.shape)) for k, v in sorted(sample.items()))
    key = model_fingerprint(model, shapes)
    path = Path(cache_dir) / f"{key}-{device.replace(':', '_')}.json" if cache_dir is not None else None
    if path is not None and path.is_file():
        logger.info("planner: profile cache hit %s", path)
        return ModelProfile.load(path)
    layers = layers if layers is not None else _find_layers(model)
    n = len(layers)
    fwd = [0.0] * n
    act = [0.0] * n
    out_bytes = [0.0]
    current = [-1]  # -1: outside the layers
    starts: dict[int, float] = {}
    outside_act = [0.0]

    param_ptrs = {p.data_ptr() for p in model.parameters()}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.data_ptr() in param_ptrs:  # a saved weight is a parameter, counted in layer_param_bytes
            return t
        nbytes = float(t.numel() * t.element_size())
        if current[0] >= 0:
            act[current[0]] += nbytes
        else:
            outside_act[0] += nbytes
        return t

    handles = []
    for i, layer in enumerate(layers):
        def pre(_m: nn.Module, _a: Any, i: int = i) -> None:
            current[0] = i
            starts[i] = time.perf_counter()

        def post(_m: nn.Module, _a: Any, out: Any, i: int = i) -> None:
            fwd[i] += time.perf_counter() - starts[i]
            current[0] = -1
            if isinstance(out, torch.Tensor):
                out_bytes[0] = float(out.numel() * out.element_size())

        handles.append(layer.register_forward_pre_hook(pre))
        handles.append(layer.register_forward_hook(post))
    total_f = total_b = 0.0
    fwd_sum = [0.0] * n
    if repeats < 1:
        raise ValueError(f"profile_model: repeats={repeats}; expected >= 1")
    try:
        for rep in range(repeats + 1):  # the first run warms up
            fwd[:] = [0.0] * n
            act[:] = [0.0] * n
            outside_act[0] = 0.0
            model.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                y = model(sample) if isinstance(sample, torch.Tensor) else model(**sample)
            t1 = time.perf_counter()
            if not isinstance(y, torch.Tensor):  # a dict / ModelOutput: its first tensor (logits or loss)
                y = next(v for v in y.values() if isinstance(v, torch.Tensor))
            loss = y.float().sum()
            loss.backward()
            t2 = time.perf_counter()
            if rep > 0:
                total_f += (t1 - t0) / repeats
                total_b += (t2 - t1) / repeats
                fwd_sum = [a + f / repeats for a, f in zip(fwd_sum, fwd, strict=True)]
    finally:
        for h in handles:
            h.remove()
    per_layer_f = list(fwd_sum)
    per_layer_f[0] += max(total_f - sum(per_layer_f), 0.0)  # embedding, head and loss: first layer
    per_layer_b = [total_b * f / max(sum(per_layer_f), 1e-12) for f in per_layer_f]
    act[0] += outside_act[0]
    params = [float(sum(p.numel() * p.element_size() for p in layer.parameters())) for layer in layers]
    in_layers = {id(p) for layer in layers for p in layer.parameters()}
    params[0] += float(sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in in_layers))
    vocab = None
    for m in model.modules():
        if isinstance(m, nn.Embedding):
            vocab = m.num_embeddings
            break
    heads = _find_attr(model, ("num_heads", "heads", "n_head", "num_attention_heads"))
    kv = _find_attr(model, ("num_key_value_heads", "num_kv_heads", "n_kv_heads"))
    prof = ModelProfile(
        layer_forward_s=[f / batch for f in per_layer_f], layer_backward_s=[b / batch for b in per_layer_b],
        layer_activation_bytes=[a / batch for a in act], layer_param_bytes=params,
        boundary_bytes=out_bytes[0] / batch, num_heads=heads, num_kv_heads=kv, vocab_size=vocab,
        fingerprint=key, device=device)
    if batch > 1:  # time(b) = overhead + b * per_sample: a one-sample run gives the overhead
        one = sample[:1] if isinstance(sample, torch.Tensor) else {k: v[:1] for k, v in sample.items()}
        t_one = _step_seconds(model, one, repeats)
        per_sample = (total_f + total_b - t_one) / (batch - 1)
        overhead = max(t_one - per_sample, 0.0)
        if per_sample > 0:
            scale = per_sample / ((total_f + total_b) / batch)
            prof = dataclasses.replace(
                prof, microbatch_overhead_s=overhead,
                layer_forward_s=[f * scale for f in prof.layer_forward_s],
                layer_backward_s=[b * scale for b in prof.layer_backward_s])
    if path is not None:
        prof.save(path)
        logger.info("planner: profile written to %s", path)
    return prof
