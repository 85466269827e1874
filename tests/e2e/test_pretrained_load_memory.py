"""Starting from a Hugging Face folder at ZeRO-3 holds at most this rank's share plus the largest tensor
(issue 25 item 6; [Note: bounded checkpoint loads] in ``merak_core.checkpoint.regions``).

Two ranks, dp=2, ZeRO-3, float32: a Llama saved with ``save_pretrained`` (2 layers, width 512, vocabulary
2048: 32 MiB, the largest tensor 4 MiB) becomes a Trainer's model (``Trainer(None, ..., pretrained=folder)``). The
rank's peak resident memory while the Trainer is built (``VmHWM`` after ``clear_refs``, over the resident
size just before; a tiny Llama's Trainer is built first, unmeasured, for the imports and the first
trace) is compared with its share (its parameters as it holds them: half the rows of each) plus the
largest tensor of the folder plus the 6 MiB slack of ``test_checkpoint_load_memory``. Each rank's
parameters must also equal the folder's tensors (gathered, bit for bit).

Before the weights were read into the ZeRO-3 shards, every rank read its whole stage (here the whole
model) into plain parameters, which FSDP2 then cut: 50 MiB against a 26 MiB bound; after, 20-22 MiB
(load average 14-15 on 2 cores).
"""

from __future__ import annotations

import ctypes
import gc
import os
from pathlib import Path
from typing import Any

import pytest

from tests.e2e._trainer_support import TokenDataset, make_args
from tests.e2e.test_checkpoint_load_memory import _status_kib
from tests.support.dist import run_on_ranks

pytestmark = pytest.mark.skipif(
    not os.path.exists("/proc/self/clear_refs"), reason="needs Linux's clear_refs"
)

SLACK = 6 * 2**20
"""As ``test_checkpoint_load_memory.SLACK``: allocator rounding and the worker's resident noise."""
VOCAB = 2048


def _save_llama(out: Path, **fields: Any) -> Path:
    import torch
    import transformers as tf

    from tests.support.hf_models import tiny_decoder_fields

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(**tiny_decoder_fields(VOCAB, use_cache=False, **fields))
    tf.LlamaForCausalLM(cfg).float().save_pretrained(str(out))
    return out


def _trainer(folder: str, output_dir: str) -> Any:
    from merak_core import Trainer
    from tests.e2e.test_transformers import lm_loss

    args = make_args(output_dir=output_dir, dtype="float32", dp=2, zero_stage=3)
    return Trainer(None, args, TokenDataset(16, VOCAB), loss_fn=lm_loss, pretrained=folder)


def _build_peak(warm_folder: str, folder: str, output_dir: str) -> dict[str, Any]:
    import torch

    from merak_core.parallel.fsdp import local_tensor
    from tests.e2e._pretrained_support import read_folder

    warm = _trainer(warm_folder, output_dir)  # imports, the first trace: not measured
    del warm
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # freed heap back to the kernel: the baseline is what is live
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak resident size to the current one
    before = _status_kib("VmRSS")
    trainer = _trainer(folder, output_dir)
    peak = _status_kib("VmHWM")
    params = list(trainer.model.named_parameters())
    share = sum(local_tensor(p).numel() * p.element_size() for _, p in params)
    stored = read_folder(folder)
    largest = max(t.numel() * t.element_size() for t in stored.values())
    unequal = [name for name, p in params if not torch.equal(p.full_tensor(), stored[name])]
    return {"increase": (peak - before) * 1024.0, "share": share, "largest": largest, "unequal": unequal}


def test_a_zero3_start_from_a_folder_holds_at_most_its_share_and_the_largest_tensor(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    warm = _save_llama(tmp_path / "tiny")
    folder = _save_llama(
        tmp_path / "llama",
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,
    )
    results = run_on_ranks(2, _build_peak, str(warm), str(folder), str(tmp_path / "out"))
    bounds = [m["share"] + m["largest"] + SLACK for m in results]
    for rank, (m, bound) in enumerate(zip(results, bounds, strict=True)):
        print(
            f"zero3 pretrained rank {rank}: peak {m['increase'] / 2**20:.1f} MiB over the resident size, "
            f"bound {bound / 2**20:.1f} (share {m['share'] / 2**20:.1f}, largest {m['largest'] / 2**20:.1f})"
        )
    for rank, (m, bound) in enumerate(zip(results, bounds, strict=True)):
        assert not m["unequal"], (rank, m["unequal"])
        assert m["increase"] <= bound, (rank, m)
