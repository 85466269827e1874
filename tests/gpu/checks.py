"""The GPU checks, written once for any device: each takes ``device`` and ``size`` and asserts.

``size="full"`` is the GPU run (``nox -s gpu``, through ``tests/gpu/main.py`` in a subprocess per
check); ``size="tiny"`` is the CPU smoke version that the normal suite runs in the gloo worker pool
(``tests/gpu/test_cpu_smoke.py``), so the logic of every check is exercised on machines without a
GPU. A check returns a small dict of numbers (printed by the GPU session).

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

Multi-rank checks (every rank calls them; the GPU session runs them under torchrun):

- :func:`multi_pipeline` — the Trainer at pp = 2 and 4 with every schedule, the virtual-stage ones at
  ``virtual_stages=2`` (``full``: boundaries of
  16 MiB) against the single-device reference steps;
- :func:`multi_tp_overlap` — TP at 2/4/8 with ``overlap_chunks`` 1, 2, 4: the same outputs, and the
  sub-pipelined speedup (``full``: a Llama block at hidden 4096);
- :func:`multi_3d` — the demo job at dp=2 tp=2 pp=2 against the single-device reference losses.
"""

from __future__ import annotations

import copy
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
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
    """Training FLOPs per token: 6 per weight (input embedding excluded) plus causal attention's 6 * L * T * h."""
    cfg = model.config  # type: ignore[attr-defined]
    weights = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("embed_tokens"))
    return 6.0 * weights + 6.0 * cfg.num_layers * seq * cfg.hidden_size


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
    trainer.metrics.enabled = False
    _no_host_sync_in_quiet_steps(trainer)
    return trainer, trainer.train()


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
    """Tokens/s and MFU of the Trainer in bf16 at world 1 (median step after two warm-up steps)."""
    seq = 1024 if size == "full" else 16
    micro = 8 if size == "full" else 2
    steps = 10 if size == "full" else 3
    model = build_llama(size, seq=seq)
    flops_per_token = llama_flops_per_token(model, seq)
    params = sum(p.numel() for p in model.parameters())
    data = CountingDataset(micro * steps, model.config.vocab_size, seq)  # type: ignore[attr-defined]
    trainer, history = _train(
        model, data, device, bf16=True, max_steps=steps, per_device_train_batch_size=micro, learning_rate=3e-4
    )
    step_s = statistics.median(h["step_time_s"] for h in history[2:])
    tokens_per_s = micro * seq / step_s
    dev = torch.device(device)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    peak = peak_bf16_flops(name) if dev.type == "cuda" else None
    mfu = tokens_per_s * flops_per_token / peak if peak else None
    return {
        "llama_params": params,
        "llama_tokens_per_step": micro * seq,
        "llama_step_s": step_s,
        "llama_tokens_per_s": tokens_per_s,
        "llama_mfu": mfu,
        "device_name": name,
        "peak_bf16_flops": peak,
        "peak_memory_gib": (torch.cuda.max_memory_allocated(dev) / 2**30) if dev.type == "cuda" else None,
        "steps_without_host_sync": trainer.quiet_steps_checked,  # set_sync_debug_mode("error") around them
    }


# ---------------------------------------------------------------------------- pipeline on one rank


def _close(what: str, got: torch.Tensor, want: torch.Tensor, rtol: float, atol: float) -> None:
    torch.testing.assert_close(
        got.detach().float().cpu(),
        want.detach().float().cpu(),
        rtol=rtol,
        atol=atol,
        msg=lambda m: f"{what}: {m}",
    )


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


# ---------------------------------------------------------------------------- several ranks


def _reference_losses(model: nn.Module, data: Any, args: Any, dp: int, device: torch.device) -> list[float]:
    from tests.e2e._trainer_support import reference_steps

    model = model.to(device)

    def microbatch_loss(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return _lm_loss(model(batch["input_ids"].to(device)), batch["labels"].to(device))

    return reference_steps(model, data, args, dp, microbatch_loss)


ALL_SCHEDULES = ("gpipe", "1f1b", "zb_h1", "shifted_critical_path", "interleaved_1f1b", "zb_v")
VIRTUAL_SCHEDULES = ("interleaved_1f1b", "zb_v")
"""Schedules run with two stages per pipeline rank (``virtual_stages=2``)."""


def multi_pipeline(
    device: str, size: str, *, degrees: tuple[int, ...] = (2, 4), schedules: tuple[str, ...] = ALL_SCHEDULES
) -> dict[str, Any]:
    """Trainer at pp = 2 and 4 (dp = world / pp) with every schedule against the reference steps.

    ``degrees`` / ``schedules`` narrow it (the CPU smoke runs one schedule per degree)."""
    from merak_core import Trainer

    _no_tf32()
    world = dist.get_world_size()
    dev = torch.device(device)
    seq, hidden = (1024, 2048) if size == "full" else (8, 32)
    micro = 2
    out: dict[str, Any] = {}
    for pp in degrees:
        if pp > world or world % pp:
            continue
        for schedule in schedules:
            from tests.support.models import DecoderConfig, Llama

            virtual = 2 if schedule in VIRTUAL_SCHEDULES else 1
            torch.manual_seed(0)
            cfg = (
                DecoderConfig(
                    vocab_size=32000,
                    hidden_size=hidden,
                    num_layers=4 * virtual,
                    num_heads=16,
                    num_kv_heads=4,
                    intermediate_size=5504,
                    max_seq_len=seq,
                )
                if size == "full"
                else DecoderConfig(
                    vocab_size=96,
                    hidden_size=hidden,
                    num_layers=4 * virtual,
                    num_heads=4,
                    num_kv_heads=2,
                    intermediate_size=64,
                    max_seq_len=seq,
                )
            )
            model = Llama(cfg)
            ref_model = copy.deepcopy(model) if dist.get_rank() == 0 else None
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
            trainer.metrics.enabled = False
            losses = [h["loss"] for h in trainer.train()]
            boundary = micro * seq * hidden * 4
            del trainer, model
            if ref_model is not None:
                want = _reference_losses(ref_model, data, args, world // pp, dev)
                _compare_losses(f"pp={pp} {schedule}", losses, want, 1e-4)
                del ref_model
            out[f"pp{pp}_{schedule}"] = losses
            out["boundary_mib"] = boundary / 2**20
            if dev.type == "cuda":
                torch.cuda.empty_cache()
            dist.barrier()
    return out


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


def multi_tp_overlap(device: str, size: str) -> dict[str, Any]:
    """TP at 2/4/8 over consecutive ranks, overlap_chunks 1/2/4: same outputs; speedup over chunks=1."""
    import merak_tp
    import tests.support.tp_plans  # noqa: F401 - registers the test models' plans
    from tests.support.models import DecoderConfig, Llama

    _no_tf32()
    world, rank = dist.get_world_size(), dist.get_rank()
    dev = torch.device(device)
    hidden, seq, batch = (4096, 1024, 8) if size == "full" else (32, 8, 8)
    out: dict[str, Any] = {}
    for tp in (2, 4, 8):
        if tp > world or world % tp:
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
        x = torch.randint(0, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(1)).to(dev)
        times: dict[int, float] = {}
        outputs: dict[int, torch.Tensor] = {}
        for chunks in (1, 2, 4):
            model = merak_tp.parallelize(copy.deepcopy(base), None, group=group, overlap_chunks=chunks).to(
                dev
            )
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=size == "full"):
                outputs[chunks] = model(x).detach().float()
                times[chunks] = _time_fwd_bwd(model, x, 10 if size == "full" else 2)
            del model
        for chunks in (2, 4):
            tol = (5e-2, 5e-2) if size == "full" else (1e-5, 1e-6)
            _close(f"tp={tp} chunks={chunks} output", outputs[chunks], outputs[1], *tol)
        slowest = torch.tensor([times[c] for c in (1, 2, 4)], dtype=torch.float64, device=dev)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        t1, t2, t4 = (float(v) for v in slowest)
        out[f"tp{tp}_step_ms"] = {1: t1 * 1e3, 2: t2 * 1e3, 4: t4 * 1e3}
        out[f"tp{tp}_speedup"] = {2: t1 / t2, 4: t1 / t4}
        for g in groups:
            dist.destroy_process_group(g)
    return out


def multi_3d(device: str, size: str) -> dict[str, Any]:
    """The demo job at dp = world / 4, tp = 2, pp = 2 against the single-device reference losses."""
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
    trainer = Trainer(model, args, train)
    trainer.metrics.enabled = False
    losses = [h["loss"] for h in trainer.train()]
    out: dict[str, Any] = {"losses_3d": losses}
    if ref_model is not None:
        from merak_core.trainer import default_loss

        ref_model = ref_model.to(device)

        def microbatch_loss(batch: dict[str, torch.Tensor]) -> torch.Tensor:
            return default_loss(ref_model(batch["input_ids"].to(device)), batch["labels"].to(device))

        from tests.e2e._trainer_support import reference_steps

        want = reference_steps(ref_model, train, args, world // 4, microbatch_loss)
        # float32 over 20 steps: summation orders differ (TP, DP, microbatches) and Adam amplifies them a little.
        out["worst_rel_diff"] = _compare_losses(
            "2x2x2 demo vs single device", losses, want, 2e-3 if size == "full" else 1e-4
        )
    return out


MULTI_CHECKS = {"multi_pipeline": multi_pipeline, "multi_tp_overlap": multi_tp_overlap, "multi_3d": multi_3d}
