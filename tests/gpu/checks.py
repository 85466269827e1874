"""The GPU checks, written once for any device: each takes ``device`` and ``size`` and asserts.

``size="full"`` is the GPU run (``nox -s gpu``, through ``tests/gpu/main.py`` in a subprocess per
check); ``size="tiny"`` is the CPU smoke version that the normal suite runs in the gloo worker pool
(``tests/gpu/test_cpu_smoke.py``), so the logic of every check is exercised on machines without a
GPU. A check returns a small dict of numbers (printed by the GPU session). What the checks share (the
peak table and MFU, models, data, Trainer runs, comparisons) is in ``tests/gpu/common.py``; the
multi-rank checks are in ``tests/gpu/multi.py`` and ``tests/gpu/zero_check.py``; this module holds
the single-rank checks and the registries (:data:`SINGLE_CHECKS`, :data:`MULTI_CHECKS`,
:data:`MULTI_RANKS`).

Single-rank checks (the default process group has one rank):

- :func:`trainer_bf16` — the Trainer in bf16 on ``device`` for the demo model (examples/addition)
  and a Llama-style model against the Trainer in float32 on the CPU: every one of the steps' losses
  within the bf16 tolerance; tokens/s and MFU of the Llama model (``full``: ~330M parameters).
- :func:`pipeline_v` — the pipeline engine on one rank with two local stages (stage 0 hands its
  output to stage 1 without communication) against the unsplit model: loss and every gradient.
- :func:`tp_world1` — TP layers and sub-pipelined regions at world 1 against the plain model, in
  float32 and under bf16 autocast with the backward run outside it.
- :func:`save_resume` — save, resume and continue on ``device`` (fused AdamW on CUDA, also the
  multi-tensor AdamW): the resumed losses equal the uninterrupted run's.
- :func:`compiled_stages` — ``compile: true`` and ``regional`` against eager (float32 losses, 5 steps)
  and the compiled step time against eager in bf16 (``tests/gpu/compile_check.py``; inductor on CUDA).

Multi-rank checks (every rank calls them; the GPU check runs them under torchrun), each with
tokens/s and MFU: :func:`~tests.gpu.multi.multi_pipeline` (every schedule at pp = 2 and 4),
:func:`~tests.gpu.multi.multi_tp_overlap` (TP with ``overlap_chunks``),
:func:`~tests.gpu.zero_check.multi_zero` (ZeRO-1/2/3 at dp=2) and :func:`~tests.gpu.multi.multi_3d`
(the demo at 2x2x2).
"""

from __future__ import annotations

import copy
import tempfile
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tests.gpu.common import (
    CountingDataset,
    _arguments,
    _close,
    _compare_bf16,
    _compare_losses,
    _lm_loss,
    _median_step_s,
    _no_tf32,
    _train,
    build_llama,
    demo_model_and_data,
    device_peak,
    llama_config,
    llama_flops_per_token,
    mfu,
    peak_bf16_flops,
)
from tests.gpu.multi import multi_3d, multi_pipeline, multi_tp_overlap
from tests.gpu.zero_check import multi_zero

__all__ = ["MULTI_CHECKS", "MULTI_RANKS", "SINGLE_CHECKS", "peak_bf16_flops"]


def trainer_bf16(device: str, size: str) -> dict[str, Any]:
    """Trainer in bf16 on ``device`` against float32 on the CPU (demo model and Llama); Llama throughput."""
    steps = 20 if size == "full" else 4
    out: dict[str, Any] = {}
    model, train, _ = demo_model_and_data(size)
    ref_model = copy.deepcopy(model)
    _, bf16 = _train(
        model, train, device, bf16=True, max_steps=steps, per_device_train_batch_size=16, learning_rate=3e-3
    )
    _, fp32 = _train(
        ref_model, train, "cpu", max_steps=steps, per_device_train_batch_size=16, learning_rate=3e-3
    )
    out["demo_loss_rel_diff"] = _compare_bf16(
        "demo model bf16 vs CPU float32", [h["loss"] for h in bf16], [h["loss"] for h in fp32]
    )
    out["demo_loss_first_last"] = (bf16[0]["loss"], bf16[-1]["loss"])
    assert bf16[-1]["loss"] < bf16[0]["loss"], f"the demo model did not learn in {steps} bf16 steps: {bf16}"
    # Llama: the loss comparison on a small batch (the CPU float32 run must stay short) ...
    seq = 128 if size == "full" else 8
    data = CountingDataset(64, llama_config(size, seq=seq).vocab_size, seq)
    llama = build_llama(size, seq=seq)
    ref = copy.deepcopy(llama)
    _, bf16 = _train(llama, data, device, bf16=True, max_steps=steps, learning_rate=3e-4)
    _, fp32 = _train(ref, data, "cpu", max_steps=steps, learning_rate=3e-4)
    out["llama_loss_rel_diff"] = _compare_bf16(
        "Llama bf16 vs CPU float32", [h["loss"] for h in bf16], [h["loss"] for h in fp32]
    )
    del llama, ref
    out.update(llama_throughput(device, size))
    return out


def llama_throughput(device: str, size: str) -> dict[str, Any]:
    """Tokens/s and MFU of the Trainer in bf16 at world 1 (median synchronised step after two warm-up steps)."""
    seq = 1024 if size == "full" else 16
    micro = 8 if size == "full" else 2
    steps = 10 if size == "full" else 3
    model = build_llama(size, seq=seq)
    flops_per_token = llama_flops_per_token(model, seq)
    params = sum(p.numel() for p in model.parameters())
    data = CountingDataset(micro * steps, model.config.vocab_size, seq)  # type: ignore[attr-defined]
    trainer, _ = _train(
        model, data, device, bf16=True, max_steps=steps, per_device_train_batch_size=micro, learning_rate=3e-4
    )
    step_s = _median_step_s(trainer.device_step_s, warmup=2)
    tokens_per_s = micro * seq / step_s
    dev = torch.device(device)
    name, peak = device_peak(dev)
    return {
        "llama_params": params,
        "llama_tokens_per_step": micro * seq,
        "llama_step_s": step_s,
        "llama_tokens_per_s": tokens_per_s,
        "llama_mfu": mfu(tokens_per_s, flops_per_token, peak, 1),
        "device_name": name,
        "peak_bf16_flops": peak,
        "peak_memory_gib": (torch.cuda.max_memory_allocated(dev) / 2**30) if dev.type == "cuda" else None,
        "steps_without_host_sync": trainer.quiet_steps_checked,  # set_sync_debug_mode("error") around them
    }


# ---------------------------------------------------------------------------- pipeline on one rank


def pipeline_v(device: str, size: str) -> dict[str, Any]:
    """Two local stages on one rank (interleaved 1F1B over one rank) against the unsplit model."""
    import merak_graph
    from merak_core.parallel.compose import place_stage
    from merak_pipe import PipelineRunner, PipelineStage, build_schedule

    _no_tf32()
    dev = torch.device(device)
    seq = 256 if size == "full" else 8
    batch, micro = 8, 4
    model = build_llama(size, seq=seq)
    if size == "full":  # fewer layers: the check is about the hand-over, not the size
        model.layers = model.layers[:8]
    ref = copy.deepcopy(model).to(dev)
    data = CountingDataset(batch, model.config.vocab_size, seq)  # type: ignore[attr-defined]
    ids = torch.stack([data[i]["input_ids"] for i in range(batch)])
    labels = torch.stack([data[i]["labels"] for i in range(batch)])
    part = merak_graph.partition(model, 2, example_inputs=(ids[: batch // micro],))
    stages = [
        PipelineStage(
            place_stage(part.stages[s], dev), stage_index=s, num_stages=2, group=dist.group.WORLD, device=dev
        )
        for s in range(2)
    ]
    schedule = build_schedule("interleaved-1f1b", num_stages=2, num_microbatches=micro, num_ranks=1)
    runner = PipelineRunner(stages, schedule, loss_fn=_lm_loss, group=dist.group.WORLD)
    loss = runner.step(ids.to(dev), labels.to(dev))
    want = _lm_loss(ref(ids.to(dev)), labels.to(dev))
    want.backward()
    _close("pipeline loss", torch.as_tensor(loss), want, 1e-5, 1e-6)
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    checked = 0
    for s in range(2):
        names = part.stage_parameter_names(s)
        for local, p in part.stages[s].named_parameters():
            assert p.grad is not None, f"stage {s} {local} has no gradient"
            _close(f"grad {names[local]}", p.grad, ref_grads[names[local]], 1e-4, 1e-6)
            checked += 1
    assert checked == len(ref_grads) or checked >= len(ref_grads) - 1, (checked, len(ref_grads))
    return {"pipeline_loss": float(loss), "pipeline_grads_checked": checked}


# ---------------------------------------------------------------------------- TP at world 1


def _tp_copy(model: nn.Module, chunks: int) -> nn.Module:
    import merak_tp
    import tests.support.tp_plans  # noqa: F401 - registers the test models' plans

    tp = copy.deepcopy(model)
    merak_tp.parallelize(tp, None, group=dist.group.WORLD)
    for i, block in enumerate(tp.layers):  # type: ignore[union-attr]
        merak_tp.make_region(block.self_attn, group=dist.group.WORLD, chunks=chunks, name=f"attn{i}")
        merak_tp.make_region(block.mlp, group=dist.group.WORLD, chunks=chunks, name=f"mlp{i}")
    return tp


def _grads_of(
    model: nn.Module, ids: torch.Tensor, labels: torch.Tensor, bf16: bool
) -> tuple[float, dict[str, Any]]:
    model.zero_grad(set_to_none=True)
    with torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=bf16):
        loss = _lm_loss(model(ids), labels)
    loss.backward()  # outside autocast, as autograd's device thread runs it on CUDA
    return float(loss), {n: p.grad for n, p in model.named_parameters()}


def tp_world1(device: str, size: str) -> dict[str, Any]:
    """merak_tp layers + sub-pipelined regions (chunks 2) at world 1 against the plain model."""
    import merak_tp

    _no_tf32()
    dev = torch.device(device)
    seq = 256 if size == "full" else 8
    model = build_llama(size, seq=seq)
    if size == "full":
        model.layers = model.layers[:4]
    model = model.to(dev)
    data = CountingDataset(8, model.config.vocab_size, seq)  # type: ignore[attr-defined]
    ids = torch.stack([data[i]["input_ids"] for i in range(8)]).to(dev)
    labels = torch.stack([data[i]["labels"] for i in range(8)]).to(dev)
    out: dict[str, Any] = {}
    for chunks in (1, 2):
        tp = _tp_copy(model, chunks)
        assert any(isinstance(m, merak_tp.ColumnParallelLinear) for m in tp.modules())
        _grads_of(tp, ids, labels, False)  # the regions' probe call
        for bf16, (rtol, atol) in ((False, (1e-4, 1e-6)), (True, (5e-2, 5e-3))):
            want_loss, want = _grads_of(model, ids, labels, bf16)
            got_loss, got = _grads_of(tp, ids, labels, bf16)
            _close(
                f"chunks={chunks} bf16={bf16} loss",
                torch.tensor(got_loss),
                torch.tensor(want_loss),
                rtol,
                atol,
            )
            for name, g in want.items():
                assert got[name] is not None and got[name].dtype == g.dtype, name
                scale = float(g.abs().max()) or 1.0
                _close(f"chunks={chunks} bf16={bf16} grad {name}", got[name] / scale, g / scale, rtol, atol)
            out[f"loss_chunks{chunks}_bf16{int(bf16)}"] = got_loss
    return out


# ---------------------------------------------------------------------------- checkpoints


def save_resume(device: str, size: str) -> dict[str, Any]:
    """Train 2k steps straight, and k steps + save + resume in a new Trainer + k steps: same losses."""
    dev = torch.device(device)
    k = 3
    variants: dict[str, Any] = {"default": None}  # AdamW as the Trainer builds it: fused on CUDA
    variants["foreach"] = lambda groups: torch.optim.AdamW(groups, lr=1e-3, weight_decay=0.01, foreach=True)
    if dev.type == "cuda":
        variants["fused"] = lambda groups: torch.optim.AdamW(groups, lr=1e-3, weight_decay=0.01, fused=True)
    out: dict[str, Any] = {}
    for name, factory in variants.items():
        model, train, _ = demo_model_and_data(size)
        first, second, straight = (copy.deepcopy(model) for _ in range(3))
        folder = tempfile.mkdtemp(prefix=f"merak-resume-{name}-")
        common = dict(per_device_train_batch_size=8, learning_rate=1e-3, output_dir=folder)
        _, head = _train(first, train, device, max_steps=k, save_steps=k, optimizer_factory=factory, **common)
        from merak_core import Trainer

        args = _arguments(max_steps=2 * k, save_steps=k, **common)
        resumed = Trainer(second, args, train, device=device, optimizer_factory=factory)
        resumed.metrics.enabled = False
        assert resumed.resume("latest") == k
        tail = resumed.train()
        _, full = _train(
            straight,
            train,
            device,
            max_steps=2 * k,
            optimizer_factory=factory,
            **{**common, "output_dir": tempfile.mkdtemp()},
        )
        got = [h["loss"] for h in head] + [h["loss"] for h in tail]
        want = [h["loss"] for h in full]
        if dev.type == "cpu":
            assert got == want, f"{name}: resumed losses {got} differ from the uninterrupted run {want}"
        else:
            _compare_losses(f"{name}: resumed vs uninterrupted", got, want, 1e-5)
        out[f"resume_{name}"] = got[-1]
    return out


def compiled_stages(device: str, size: str) -> dict[str, Any]:
    """``training.compile`` against eager (``tests/gpu/compile_check.py``)."""
    from tests.gpu.compile_check import compiled_stages as check

    return check(device, size)


SINGLE_CHECKS = {
    "trainer_bf16": trainer_bf16,
    "pipeline_v": pipeline_v,
    "tp_world1": tp_world1,
    "save_resume": save_resume,
    "compiled_stages": compiled_stages,
}


MULTI_CHECKS = {
    "multi_pipeline": multi_pipeline,
    "multi_tp_overlap": multi_tp_overlap,
    "multi_zero": multi_zero,
    "multi_3d": multi_3d,
}
MULTI_RANKS: dict[str, tuple[int, int | None]] = {
    "multi_pipeline": (2, None),
    "multi_tp_overlap": (2, None),
    "multi_zero": (2, 2),
    "multi_3d": (8, None),
}
"""Per multi-rank check: (devices it needs, ranks it runs at; None: every device)."""
