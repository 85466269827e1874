"""One device everywhere: device selection with a faked GPU count, eager init, moved stages' constants.

No GPU is needed: ``torch.cuda.is_available`` / ``device_count`` are faked, ``set_device`` and
``init_process_group`` are recorded instead of called, so the rules of
``merak_core.parallel.layout.select_device`` ([Note: one device]) are checked on any machine.
"""

from __future__ import annotations

import types
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.fx as fx
from torch import nn

import merak_core.parallel.layout as layout_mod
from merak_core.parallel.compose import build_parallel_model, place_stage
from merak_core.parallel.devices import collective_device, select_device
from merak_core.parallel.layout import ensure_process_group


@pytest.fixture
def gpus(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Fake ``n`` visible GPUs; ``current_device`` fails, so no code path may fall back to it."""

    def fake(n: int) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)

        def no_current_device() -> int:
            raise AssertionError("torch.cuda.current_device() is GPU 0 on every rank: use select_device")

        monkeypatch.setattr(torch.cuda, "current_device", no_current_device)

    monkeypatch.delenv("LOCAL_RANK", raising=False)
    return fake


@pytest.fixture
def existing_group(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Fake an initialised default process group with a backend string and a rank."""

    def fake(backend: str, rank: int = 0) -> None:
        monkeypatch.setattr(dist, "is_initialized", lambda: True)
        monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
        monkeypatch.setattr(dist, "get_rank", lambda group=None: rank)

    return fake


# ---------------------------------------------------------------------------- select_device


@pytest.mark.parametrize(
    ("local_rank", "count", "expected"),
    [
        (0, 8, 0),
        (5, 8, 5),
        (7, 8, 7),  # every GPU visible to every process: GPU LOCAL_RANK
        (3, 1, 0),
        (6, 1, 0),  # one GPU visible per process (CUDA_VISIBLE_DEVICES per rank)
        (5, 4, 1),
        (6, 4, 2),  # LOCAL_RANK modulo the visible count
    ],
)
def test_local_rank_modulo_visible_count(
    gpus: Any, monkeypatch: pytest.MonkeyPatch, local_rank: int, count: int, expected: int
) -> None:
    gpus(count)
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    assert select_device() == torch.device("cuda", expected)
    assert select_device("cuda") == torch.device("cuda", expected)


def test_no_gpu_means_cpu_and_cuda_request_fails(gpus: Any) -> None:
    gpus(0)
    assert select_device() == torch.device("cpu")
    assert select_device("cpu") == torch.device("cpu")
    with pytest.raises(
        ValueError, match=r"device='cuda' was requested but CUDA is not available: pass device='cpu'"
    ):
        select_device("cuda")


def test_explicit_index_must_be_visible(gpus: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    gpus(1)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert select_device("cuda:0") == torch.device("cuda", 0)
    with pytest.raises(ValueError, match=r"device='cuda:3': this process sees 1 CUDA device\(s\)"):
        select_device("cuda:3")


@pytest.mark.parametrize(
    ("backend", "expected"),
    [
        ("nccl", "cuda"),
        ("cpu:gloo,cuda:nccl", "cuda"),
        ("cuda:nccl,cpu:gloo", "cuda"),
        ("gloo", "cpu"),
    ],
)
def test_backend_string_decides(
    gpus: Any, monkeypatch: pytest.MonkeyPatch, backend: str, expected: str
) -> None:
    gpus(4)
    monkeypatch.setenv("LOCAL_RANK", "2")
    dev = select_device(backend=backend)
    assert dev.type == expected
    if expected == "cuda":
        assert dev.index == 2


@pytest.mark.parametrize("backend", ["nccl", "cpu:gloo,cuda:nccl"])
def test_existing_group_uses_local_rank_not_current_device(
    gpus: Any, existing_group: Any, monkeypatch: pytest.MonkeyPatch, backend: str
) -> None:
    gpus(4)
    existing_group(backend, rank=6)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert select_device() == torch.device("cuda", 3)
    assert collective_device() == torch.device("cuda", 3)
    monkeypatch.delenv("LOCAL_RANK")  # e.g. mp.spawn without torchrun: the group's rank, modulo the count
    assert select_device() == torch.device("cuda", 2)


def test_existing_gloo_group_stays_on_cpu(gpus: Any, existing_group: Any) -> None:
    gpus(4)
    existing_group("gloo", rank=1)
    assert select_device() == torch.device("cpu")
    assert collective_device() == torch.device("cpu")


def test_ensure_process_group_initialises_eagerly_on_the_local_gpu(
    gpus: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    gpus(2)
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    calls: dict[str, Any] = {}
    monkeypatch.setattr(torch.cuda, "set_device", lambda dev: calls.setdefault("set_device", dev))
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: calls.update(backend=backend, **kw))
    dev = ensure_process_group()
    assert dev == torch.device("cuda", 1)
    assert calls["set_device"] == torch.device("cuda", 1)
    assert calls["backend"] == "nccl"
    assert calls["device_id"] == torch.device("cuda", 1)  # eager: one communicator for every op
    assert (calls["rank"], calls["world_size"]) == (3, 4)


def test_ensure_process_group_refuses_a_gloo_backend_for_a_gpu(
    gpus: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    gpus(1)
    monkeypatch.setattr(
        dist, "init_process_group", lambda *a, **k: pytest.fail("must refuse before initialising")
    )
    with pytest.raises(ValueError, match=r"backend='gloo' cannot move tensors on cuda:0"):
        ensure_process_group("cuda", backend="gloo")


def test_ensure_process_group_on_cpu_is_gloo_without_device_id(
    gpus: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    gpus(0)
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    calls: dict[str, Any] = {}
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: calls.update(backend=backend, **kw))
    assert ensure_process_group() == torch.device("cpu")
    assert calls["backend"] == "gloo" and "device_id" not in calls


def test_one_place_chooses_the_device() -> None:
    """No other merak-core module asks torch which device is current (see [Note: one device])."""
    from pathlib import Path

    src = Path(layout_mod.__file__).parent
    offenders = [
        str(p.relative_to(src))
        for p in src.rglob("*.py")
        if "current_device()" in p.read_text() and p.name != "layout.py"
    ]
    assert offenders == []


# ---------------------------------------------------------------------------- moved stages


class _WithPositions(nn.Module):
    """Two layers; the forward makes a tensor with ``device=x.device``, which export bakes in."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(6, 6) for _ in range(4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x) + torch.arange(x.shape[-1], device=x.device, dtype=x.dtype)
        return x


def _device_constants(module: nn.Module) -> list[torch.device]:
    found = []
    for sub in module.modules():
        if isinstance(sub, fx.GraphModule):
            for node in sub.graph.nodes:
                dev = node.kwargs.get("device")
                if dev is not None:
                    found.append(torch.device(dev))
    return found


def test_place_stage_retargets_device_constants() -> None:
    import merak_graph

    part = merak_graph.partition(
        _WithPositions(), 2, example_inputs=(torch.randn(2, 6),), trace_method="export"
    )
    stage = part.stages[1]
    assert _device_constants(stage) and set(_device_constants(stage)) == {torch.device("cpu")}
    moved = place_stage(stage, "meta")
    assert set(_device_constants(moved)) == {torch.device("meta")}
    assert all(p.is_meta for p in moved.parameters())


def test_build_parallel_model_retargets_the_kept_stage() -> None:
    """The pp > 1 path with a real model moves ``part.stages[i]``: its constants follow (here to meta)."""
    layout = types.SimpleNamespace(pp=2, tp=1, cp=1, ep=1, pp_rank=1, pp_group=None, timeout=None)
    pm = build_parallel_model(
        _WithPositions(),
        layout,
        example_inputs=(torch.randn(2, 6),),  # type: ignore[arg-type]
        device="meta",
    )
    constants = _device_constants(pm.module)
    assert constants and set(constants) == {torch.device("meta")}


# ---------------------------------------------------------------------------- planner clocks and memory


def test_planner_memory_is_free_memory_less_a_margin(monkeypatch: pytest.MonkeyPatch) -> None:
    from merak_core.autoplan.givens import default_memory_per_device

    gib = 1 << 30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (40 * gib, 80 * gib))
    assert default_memory_per_device(torch.device("cuda", 0)) == 40 * gib - int(0.08 * 80 * gib)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (5 * gib, 8 * gib))
    assert default_memory_per_device(torch.device("cuda", 0)) == 4 * gib  # at least 1 GiB of margin


def test_planner_timings_synchronise_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    from merak_core.planner import clock

    synced: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: synced.append(device))
    calls: list[int] = []
    clock.timed(lambda: calls.append(1), 3, torch.device("cuda", 1))
    assert len(calls) == 4 and synced == [torch.device("cuda", 1)] * 2  # before and after the timed calls
    synced.clear()
    clock.timed(lambda: None, 3, torch.device("cpu"))
    assert synced == []
