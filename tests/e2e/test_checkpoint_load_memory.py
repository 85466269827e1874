"""Loading a checkpoint holds at most this rank's share of it plus the largest tensor in host memory
(issue 25; [Note: bounded checkpoint loads] in ``merak_core.checkpoint.specs``).

Two ranks (dp=2, float32 AdamW, tp=1: every parameter replicated and whole, the case that staged the
whole model and its optimizer states in host memory before being copied): one step is saved, a new
Trainer resumes it, and the rank's peak resident memory during the load (``VmHWM`` after
``clear_refs``, over the resident size just before) is compared with the bytes of its share of the
checkpoint (its parameters and AdamW states) plus the largest tensor: 55-57 MiB against a bound of
76 MiB. Before, every whole tensor and state was staged in host memory first: 79 MiB, over the bound.
"""

from __future__ import annotations

import ctypes
import gc
import os

import pytest

from tests.e2e._trainer_support import TokenDataset, make_args
from tests.support.dist import run_on_ranks

pytestmark = pytest.mark.skipif(
    not os.path.exists("/proc/self/clear_refs"), reason="needs Linux's clear_refs"
)


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def _trainer(output_dir: str, max_steps: int):  # type: ignore[no-untyped-def]
    import torch

    from merak_core import Trainer
    from tests.support.models import GPT, REFERENCE_MODELS, DecoderConfig

    torch.manual_seed(0)
    cfg = DecoderConfig(
        vocab_size=1024, hidden_size=512, num_layers=2, num_heads=8, intermediate_size=2048, max_seq_len=16
    )
    args = make_args(output_dir=output_dir, max_steps=max_steps, save_steps=1, dtype="float32", dp=2)
    return Trainer(GPT(cfg), args, TokenDataset(16, cfg.vocab_size), loss_fn=REFERENCE_MODELS["gpt"].loss)


def _load_peak(output_dir: str) -> dict[str, float]:
    _trainer(output_dir, 1).train()  # saves step 1
    trainer = _trainer(output_dir, 2)
    params = {id(p): p for p in trainer.model.module.parameters()}.values()
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    largest = max(p.numel() * p.element_size() for p in params)
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # freed heap back to the kernel: the baseline is what is live
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak resident size to the current one
    before = _status_kib("VmRSS")
    step = trainer.resume("latest")
    peak = _status_kib("VmHWM")
    assert step == 1
    state_bytes = sum(
        t.numel() * t.element_size() for s in trainer.engine.optimizer.state.values() for t in s.values()
    )
    return {"increase": (peak - before) * 1024.0, "share": param_bytes + state_bytes, "largest": largest}


def test_a_resume_holds_at_most_its_share_and_the_largest_tensor(tmp_path) -> None:  # type: ignore[no-untyped-def]
    for rank, m in enumerate(run_on_ranks(2, _load_peak, str(tmp_path / "out"))):
        bound = m["share"] + m["largest"]
        print(
            f"rank {rank}: peak {m['increase'] / 2**20:.1f} MiB over the resident size, bound {bound / 2**20:.1f}"
        )
        assert m["increase"] <= bound, (rank, m)
