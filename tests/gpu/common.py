"""What the GPU checks share: the peak table and MFU, the models and data, the Trainer runs, the comparisons.

Used by the single-rank checks (``tests/gpu/checks.py``), the multi-rank ones
(``tests/gpu/multi.py``, ``tests/gpu/zero_check.py``) and ``tests/gpu/compile_check.py``; it runs
no check itself.

Throughput: a step's time is measured with the device synchronised after the step
(:func:`_time_steps`; without it a CUDA step that reads nothing returns when its kernels are queued),
tokens/s counts every rank's tokens, and MFU is tokens/s x training FLOPs per token (6 per matmul
weight plus causal attention's 6 * layers * seq * hidden: :func:`flops_per_token`) over the peak dense
bf16 FLOP/s of every device used (:func:`mfu`); null where the peak is unknown (CPU, an unlisted GPU).
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

ROOT = Path(__file__).resolve().parents[2]


PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    # Dense bf16 tensor-core peaks (no sparsity), by a substring of torch.cuda.get_device_name; first match wins.
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),
    ("H200", 989e12),
    ("H800", 989e12),
    ("GH200", 989e12),
    ("B200", 2250e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("A10G", 70e12),
    ("A10", 125e12),
    ("L40S", 362e12),
    ("L40", 181e12),
    ("L4", 121e12),
    ("RTX 4090", 165e12),
    ("RTX 3090", 71e12),
    ("A6000", 155e12),
    ("MI300X", 1307e12),
    ("MI250X", 383e12),
)


def peak_bf16_flops(device_name: str) -> float | None:
    """The device's peak dense bf16 FLOP/s from :data:`PEAK_BF16_FLOPS`; None for an unknown device."""
    for key, flops in PEAK_BF16_FLOPS:
        if key.lower() in device_name.lower():
            return flops
    return None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _no_tf32() -> None:
    """float32 comparisons on CUDA in float32 (TF32 matmuls would cost ~3 decimal digits)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def device_peak(device: str | torch.device) -> tuple[str, float | None]:
    """The device's name and peak dense bf16 FLOP/s (None off CUDA or for an unlisted GPU)."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return dev.type, None
    name = torch.cuda.get_device_name(dev)
    return name, peak_bf16_flops(name)


def mfu(tokens_per_s: float, flops_per_token: float, peak: float | None, devices: int) -> float | None:
    """Model FLOPs utilisation: achieved training FLOP/s over the peak of ``devices`` devices; None without a peak."""
    if peak is None or peak <= 0:
        return None
    return tokens_per_s * flops_per_token / (peak * devices)


def throughput(
    prefix: str, *, tokens_per_step: int, step_s: float, flops_per_token: float, device: str, devices: int
) -> dict[str, Any]:
    """``{prefix}_tokens_per_s`` (every rank's tokens) and ``{prefix}_mfu`` (over ``devices`` devices)."""
    tokens_per_s = tokens_per_step / step_s
    _, peak = device_peak(device)
    return {
        f"{prefix}_tokens_per_s": tokens_per_s,
        f"{prefix}_mfu": mfu(tokens_per_s, flops_per_token, peak, devices),
    }


def flops_per_token(model: nn.Module, seq: int, *, layers: int, hidden: int) -> float:
    """Training FLOPs per token: 6 per weight of every ``nn.Linear`` (a tied output head included; the
    embedding lookups are no matmuls) plus causal attention's 6 * layers * seq * hidden."""
    weights = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    return 6.0 * weights + 6.0 * layers * seq * hidden


def _time_steps(trainer: Any) -> list[float]:
    """Wrap ``trainer.engine.step``: each step's seconds with the device synchronised before and after
    it (outside any ``set_sync_debug_mode`` of the step itself); returns the list it fills."""
    times: list[float] = []
    inner, device = trainer.engine.step, trainer.device

    def step(*args: Any, **kwargs: Any) -> Any:
        _sync(device)
        start = time.perf_counter()
        result = inner(*args, **kwargs)
        _sync(device)
        times.append(time.perf_counter() - start)
        return result

    trainer.engine.step = step
    return times


def _median_step_s(times: Sequence[float], warmup: int) -> float:
    """The median of the step times after ``warmup`` steps (the last one when there are no more)."""
    return statistics.median(times[warmup:] or times[-1:])


# ---------------------------------------------------------------------------- models and data


class CountingDataset(Dataset):
    """Sequences ``start, start + k, start + 2k, ...`` (mod vocab): learnable next-token labels."""

    def __init__(self, size: int, vocab: int, seq: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, vocab, (size, 1), generator=g)
        step = torch.randint(1, 4, (size, 1), generator=g)
        self.ids = (start + step * torch.arange(seq + 1)) % vocab

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i, :-1], "labels": self.ids[i, 1:].clone()}


def llama_config(size: str, *, seq: int) -> Any:
    from tests.support.models import DecoderConfig

    if size == "full":  # ~330M parameters
        return DecoderConfig(
            vocab_size=32000,
            hidden_size=1024,
            num_layers=24,
            num_heads=16,
            num_kv_heads=4,
            intermediate_size=2816,
            max_seq_len=seq,
        )
    return DecoderConfig(
        vocab_size=96,
        hidden_size=32,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=64,
        max_seq_len=seq,
    )


def build_llama(size: str, *, seq: int, seed: int = 0) -> nn.Module:
    from tests.support.models import Llama, init_like_gpt2

    torch.manual_seed(seed)
    model = Llama(llama_config(size, seq=seq))
    init_like_gpt2(model)
    return model


def demo_model_and_data(size: str) -> tuple[nn.Module, Any, Any]:
    """The demo job's model (examples/addition, its config's sizes for ``full``), datasets and collator."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from examples.addition.data import build_datasets
    from examples.addition.model import build_model

    torch.manual_seed(0)
    sizes = (
        dict(depth=4, width=64, heads=4, vocab_size=13, context=16)
        if size == "full"
        else dict(depth=2, width=32, heads=2, vocab_size=13, context=16)
    )
    train, evaluate = build_datasets(train_size=4096 if size == "full" else 256, eval_size=64, num_digits=2)
    return build_model(**sizes), train, evaluate


def llama_flops_per_token(model: nn.Module, seq: int) -> float:
    """:func:`flops_per_token` of a Llama-style model of ``tests/support/models`` (its config's sizes)."""
    cfg = model.config  # type: ignore[attr-defined]
    return flops_per_token(model, seq, layers=cfg.num_layers, hidden=cfg.hidden_size)


def _lm_loss(output: Any, labels: torch.Tensor) -> torch.Tensor:
    from tests.support.models import lm_loss

    return lm_loss(output, labels)


# ---------------------------------------------------------------------------- the Trainer


def _arguments(**overrides: Any) -> Any:
    from merak_core.config import TrainingArguments

    values: dict[str, Any] = dict(
        output_dir=tempfile.mkdtemp(prefix="merak-gpu-check-"),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=1,
        learning_rate=1e-3,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.01,
        max_grad_norm=1.0,
        logging_steps=1000,
        seed=3,
        dtype="float32",
    )
    values.update(overrides)
    return TrainingArguments(**values)


def _train(model: nn.Module, data: Any, device: str, **overrides: Any) -> tuple[Any, list[dict[str, float]]]:
    from merak_core import Trainer

    optimizer_factory = overrides.pop("optimizer_factory", None)
    args = _arguments(**overrides)
    trainer = Trainer(model, args, data, device=device, optimizer_factory=optimizer_factory)
    _prepare(trainer)
    return trainer, trainer.train()


def _prepare(trainer: Any) -> None:
    """No metrics files; the no-host-sync check of the quiet steps; ``trainer.device_step_s`` (the
    steps' synchronised times, :func:`_time_steps`)."""
    trainer.metrics.enabled = False
    _no_host_sync_in_quiet_steps(trainer)
    trainer.device_step_s = _time_steps(trainer)


def _no_host_sync_in_quiet_steps(trainer: Any) -> None:
    """On CUDA, every step that does not log runs under ``torch.cuda.set_sync_debug_mode("error")``: a
    hidden host synchronisation in the step raises. Only where the step is meant to read nothing (the
    default: fused AdamW and ``nonfinite: stop``, [Note: device-side skip] in merak_core.run.nonfinite);
    ``trainer.quiet_steps_checked`` counts the steps run so."""
    trainer.quiet_steps_checked = 0
    if trainer.device.type != "cuda" or trainer.engine.late_flags is None:
        return
    step_fn, every = trainer.engine.step, trainer.args.logging_steps
    total = trainer.num_training_steps()

    def step(*args: Any, **kwargs: Any) -> Any:
        n = kwargs["step"]
        if n % every == 0 or n in (1, total):
            return step_fn(*args, **kwargs)  # a logged step reads its numbers after it
        torch.cuda.set_sync_debug_mode("error")
        try:
            result = step_fn(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        trainer.quiet_steps_checked += 1
        return result

    trainer.engine.step = step


def _compare_losses(what: str, got: list[float], want: list[float], rtol: float) -> float:
    """Largest relative difference; raises when a step is outside ``rtol``."""
    worst = 0.0
    for step, (a, b) in enumerate(zip(got, want, strict=True), start=1):
        rel = abs(a - b) / max(abs(b), 1e-6)
        worst = max(worst, rel)
        if not rel <= rtol:
            raise AssertionError(
                f"{what}: step {step} loss {a:.6f} vs reference {b:.6f} (relative {rel:.3g} > "
                f"{rtol:g}); all: {got} vs {want}"
            )
    return worst


BF16_STEP_RTOL = 0.01
"""Any step's loss, bf16 autocast against float32: 1 % (about 2.5 bf16 unit round-offs); the mean over
the steps 0.25 % and the first step one unit round-off, 2**-8 (see [Note: bf16 tolerance] in
tests/e2e/test_bf16.py)."""


def _compare_bf16(what: str, got: list[float], want: list[float]) -> float:
    worst = _compare_losses(what, got, want, BF16_STEP_RTOL)
    rel = [abs(a - b) / abs(b) for a, b in zip(got, want, strict=True)]
    assert rel[0] <= 2**-8, f"{what}: first step differs by {rel[0]:.3g} (> 2**-8): {got[0]} vs {want[0]}"
    assert statistics.mean(rel) <= 0.0025, (
        f"{what}: mean relative difference {statistics.mean(rel):.3g} > 0.25 %"
    )
    assert got != want, f"{what}: bf16 and float32 losses are bit-identical: autocast did not run"
    return worst


def _close(what: str, got: torch.Tensor, want: torch.Tensor, rtol: float, atol: float) -> None:
    torch.testing.assert_close(
        got.detach().float().cpu(),
        want.detach().float().cpu(),
        rtol=rtol,
        atol=atol,
        msg=lambda m: f"{what}: {m}",
    )
