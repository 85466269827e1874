"""The ZeRO-1/2/3 GPU check (``multi_zero``, a multi-rank check of ``tests/gpu/checks.py``).

:func:`multi_zero` runs the Trainer at dp = world (the GPU check starts it on 2 devices), tp = pp = 1,
for each ZeRO stage (1: the optimizer state sharded by :class:`merak_core.parallel.zero.ZeroOptimizer`;
2 and 3: FSDP2 over the DP axis), twice:

- in float32 (TF32 off): every step's loss and gradient norm (before clipping, which is active)
  against one CPU process in float32 that takes the same global batches, averages the same
  microbatch gradients, clips and applies AdamW as the Trainer builds it (:func:`cpu_reference`,
  computed once on rank 0 after all the runs, its threads set by the check);
- in bf16: every step's loss within the bf16 tolerance of the same reference, and the throughput:
  tokens/s of every rank's tokens and MFU over the world's devices (median step with the device
  synchronised after it, after one warm-up step).

``full`` is a ~155M-parameter Llama-style model (hidden 1024, 6 layers, vocab 32000) at sequence
length 256; ``tiny`` the test models' smallest Llama on CPU ranks (the normal suite runs it in
``tests/gpu/test_cpu_smoke.py``). It does not measure ZeRO's traffic (``tests/core/test_zero_traffic.py``
does, on gloo).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tests.gpu.common import (
    CountingDataset,
    _arguments,
    _compare_bf16,
    _compare_losses,
    _median_step_s,
    _no_tf32,
    _prepare,
    llama_config,
    llama_flops_per_token,
    throughput,
)

ZERO_STAGES = (1, 2, 3)
ACCUMULATION = 2


def zero_model(size: str, *, seq: int) -> nn.Module:
    """The check's model: the GPU check's Llama-style model with 6 layers at ``full``."""
    from dataclasses import replace

    from tests.support.models import Llama, init_like_gpt2

    cfg = llama_config(size, seq=seq)
    if size == "full":
        cfg = replace(cfg, num_layers=6)
    torch.manual_seed(0)
    model = Llama(cfg)
    init_like_gpt2(model)
    return model


def cpu_reference(model: nn.Module, data: Any, args: Any, dp: int) -> tuple[list[float], list[float]]:
    """One CPU process in float32 over the Trainer's global batches: (loss, gradient norm) per step."""
    from merak_core.trainer import default_loss
    from tests.e2e._trainer_support import reference_microbatches, reference_optimizer

    model = model.to("cpu", torch.float32)
    opt, sched = reference_optimizer(model, args)
    losses, norms = [], []
    for chunks in reference_microbatches(len(data), args, dp):
        model.zero_grad(set_to_none=True)
        total = 0.0
        for chunk in chunks:
            batch = torch.utils.data.default_collate([data[i] for i in chunk])
            loss = default_loss(model(batch["input_ids"]), batch["labels"]) / len(chunks)
            loss.backward()
            total += float(loss.detach())
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)))
        opt.step()
        sched.step()
        losses.append(total)
    return losses, norms


def _run(model: nn.Module, data: Any, args: Any) -> tuple[list[dict[str, Any]], list[float]]:
    from merak_core import Trainer

    trainer = Trainer(model, args, data)
    _prepare(trainer)
    history = trainer.train()
    return history, list(trainer.device_step_s)


def multi_zero(device: str, size: str, *, stages: tuple[int, ...] = ZERO_STAGES) -> dict[str, Any]:
    """ZeRO ``stages`` at dp = world: float32 losses and norms, and bf16 losses, against one CPU
    process in float32; tokens/s and MFU of the bf16 runs."""
    _no_tf32()
    world = dist.get_world_size()
    if world < 2:
        raise ValueError(f"multi_zero shards over data-parallel ranks: needs 2 or more, got {world}")
    full = size == "full"
    seq, micro, steps = (256, 4, 4) if full else (8, 2, 3)
    model = zero_model(size, seq=seq)
    flops = llama_flops_per_token(model, seq)
    vocab = model.config.vocab_size  # type: ignore[attr-defined]
    data = CountingDataset(micro * ACCUMULATION * world * steps, vocab, seq)
    common: dict[str, Any] = dict(
        dp=world,
        gradient_accumulation_steps=ACCUMULATION,
        per_device_train_batch_size=micro,
        max_steps=steps,
        learning_rate=3e-4,
    )
    runs: dict[int, dict[str, Any]] = {}
    out: dict[str, Any] = {}
    for stage in stages:
        fp32, _ = _run(copy.deepcopy(model), data, _arguments(zero_stage=stage, **common))
        bf16, step_times = _run(copy.deepcopy(model), data, _arguments(zero_stage=stage, bf16=True, **common))
        runs[stage] = {"fp32": fp32, "bf16": bf16}
        out[f"zero{stage}_losses"] = [h["loss"] for h in fp32]
        out.update(
            throughput(
                f"zero{stage}",
                tokens_per_step=micro * ACCUMULATION * world * seq,
                step_s=_median_step_s(step_times, warmup=1),
                flops_per_token=flops,
                device=device,
                devices=world,
            )
        )
        if torch.device(device).type == "cuda":
            out[f"zero{stage}_peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
            torch.cuda.reset_peak_memory_stats()
            torch.cuda.empty_cache()
    if dist.get_rank() == 0:
        want_losses, want_norms = cpu_reference(model, data, _arguments(**common), world)
        out["reference_losses"] = want_losses
        for stage, run in runs.items():
            out.update(_compare_stage(stage, run, want_losses, want_norms, 1e-3 if full else 1e-4))
    return out


def _compare_stage(
    stage: int, run: dict[str, Any], want_losses: list[float], want_norms: list[float], rtol: float
) -> dict[str, float]:
    """Stage ``stage``'s runs against the CPU reference; the worst relative differences."""
    fp32, bf16 = run["fp32"], run["bf16"]
    norms = [h.get("grad_norm") for h in fp32]
    if any(n is None for n in norms):
        raise AssertionError(f"ZeRO-{stage}: a step without its gradient norm in the history: {fp32}")
    return {
        f"zero{stage}_loss_rel_diff": _compare_losses(
            f"ZeRO-{stage} float32 loss vs one CPU process", [h["loss"] for h in fp32], want_losses, rtol
        ),
        f"zero{stage}_norm_rel_diff": _compare_losses(
            f"ZeRO-{stage} float32 gradient norm vs one CPU process", norms, want_norms, rtol
        ),
        f"zero{stage}_bf16_loss_rel_diff": _compare_bf16(
            f"ZeRO-{stage} bf16 loss vs one CPU process in float32", [h["loss"] for h in bf16], want_losses
        ),
    }
