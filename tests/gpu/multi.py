"""The multi-rank GPU checks (every rank calls them; the GPU check runs them under torchrun).

- :func:`multi_pipeline` — the Trainer at pp = 2 and 4 with every schedule, the virtual-stage ones at
  ``virtual_stages=2`` (``full``: boundaries of 16 MiB) against the single-device reference steps
  (float32 on the device, TF32 off: a CPU reference of every step at these sizes would not fit the
  budget) and the first step against one CPU process in float32; tokens/s and MFU of each run's
  second step;
- :func:`multi_tp_overlap` — TP at 2/4/8 with ``overlap_chunks`` 1, 2, 4: the same outputs, the
  float32 output against one CPU process in float32, the sub-pipelined speedup, tokens/s and MFU of
  each (``full``: a Llama block at hidden 4096);
- :func:`multi_3d` — the demo job at dp=2 tp=2 pp=2 against the single-process CPU float32 reference
  losses; tokens/s and MFU.

A part that needs more ranks than the world has is skipped and named in the result's ``skipped``
list (the GPU check prints it). ZeRO-1/2/3 is ``tests/gpu/zero_check.py``.
"""

from __future__ import annotations

import copy
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tests.gpu.common import (
    CountingDataset,
    _arguments,
    _close,
    _compare_losses,
    _lm_loss,
    _median_step_s,
    _no_tf32,
    _prepare,
    _sync,
    demo_model_and_data,
    flops_per_token,
    llama_flops_per_token,
    throughput,
)


def _reference_losses(model: nn.Module, data: Any, args: Any, dp: int, device: torch.device) -> list[float]:
    from tests.e2e._trainer_support import reference_steps

    model = model.to(device)

    def microbatch_loss(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return _lm_loss(model(batch["input_ids"].to(device)), batch["labels"].to(device))

    return reference_steps(model, data, args, dp, microbatch_loss)


def _cpu_first_loss(model: nn.Module, data: Any, args: Any, dp: int) -> float:
    """The first step's loss in one CPU process in float32 (a forward of every microbatch of the
    step's global batch, averaged as the Trainer averages them)."""
    from tests.e2e._trainer_support import reference_microbatches

    model = copy.deepcopy(model).to("cpu", torch.float32)
    chunks = reference_microbatches(len(data), args, dp)[0]
    total = 0.0
    with torch.no_grad():
        for chunk in chunks:
            batch = torch.utils.data.default_collate([data[i] for i in chunk])
            total += float(_lm_loss(model(batch["input_ids"]), batch["labels"])) / len(chunks)
    return total


ALL_SCHEDULES = ("gpipe", "1f1b", "zb_h1", "shifted_critical_path", "interleaved_1f1b", "zb_v")
VIRTUAL_SCHEDULES = ("interleaved_1f1b", "zb_v")
"""Schedules run with two stages per pipeline rank (``virtual_stages=2``)."""


def _pipeline_config(size: str, *, seq: int, hidden: int, layers: int) -> Any:
    from tests.support.models import DecoderConfig

    if size == "full":
        return DecoderConfig(
            vocab_size=32000,
            hidden_size=hidden,
            num_layers=layers,
            num_heads=16,
            num_kv_heads=4,
            intermediate_size=5504,
            max_seq_len=seq,
        )
    return DecoderConfig(
        vocab_size=96,
        hidden_size=hidden,
        num_layers=layers,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=64,
        max_seq_len=seq,
    )


def multi_pipeline(
    device: str, size: str, *, degrees: tuple[int, ...] = (2, 4), schedules: tuple[str, ...] = ALL_SCHEDULES
) -> dict[str, Any]:
    """Trainer at pp = 2 and 4 (dp = world / pp) with every schedule against the reference steps;
    tokens/s and MFU of each run's second step (float32, TF32 off, against the bf16 peak).

    ``degrees`` / ``schedules`` narrow it (the CPU smoke runs one schedule per degree)."""
    _no_tf32()
    world = dist.get_world_size()
    out: dict[str, Any] = {"skipped": []}
    cpu_first: dict[int, float] = {}  # layers -> the first step's loss in one CPU process (rank 0)
    for pp in degrees:
        if pp > world or world % pp:
            out["skipped"].append(f"pp={pp}: needs a multiple of {pp} ranks, the world has {world}")
            continue
        for schedule in schedules:
            out.update(_pipeline_run(device, size, pp, schedule, cpu_first))
            if torch.device(device).type == "cuda":
                torch.cuda.empty_cache()
            dist.barrier()
    return out


def _pipeline_run(
    device: str, size: str, pp: int, schedule: str, cpu_first: dict[int, float]
) -> dict[str, Any]:
    """One schedule at ``pp``: every step's loss against the reference steps on the device, the first
    against one CPU process in float32 (rank 0; the global batch does not depend on pp), tokens/s, MFU."""
    from merak_core import Trainer
    from tests.support.models import Llama

    world = dist.get_world_size()
    seq, hidden = (1024, 2048) if size == "full" else (8, 32)
    micro = 2
    virtual = 2 if schedule in VIRTUAL_SCHEDULES else 1
    torch.manual_seed(0)
    cfg = _pipeline_config(size, seq=seq, hidden=hidden, layers=4 * virtual)
    model = Llama(cfg)
    ref_model = copy.deepcopy(model) if dist.get_rank() == 0 else None
    flops = llama_flops_per_token(model, seq)
    data = CountingDataset(64, cfg.vocab_size, seq)
    args = _arguments(
        pp=pp,
        dp=world // pp,
        schedule=schedule,
        virtual_stages=virtual,
        gradient_accumulation_steps=2 * pp,
        per_device_train_batch_size=micro,
        max_steps=2,
        learning_rate=1e-3,
    )
    trainer = Trainer(model, args, data, loss_fn=_lm_loss)
    _prepare(trainer)
    losses = [h["loss"] for h in trainer.train()]
    step_s = trainer.device_step_s[-1]  # the first step warms up
    del trainer, model
    out: dict[str, Any] = {}
    if ref_model is not None:
        if cfg.num_layers not in cpu_first:  # from the initial weights: before the reference steps
            cpu_first[cfg.num_layers] = _cpu_first_loss(ref_model, data, args, world // pp)
        want = _reference_losses(ref_model, data, args, world // pp, torch.device(device))
        _compare_losses(f"pp={pp} {schedule}", losses, want, 1e-4)
        first = [cpu_first[cfg.num_layers]]
        what = f"pp={pp} {schedule} first step vs one CPU process"
        out[f"pp{pp}_{schedule}_cpu_first_rel_diff"] = _compare_losses(what, losses[:1], first, 1e-4)
        del ref_model
    tokens = micro * args.gradient_accumulation_steps * (world // pp) * seq
    return {
        **out,
        f"pp{pp}_{schedule}": losses,
        "boundary_mib": micro * seq * hidden * 4 / 2**20,
        **throughput(
            f"pp{pp}_{schedule}",
            tokens_per_step=tokens,
            step_s=step_s,
            flops_per_token=flops,
            device=device,
            devices=world,
        ),
    }


def _time_fwd_bwd(model: nn.Module, x: torch.Tensor, repeats: int) -> float:
    def once() -> None:
        model(x).float().sum().backward()

    for _ in range(2):
        once()
    _sync(x.device)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(repeats):
        once()
    _sync(x.device)
    return (time.perf_counter() - start) / repeats


def _tp_runs(
    base: nn.Module, group: Any, x: torch.Tensor, size: str
) -> tuple[dict[int, torch.Tensor], dict[int, float], torch.Tensor]:
    """``base`` at TP over ``group`` with overlap_chunks 1/2/4: the outputs and fwd+bwd seconds of each
    (bf16 autocast at ``full``), and the float32 output at chunks=2 (on the CPU)."""
    import merak_tp
    import tests.support.tp_plans  # noqa: F401 - registers the test models' plans

    times: dict[int, float] = {}
    outputs: dict[int, torch.Tensor] = {}
    fp32 = torch.empty(0)
    for chunks in (1, 2, 4):
        model = merak_tp.parallelize(copy.deepcopy(base), None, group=group, overlap_chunks=chunks)
        model = model.to(x.device)
        if chunks == 2:
            with torch.no_grad():
                fp32 = model(x).float().cpu()
        with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=size == "full"):
            outputs[chunks] = model(x).detach().float()
            times[chunks] = _time_fwd_bwd(model, x, 10 if size == "full" else 2)
        del model
    return outputs, times, fp32


def multi_tp_overlap(device: str, size: str) -> dict[str, Any]:
    """TP at 2/4/8 over consecutive ranks, overlap_chunks 1/2/4: same outputs; the float32 output
    (chunks=2) against one CPU process in float32; speedup over chunks=1; tokens/s and MFU of each
    (a forward and backward, bf16 autocast at ``full``)."""
    from tests.support.models import DecoderConfig, Llama

    _no_tf32()
    world, rank = dist.get_world_size(), dist.get_rank()
    dev = torch.device(device)
    hidden, seq, batch = (4096, 1024, 8) if size == "full" else (32, 8, 8)
    out: dict[str, Any] = {"skipped": []}
    reference = None  # one CPU process's float32 logits (rank 0; every degree's base model is the same)
    for tp in (2, 4, 8):
        if tp > world or world % tp:
            out["skipped"].append(f"tp={tp}: needs a multiple of {tp} ranks, the world has {world}")
            continue
        groups = [dist.new_group(list(range(s, s + tp))) for s in range(0, world, tp)]
        group = groups[rank // tp]
        torch.manual_seed(0)
        cfg = DecoderConfig(
            vocab_size=256,
            hidden_size=hidden,
            num_layers=2,
            num_heads=32 if size == "full" else 8,
            num_kv_heads=8,
            intermediate_size=11008 if size == "full" else 64,
            max_seq_len=seq,
        )
        base = Llama(cfg)
        flops = llama_flops_per_token(base, seq)
        x = torch.randint(0, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(1)).to(dev)
        outputs, times, fp32 = _tp_runs(base, group, x, size)
        for chunks in (2, 4):
            tol = (5e-2, 5e-2) if size == "full" else (1e-5, 1e-6)
            _close(f"tp={tp} chunks={chunks} output", outputs[chunks], outputs[1], *tol)
        if rank == 0:
            if reference is None:
                with torch.no_grad():
                    reference = base(x.cpu()).float()
            _close(f"tp={tp} chunks=2 float32 output vs one CPU process", fp32, reference, 1e-4, 1e-4)
            out[f"tp{tp}_fp32_max_abs_diff"] = float((fp32 - reference).abs().max())
        slowest = torch.tensor([times[c] for c in (1, 2, 4)], dtype=torch.float64, device=dev)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        t1, t2, t4 = (float(v) for v in slowest)
        out[f"tp{tp}_step_ms"] = {1: t1 * 1e3, 2: t2 * 1e3, 4: t4 * 1e3}
        out[f"tp{tp}_speedup"] = {2: t1 / t2, 4: t1 / t4}
        for chunks, t in ((1, t1), (2, t2), (4, t4)):  # one TP group's batch per forward and backward
            out.update(
                throughput(
                    f"tp{tp}_chunks{chunks}",
                    tokens_per_step=batch * seq,
                    step_s=t,
                    flops_per_token=flops,
                    device=device,
                    devices=tp,
                )
            )
        for g in groups:
            dist.destroy_process_group(g)
    return out


def multi_3d(device: str, size: str) -> dict[str, Any]:
    """The demo job at dp = world / 4, tp = 2, pp = 2 against the single-process CPU float32 reference
    losses; tokens/s and MFU (median synchronised step after two)."""
    from merak_core import Trainer

    _no_tf32()
    world = dist.get_world_size()
    if world % 4:
        raise ValueError(f"multi_3d needs a multiple of 4 ranks, got {world}")
    model, train, _ = demo_model_and_data(size)
    ref_model = copy.deepcopy(model) if dist.get_rank() == 0 else None
    steps = 20 if size == "full" else 3
    tp_plan = {
        "layers.*.attn.query": "column",
        "layers.*.attn.key": "column",
        "layers.*.attn.value": "column",
        "layers.*.attn.out": "row",
        "layers.*.up": "column",
        "layers.*.down": "row",
    }
    args = _arguments(
        dp=world // 4,
        tp=2,
        pp=2,
        schedule="1f1b",
        gradient_accumulation_steps=2,
        per_device_train_batch_size=8,
        max_steps=steps,
        learning_rate=3e-3,
        tp_plan=tp_plan,
    )
    seq = train[0]["input_ids"].numel()
    flops = flops_per_token(model, seq, layers=len(model.layers), hidden=model.token_embed.embedding_dim)
    trainer = Trainer(model, args, train)
    _prepare(trainer)
    losses = [h["loss"] for h in trainer.train()]
    out: dict[str, Any] = {"losses_3d": losses}
    out.update(
        throughput(
            "demo_3d",
            tokens_per_step=8 * 2 * (world // 4) * seq,
            step_s=_median_step_s(trainer.device_step_s, warmup=2),
            flops_per_token=flops,
            device=device,
            devices=world,
        )
    )
    if ref_model is not None:
        from merak_core.trainer import default_loss

        def microbatch_loss(batch: dict[str, torch.Tensor]) -> torch.Tensor:
            return default_loss(ref_model(batch["input_ids"]), batch["labels"])

        from tests.e2e._trainer_support import reference_steps

        want = reference_steps(ref_model, train, args, world // 4, microbatch_loss)
        # float32 over 20 steps: summation orders differ (TP, DP, microbatches) and Adam amplifies them a little.
        out["worst_rel_diff"] = _compare_losses(
            "2x2x2 demo vs one CPU process", losses, want, 2e-3 if size == "full" else 1e-4
        )
    return out
