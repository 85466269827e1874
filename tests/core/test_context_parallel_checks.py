"""What training.cp > 1 refuses, by name and with the fix, before any process group; the batch split."""

from __future__ import annotations

import tempfile
from typing import Any

import pytest
import torch

from merak_core.parallel.context_parallel import check_cp_model
from tests.support.models import GPT, DecoderConfig, Llama


def _args(**kw: Any) -> Any:
    from merak_core import TrainingArguments

    return TrainingArguments(output_dir=tempfile.mkdtemp(prefix="merak-cpcheck-"), **kw)


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"cp": 0}, r"cp=0 is invalid: expected an integer >= 1"),
        (
            {"cp": 2, "cp_mode": "zigzag"},
            r"cp_mode='zigzag' is invalid: expected one of \('ring', 'ulysses'\)",
        ),
    ],
)
def test_arguments_refused(kw: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _args(**kw)


def test_job_file_key_is_checked_when_read() -> None:
    from merak_core import TrainingArguments

    args = TrainingArguments.from_dict({"output_dir": tempfile.mkdtemp(), "cp": 2, "cp_mode": "ulysses"})
    assert (args.cp, args.cp_mode) == (2, "ulysses")
    with pytest.raises(ValueError, match="cp_mode='zigzag' is invalid"):
        TrainingArguments.from_dict({"output_dir": tempfile.mkdtemp(), "cp": 2, "cp_mode": "zigzag"})
    for zero_stage in (2, 3):  # sharded over DP x CP (merak_core.parallel.fsdp [Note: ZeRO-2/3 at cp > 1])
        TrainingArguments.from_dict({"output_dir": tempfile.mkdtemp(), "cp": 2, "zero_stage": zero_stage})


def test_model_refusals() -> None:
    llama = Llama(DecoderConfig(num_layers=1, num_heads=4, num_kv_heads=2))
    check_cp_model(llama, _args(cp=2))  # the hook is declared: accepted
    with pytest.raises(
        ValueError, match=r"cp=2: GPT is neither a transformers model .*merak_tp.cp_attention"
    ):
        check_cp_model(GPT(DecoderConfig(num_layers=1)), _args(cp=2))
    from merak_core.lora import LoraConfig

    check_cp_model(llama, _args(cp=2), lora=LoraConfig(r=2))  # adapters are ordinary parameters: accepted
    with pytest.raises(ValueError, match=r"cp=2 with model.lora.dropout=0.1.*model.lora.dropout: 0.0"):
        check_cp_model(llama, _args(cp=2), lora=LoraConfig(r=2, dropout=0.1))
    with pytest.raises(ValueError, match=r"custom loss_fn.*drop loss_fn"):
        check_cp_model(llama, _args(cp=2), loss_fn_given=True)
    with pytest.raises(ValueError, match=r"cp=2 with compute_metrics.*drop compute_metrics"):
        check_cp_model(llama, _args(cp=2), compute_metrics_given=True)
    # 2 kv heads over tp=2 leave 1 per rank: ulysses at cp=2 cannot split it.
    with pytest.raises(
        ValueError, match=r"cp_mode='ulysses' with cp=2: .*2 query and 1 key/value heads per TP rank"
    ):
        check_cp_model(llama, _args(cp=2, tp=2, cp_mode="ulysses"))
    check_cp_model(llama, _args(cp=2, tp=2, cp_mode="ring"))
    check_cp_model(llama, _args(cp=2, pp=2))  # its hook is traced as leaf calls (tests/e2e)


class _Rank1Of2:
    """``split_batch`` as rank 1 of a cp=2 group does it, without a process group."""

    def __init__(self, mode: str, hf: bool) -> None:
        self.mode, self.hf = mode, hf

    def split(self, inputs: Any, labels: Any) -> tuple[Any, Any]:
        from merak_core.parallel.context_parallel import split_batch
        from merak_tp.context import shard_positions

        def positions(n: int) -> torch.Tensor:
            return shard_positions(n, 2, 1, balanced=self.mode == "ring")

        return split_batch(inputs, labels, positions, position_ids=self.hf)


def test_split_takes_this_ranks_tokens_and_refuses_padding() -> None:
    ids = torch.arange(32).reshape(2, 16)
    run = _Rank1Of2("ring", hf=True)
    inputs, labels = run.split({"input_ids": ids, "attention_mask": torch.ones_like(ids)}, ids + 100)
    assert inputs["input_ids"][0].tolist() == list(range(4, 12))
    assert inputs["position_ids"][1].tolist() == list(range(4, 12))
    assert "attention_mask" not in inputs and labels[0].tolist() == list(range(104, 112))
    inputs, _ = _Rank1Of2("ulysses", hf=False).split(ids, None)
    assert inputs[0].tolist() == list(range(8, 16))
    mask = torch.ones_like(ids)
    mask[0, -3:] = 0
    with pytest.raises(ValueError, match="padding attention_mask"):
        run.split({"input_ids": ids, "attention_mask": mask}, None)
    packed = torch.cat([torch.arange(8), torch.arange(8)]).expand(2, -1)
    with pytest.raises(ValueError, match="position_ids that restart"):
        run.split({"input_ids": ids, "position_ids": packed}, None)
    with pytest.raises(
        ValueError, match=r"sequence length 10 does not divide into 4 equal chunks .*multiple of 4"
    ):
        run.split(torch.zeros(2, 10, dtype=torch.long), None)
