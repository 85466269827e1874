"""``merak train`` refuses a job at training.cp > 1 that the ranks would refuse, before torchrun (one line, exit 2)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from torch.utils.data import Dataset

from merak_core.run.exitcodes import BAD_INPUT
from tests.e2e._bad_input_support import dry_run_train
from tests.support.models import DecoderConfig, Llama

HERE = "tests.e2e.test_context_parallel_launch"


def build_llama() -> torch.nn.Module:
    """The reference Llama, which calls merak_tp's cp hook."""
    return Llama(DecoderConfig(num_layers=1, num_heads=4, num_kv_heads=2))


def build_hf_llama() -> torch.nn.Module:
    """A tiny transformers Llama (its attention is routed through transformers' registry)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=96,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        use_cache=False,
    )
    return LlamaForCausalLM(cfg)


class _Tokens(Dataset):
    def __init__(self, seq: int, padded: bool, mask: bool) -> None:
        self.ids = torch.randint(0, 90, (16, seq + 1), generator=torch.Generator().manual_seed(0))
        self.padded, self.mask = padded, mask

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        mask = torch.ones(self.ids.shape[1] - 1, dtype=torch.long)
        if self.padded:
            mask[-2:] = 0
        if not self.mask:
            return {"input_ids": self.ids[i, :-1], "labels": self.ids[i, 1:]}
        return {"input_ids": self.ids[i, :-1], "attention_mask": mask, "labels": self.ids[i, 1:]}


def tokens(seq: int = 16, padded: bool = False, mask: bool = False) -> Any:
    return _Tokens(seq, padded, mask)


def tokens_and_eval(padded_eval: bool = False) -> Any:
    """(train, eval): the eval samples padded (an attention mask with zeros) when asked."""
    return _Tokens(16, False, True), _Tokens(16, padded_eval, True)


def token_accuracy(output: Any, labels: torch.Tensor) -> torch.Tensor:
    """A per-example metric (refused at cp > 1)."""
    return (output.logits.argmax(-1) == labels).double().mean(-1)


def _dry_run(
    tmp: Path, model: dict[str, Any], data: dict[str, Any], training: dict[str, Any], **sections: Any
) -> tuple[int, str]:
    job = tmp / "job.yaml"
    training = {
        "output_dir": str(tmp / "out"),
        "dp": 1,
        "per_device_train_batch_size": 2,
        "max_steps": 1,
        **training,
    }
    job.write_text(yaml.safe_dump({"model": model, "data": data, "training": training, **sections}))
    return dry_run_train(job, "--nproc-per-node", "2")


LLAMA = {"factory": f"{HERE}:build_llama"}
HF_LLAMA = {"factory": f"{HERE}:build_hf_llama"}
GOOD = {"factory": f"{HERE}:tokens"}
MASKED = {"factory": f"{HERE}:tokens", "kwargs": {"mask": True}}


@pytest.mark.parametrize(
    ("model", "data", "training", "words"),
    [
        (
            {"factory": "tests.e2e._bad_input_jobs:build_lm"},
            {"factory": "tests.e2e._bad_input_jobs:data", "kwargs": {"kind": "dict"}},
            {"cp": 2},
            ("cp=2:", "neither a transformers model", "merak_tp.cp_attention"),
        ),
        (LLAMA, {**GOOD, "kwargs": {"seq": 10}}, {"cp": 2}, ("sequence length 10 does not divide into 4",)),
        (
            HF_LLAMA,
            {**GOOD, "kwargs": {"padded": True, "mask": True}},
            {"cp": 2},
            ("padding attention_mask",),
        ),
    ],
)
def test_refused_before_torchrun(
    tmp_path: Path,
    model: dict[str, Any],
    data: dict[str, Any],
    training: dict[str, Any],
    words: tuple[str, ...],
) -> None:
    status, err = _dry_run(tmp_path, model, data, training)
    assert status == BAD_INPUT, err
    for w in words:
        assert w in err, (w, err)


def test_eval_set_checked_at_cp(tmp_path: Path) -> None:
    """An evaluation set at cp > 1: its first batch is split-checked as the training one; metrics are refused."""
    with_eval = {"factory": f"{HERE}:tokens_and_eval"}
    status, err = _dry_run(tmp_path, HF_LLAMA, {**with_eval, "kwargs": {"padded_eval": True}}, {"cp": 2})
    assert status == BAD_INPUT and "the first evaluation batch" in err and "padding attention_mask" in err, (
        err
    )
    status, err = _dry_run(tmp_path, HF_LLAMA, with_eval, {"cp": 2}, metrics=f"{HERE}:token_accuracy")
    assert status == BAD_INPUT and "cp=2 with compute_metrics" in err, err
    status, err = _dry_run(tmp_path, HF_LLAMA, with_eval, {"cp": 2, "cp_mode": "ulysses"})
    assert status == 0, err


@pytest.mark.parametrize(("model", "data"), [(LLAMA, GOOD), (HF_LLAMA, MASKED)])
def test_good_cp_job_passes_the_checks(tmp_path: Path, model: dict[str, Any], data: dict[str, Any]) -> None:
    status, err = _dry_run(tmp_path, model, data, {"cp": 2, "cp_mode": "ulysses"})
    assert status == 0, err
