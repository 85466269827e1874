"""The GPU check of compiled stages (``training.compile``, [Note: compiled stages] in merak_core.parallel.compile).

:func:`compiled_stages` (a single-rank check of ``tests/gpu/checks.py``): the Trainer on ``device`` with
``compile: true`` and ``compile: regional`` against the eager Trainer, 5 steps of the Llama-style model
in float32 (TF32 off): every step's loss within float32 rounding of the compiled kernels (1e-4
relative); then the step time of ``compile: true`` against eager in bf16 (median after two
warm-up steps, the first of which compiles; the device synchronised after each step), as tokens/s,
MFU and the ratio.

On CUDA it compiles with ``inductor`` (the default); elsewhere (the CPU smoke run at ``tiny``) with
``eager`` (graph capture, no code generated: the cheapest), so only the logic is exercised there and
the ratio means nothing. Only a CUDA run's numbers are a GPU result.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from tests.gpu.common import (
    CountingDataset,
    _compare_losses,
    _median_step_s,
    _no_tf32,
    _train,
    build_llama,
    llama_config,
    llama_flops_per_token,
    throughput,
)


def compiled_stages(device: str, size: str) -> dict[str, Any]:
    """Compiled vs eager on ``device``: the losses of ``true`` and ``regional`` (float32), the step time (bf16)."""
    cuda = torch.device(device).type == "cuda"
    backend = "inductor" if cuda else "eager"  # CPU smoke run: graph capture only, the cheapest
    full = size == "full"
    _no_tf32()
    out: dict[str, Any] = {"backend": backend}
    seq = 128 if full else 8
    data = CountingDataset(64, llama_config(size, seq=seq).vocab_size, seq)
    model = build_llama(size, seq=seq)
    _, eager = _train(copy.deepcopy(model), data, device, max_steps=5, learning_rate=3e-4)
    for mode in (True, "regional"):
        _, compiled = _train(
            copy.deepcopy(model),
            data,
            device,
            max_steps=5,
            learning_rate=3e-4,
            compile=mode,
            compile_backend=backend,
        )
        out[f"loss_rel_diff_{mode}"] = _compare_losses(
            f"compile={mode!r} ({backend}) vs eager",
            [h["loss"] for h in compiled],
            [h["loss"] for h in eager],
            1e-4,
        )
    del model
    seq = 1024 if full else 16
    micro, steps = (8, 10) if full else (2, 4)
    data = CountingDataset(micro * steps, llama_config(size, seq=seq).vocab_size, seq)
    model = build_llama(size, seq=seq)
    kwargs: dict[str, Any] = dict(
        bf16=True,
        max_steps=steps,
        per_device_train_batch_size=micro,
        learning_rate=3e-4,
        compile_backend=backend,
    )
    flops = llama_flops_per_token(model, seq)
    eager, _ = _train(copy.deepcopy(model), data, device, **kwargs)
    compiled, _ = _train(model, data, device, compile=True, **kwargs)
    eager_s = _median_step_s(eager.device_step_s, warmup=2)
    compiled_s = _median_step_s(compiled.device_step_s, warmup=2)
    out.update(
        compile_step_s=compiled_s,
        eager_step_s=eager_s,
        compile_vs_eager=compiled_s / eager_s,
        compile_first_step_s=compiled.device_step_s[0],
    )
    for name, step_s in (("compile", compiled_s), ("eager", eager_s)):
        out.update(
            throughput(
                name,
                tokens_per_step=micro * seq,
                step_s=step_s,
                flops_per_token=flops,
                device=device,
                devices=1,
            )
        )
    return out
