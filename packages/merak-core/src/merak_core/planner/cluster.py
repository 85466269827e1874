"""Cluster descriptions: what one device and the links between devices can do, from a YAML file.

A :class:`ClusterSpec` describes nodes of identical devices: devices per node, each device's
peak bf16 / fp32 FLOP/s, memory and memory bandwidth, the intra-node links (NVLink) and the
inter-node network (NICs per node), their latencies, and efficiency factors (the sustained
fraction of each peak). :func:`load_cluster` reads a YAML file, or the name of a shipped file
(:func:`shipped_clusters`), and refuses a bad file naming the key, the value and what is
expected. Units in the file are the spec sheets' (TFLOP/s, GB, GB/s, Gb/s, microseconds); the
dataclass holds SI units (FLOP/s, bytes, bytes/s, seconds).

Deliberately not modelled: different devices in one cluster, network topology beyond
"inside a node" and "between nodes" (no rail or fat-tree oversubscription), clock throttling.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from merak_core.planner.cluster_classes import OP_CLASSES

__all__ = ["ClusterSpec", "compute_dtype", "load_cluster", "shipped_clusters"]

_SHIPPED = Path(__file__).parent / "clusters"

_SCHEMA: dict[str, Any] = {
    "name": str,
    "source": str,
    "devices_per_node": int,
    "device": {
        "name": str,
        "peak_tflops": {"bf16": float, "fp32": float},
        "memory_gb": float,
        "memory_bandwidth_gb_s": float,
        "op_overhead_us": float,
        "per_action_us": float,
        "step_overhead_us": float,
        "step_tensor_us": float,
        "step_param_ns": float,
        "op_class_gb_s": dict.fromkeys(OP_CLASSES, float),
    },
    "intra_node": {"bandwidth_gb_s": float, "bidirectional": bool, "latency_us": float},
    "inter_node": {"nics_per_node": int, "nic_gbit_s": float, "latency_us": float},
    "efficiency": {"compute": float, "memory": float, "link": float},
    "usable_memory_fraction": float,
}
_OPTIONAL = {
    "source",
    "device.name",
    "device.op_overhead_us",
    "device.per_action_us",
    "device.step_overhead_us",
    "device.step_tensor_us",
    "device.step_param_ns",
    "device.op_class_gb_s",
    *(f"device.op_class_gb_s.{c}" for c in OP_CLASSES),
    "intra_node.bidirectional",
    "efficiency.memory",
    "efficiency.link",
    "usable_memory_fraction",
    "inter_node",
}
_FRACTIONS = {"efficiency.compute", "efficiency.memory", "efficiency.link", "usable_memory_fraction"}


_PEAK_KEYS = {"bfloat16": "bf16", "float32": "fp32"}
"""A job's parameter dtype (``training.dtype``) -> the ``peak_tflops`` key it computes at."""


def compute_dtype(*, dtype: str, bf16: bool) -> str:
    """The ``peak_tflops`` key a job's compute runs at, from its ``training.dtype`` and ``training.bf16``.

    ``bf16: true`` (bfloat16 autocast over float32 parameters) and ``dtype: bfloat16`` compute in
    bfloat16; float32 parameters without autocast in fp32. The model's own parameters do not tell:
    a job's model is built in float32 whatever it trains in. Other dtypes have no peak in a
    cluster description and are refused, naming the key.
    """
    if bf16:
        return "bf16"
    if dtype not in _PEAK_KEYS:
        raise ValueError(
            f"training.dtype={dtype!r}: a cluster description gives peaks for bf16 and fp32 only, so a "
            f"{dtype} job cannot be priced on it; plan it as training.dtype=float32 or bfloat16 (an override "
            "on the command line)"
        )
    return _PEAK_KEYS[dtype]


@dataclass(frozen=True, kw_only=True)
class ClusterSpec:
    """Nodes of identical devices and their links, in SI units."""

    name: str
    """Short name (the file's ``name``)."""
    devices_per_node: int
    """Devices (ranks) per node."""
    peak_flops: dict[str, float]
    """Peak FLOP/s of one device by dtype name (``bf16``, ``fp32``)."""
    memory_bytes: float
    """Memory of one device, bytes."""
    memory_bandwidth: float
    """Memory bandwidth of one device, bytes/s."""
    intra_node_bandwidth: float
    """Bytes/s one device sends in one direction to the others of its node."""
    intra_node_latency_s: float
    """Latency of one message inside a node, seconds."""
    inter_node_bandwidth: float
    """Bytes/s one device sends in one direction to other nodes (its share of the node's NICs)."""
    inter_node_latency_s: float
    """Latency of one message between nodes, seconds."""
    compute_efficiency: float = 0.5
    """Sustained fraction of the peak FLOP/s."""
    memory_efficiency: float = 0.8
    """Sustained fraction of the memory bandwidth."""
    link_efficiency: float = 0.8
    """Sustained fraction of a link's bandwidth in collectives and point-to-point messages."""
    usable_memory_fraction: float = 0.9
    """Fraction of the device memory a job can use (the rest: runtime context, fragmentation)."""
    op_overhead_s: float = 0.0
    """Fixed seconds per operator launched in the forward, whatever its size (dispatch and kernel
    launch; the file's ``device.op_overhead_us``). It dominates small models: on a CPU core a
    64-wide layer spends more time dispatching than computing. Shipped GPU files leave it out (0)."""
    per_action_s: float = 0.0
    """The pipeline runtime's own seconds per action on one device (the file's ``device.per_action_us``,
    measured as ``layout: auto`` does: [Note: per-action measurement]); the cluster model adds it per
    lowered action of the busiest pipeline rank to a pipelined step. 0 (the shipped files): left out."""
    step_overhead_s: float = 0.0
    """Fixed host seconds of a training step outside the pipeline and the per-tensor work, whatever
    the model (the engine's own bookkeeping: the step flags and the loss vector, the learning-rate
    schedule, the per-phase watchdog; the file's ``device.step_overhead_us``, measured as
    ``bench_cluster_plan.py steps`` does: [Note: measured step overhead] in :mod:`.cluster_overhead`).
    0 (the shipped files): left out."""
    step_tensor_s: float | None = None
    """Host seconds per parameter tensor of the optimizer step, the gradient norm, the clipping and the
    gradients' reset (the file's ``device.step_tensor_us``, measured with :attr:`step_overhead_s`).
    None: ``STEP_OPS_PER_TENSOR`` operators at :attr:`op_overhead_s`."""
    step_param_s: float | None = None
    """Host seconds per trainable parameter of the same work (the file's ``device.step_param_ns``,
    measured with :attr:`step_overhead_s`): an unfused optimizer passes over the memory once per list
    operation. None: Adam's bytes once at the memory bandwidth."""
    op_class_bandwidth: dict[str, float] = field(default_factory=dict)
    """Bytes/s per operator class (``activation``, ``norm``, ``softmax``, ``attention``: the file's
    ``device.op_class_gb_s``) at which that class's nodes are priced instead of :attr:`memory_bandwidth`
    ([Note: operator class rates] in :mod:`.cluster_classes`). Empty (the shipped files): every
    memory-bound node at the memory bandwidth."""
    device_name: str = ""
    source: str = ""
    """Where the numbers come from."""

    def __post_init__(self) -> None:
        if (
            not isinstance(self.devices_per_node, int)
            or isinstance(self.devices_per_node, bool)
            or self.devices_per_node < 1
        ):
            raise ValueError(f"ClusterSpec.devices_per_node={self.devices_per_node!r}: expected an int >= 1")
        if not self.peak_flops or any(not (v > 0) for v in self.peak_flops.values()):
            raise ValueError(f"ClusterSpec.peak_flops={self.peak_flops!r}: expected FLOP/s > 0 per dtype")
        for name in ("memory_bytes", "memory_bandwidth", "intra_node_bandwidth", "inter_node_bandwidth"):
            if not getattr(self, name) > 0:
                raise ValueError(f"ClusterSpec.{name}={getattr(self, name)!r}: expected a value > 0")
        for name in (
            "intra_node_latency_s",
            "inter_node_latency_s",
            "op_overhead_s",
            "per_action_s",
            "step_overhead_s",
        ):
            if not getattr(self, name) >= 0:
                raise ValueError(f"ClusterSpec.{name}={getattr(self, name)!r}: expected seconds >= 0")
        if self.step_tensor_s is not None and not self.step_tensor_s >= 0:
            raise ValueError(
                f"ClusterSpec.step_tensor_s={self.step_tensor_s!r}: expected seconds >= 0 or None"
            )
        for cls, rate in self.op_class_bandwidth.items():
            if cls not in OP_CLASSES or not rate > 0:
                raise ValueError(
                    f"ClusterSpec.op_class_bandwidth[{cls!r}]={rate!r}: expected bytes/s > 0 for a class "
                    f"among {sorted(OP_CLASSES)}"
                )
        for name in ("compute_efficiency", "memory_efficiency", "link_efficiency", "usable_memory_fraction"):
            v = getattr(self, name)
            if not 0 < v <= 1:
                raise ValueError(f"ClusterSpec.{name}={v!r}: expected a fraction in (0, 1]")

    def flops(self, dtype: str = "bf16") -> float:
        """Sustained FLOP/s of one device in ``dtype`` (peak x compute efficiency)."""
        if dtype not in self.peak_flops:
            raise ValueError(
                f"cluster {self.name!r} gives no peak for dtype {dtype!r}; it has {sorted(self.peak_flops)}"
            )
        return self.peak_flops[dtype] * self.compute_efficiency

    @property
    def usable_memory_bytes(self) -> float:
        """Memory a job can use on one device."""
        return self.memory_bytes * self.usable_memory_fraction

    def node_of(self, rank: int) -> int:
        """The node of global ``rank`` (ranks fill nodes in order, as torchrun numbers them)."""
        return rank // self.devices_per_node

    def link(self, ranks: list[int] | range) -> tuple[float, float]:
        """(bandwidth bytes/s, latency s) of the slowest link a ring over ``ranks`` uses (efficiency included)."""
        nodes = {self.node_of(r) for r in ranks}
        if len(nodes) > 1:
            return self.inter_node_bandwidth * self.link_efficiency, self.inter_node_latency_s
        return self.intra_node_bandwidth * self.link_efficiency, self.intra_node_latency_s

    @classmethod
    def from_dict(cls, raw: Any, *, source: str = "cluster") -> ClusterSpec:
        """Build from the YAML file's mapping (units of the file), refusing unknown or bad keys."""
        _check(raw, _SCHEMA, "", source)
        dev, intra = raw["device"], raw["intra_node"]
        inter = raw.get("inter_node")
        per_node = raw["devices_per_node"]
        eff = raw["efficiency"]
        intra_bw = float(intra["bandwidth_gb_s"]) * 1e9 / (2 if intra.get("bidirectional", False) else 1)
        if inter is None:  # one node only: the network is never used, price it like the node's links
            inter_bw, inter_lat = intra_bw, float(intra["latency_us"]) / 1e6
        else:
            inter_bw = float(inter["nics_per_node"]) * float(inter["nic_gbit_s"]) * 1e9 / 8 / per_node
            inter_lat = float(inter["latency_us"]) / 1e6
        try:
            return cls(
                name=raw["name"],
                devices_per_node=per_node,
                peak_flops={k: float(v) * 1e12 for k, v in dev["peak_tflops"].items()},
                memory_bytes=float(dev["memory_gb"]) * 1e9,
                memory_bandwidth=float(dev["memory_bandwidth_gb_s"]) * 1e9,
                intra_node_bandwidth=intra_bw,
                intra_node_latency_s=float(intra["latency_us"]) / 1e6,
                inter_node_bandwidth=inter_bw,
                inter_node_latency_s=inter_lat,
                compute_efficiency=float(eff["compute"]),
                memory_efficiency=float(eff.get("memory", 0.8)),
                link_efficiency=float(eff.get("link", 0.8)),
                usable_memory_fraction=float(raw.get("usable_memory_fraction", 0.9)),
                op_overhead_s=float(dev.get("op_overhead_us", 0.0)) / 1e6,
                per_action_s=float(dev.get("per_action_us", 0.0)) / 1e6,
                step_overhead_s=float(dev.get("step_overhead_us", 0.0)) / 1e6,
                step_tensor_s=float(dev["step_tensor_us"]) / 1e6 if "step_tensor_us" in dev else None,
                step_param_s=float(dev["step_param_ns"]) / 1e9 if "step_param_ns" in dev else None,
                op_class_bandwidth={k: float(v) * 1e9 for k, v in dev.get("op_class_gb_s", {}).items()},
                device_name=str(dev.get("name", "")),
                source=str(raw.get("source", "")),
            )
        except ValueError as exc:
            raise ValueError(f"{source}: {exc}") from None


def _check(raw: Any, schema: dict[str, Any], prefix: str, source: str) -> None:
    """Every key known, every required key present, every value of the right type and range."""
    if not isinstance(raw, dict):
        where = prefix.rstrip(".") or "the file"
        raise ValueError(f"{source}: {where} must be a mapping with keys {sorted(schema)}, got {raw!r}")
    for key in raw:
        if key not in schema:
            raise ValueError(
                f"{source}: unknown key {prefix + str(key)!r}; valid keys here: {sorted(schema)}"
            )
    for key, kind in schema.items():
        path = prefix + key
        if key not in raw:
            if path not in _OPTIONAL:
                raise ValueError(f"{source}: the key {path!r} is missing")
            continue
        value = raw[key]
        if isinstance(kind, dict):
            _check(value, kind, path + ".", source)
            continue
        ok = isinstance(value, kind) and not (kind is not bool and isinstance(value, bool))
        if kind is float:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not ok:
            raise ValueError(f"{source}: {path}={value!r} must be a {kind.__name__}")
        if kind in (int, float) and not value > 0:
            raise ValueError(f"{source}: {path}={value!r} must be > 0")
        if path in _FRACTIONS and not value <= 1:
            raise ValueError(f"{source}: {path}={value!r} must be a fraction in (0, 1]")


def shipped_clusters() -> dict[str, Path]:
    """The cluster files shipped with Merak, by name (e.g. ``h100-sxm-8x``)."""
    return {p.stem: p for p in sorted(_SHIPPED.glob("*.yaml"))}


def load_cluster(path_or_name: str | Path) -> ClusterSpec:
    """Read a cluster file, or a shipped one by name (see :func:`shipped_clusters`)."""
    path = Path(path_or_name)
    if not path.is_file():
        shipped = shipped_clusters()
        if str(path_or_name) not in shipped:
            raise ValueError(
                f"cluster {str(path_or_name)!r} is neither a file nor a shipped cluster; shipped: "
                f"{sorted(shipped)}"
            )
        path = shipped[str(path_or_name)]
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ValueError(f"cluster file {str(path)!r} is not valid YAML: {exc}") from None
    return ClusterSpec.from_dict(raw, source=f"cluster file {str(path)!r}")
