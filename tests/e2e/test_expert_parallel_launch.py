"""``merak train`` refuses a job at training.ep > 1 that the ranks would refuse, before torchrun (one line, exit 2);
and the dry run shows each rank's EP and expert-replica groups."""

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
from tests.support.moe import MoEConfig, MoELlama

HERE = "tests.e2e.test_expert_parallel_launch"


def build_moe() -> torch.nn.Module:
    return MoELlama(MoEConfig(num_layers=1))


def build_dense() -> torch.nn.Module:
    return Llama(DecoderConfig(num_layers=1, num_heads=4, num_kv_heads=2))


class _Tokens(Dataset):
    def __init__(self) -> None:
        self.ids = torch.randint(0, 90, (16, 9), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i, :-1], "labels": self.ids[i, 1:]}


def tokens() -> Any:
    return _Tokens()


def _dry_run(tmp: Path, model: str, training: dict[str, Any]) -> tuple[int, str]:
    job = tmp / "job.yaml"
    training = {
        "output_dir": str(tmp / "out"),
        "per_device_train_batch_size": 2,
        "max_steps": 1,
        **training,
    }
    spec = {
        "model": {"factory": f"{HERE}:{model}"},
        "data": {"factory": f"{HERE}:tokens"},
        "training": training,
    }
    job.write_text(yaml.safe_dump(spec))
    return dry_run_train(job, "--nproc-per-node", "2")


@pytest.mark.parametrize(
    ("model", "training", "words"),
    [
        ("build_dense", {"ep": 2}, ("ep=2 but Llama has no mixture-of-experts block", "Set ep: 1")),
        (
            "build_moe",
            {"ep": 2, "dp": 1, "pp": 2, "gradient_accumulation_steps": 2},
            ("ep=2 does not divide dp=1",),
        ),
    ],
)
def test_refused_before_torchrun(
    tmp_path: Path, model: str, training: dict[str, Any], words: tuple[str, ...]
) -> None:
    status, err = _dry_run(tmp_path, model, training)
    assert status == BAD_INPUT, err
    assert len(err.strip().splitlines()) == 1, err
    for w in words:
        assert w in err, (w, err)


@pytest.mark.parametrize("zero_stage", [0, 3])
def test_good_ep_job_passes_the_checks(tmp_path: Path, zero_stage: int) -> None:
    """ep=2 alone and with ZeRO-3 (experts sharded over their replica group: refused before)."""
    status, err = _dry_run(tmp_path, "build_moe", {"ep": 2, "zero_stage": zero_stage})
    assert status == 0, err


def test_dry_run_shows_ep_groups() -> None:
    from merak_core.parallel.rank_grid import rank_of
    from merak_core.planner.cluster import load_cluster
    from merak_core.planner.dryrun import dry_run
    from merak_core.planner.gpt_shapes import DecoderShape, build_decoder, decoder_inputs

    shape = DecoderShape(num_layers=4, hidden=64, num_heads=4, vocab_size=128, seq_len=16)
    report = dry_run(
        build_decoder(shape), decoder_inputs(shape), load_cluster("h100-sxm-8x"), world_size=16, tp=2, pp=2,
        num_microbatches=4, num_heads=4, vocab_size=128, ep=2,
    )  # fmt: skip
    assert report.ok, report.summary()
    assert "ep=2 (of dp)" in report.summary() and "ep_rank" in report.summary()
    for p in report.ranks:
        first = p.dp_rank - p.dp_rank % 2
        assert p.ep_rank == p.dp_rank % 2
        assert p.ep_group == tuple(rank_of(p.stage, first + j, p.tp_rank, dp=4, tp=2) for j in range(2))
        assert p.expert_replica_group == tuple(
            rank_of(p.stage, b * 2 + p.ep_rank, p.tp_rank, dp=4, tp=2) for b in range(2)
        )
        assert p.rank in p.ep_group and p.rank in p.expert_replica_group
    bad = dry_run(
        build_decoder(shape), decoder_inputs(shape), load_cluster("h100-sxm-8x"), world_size=12, tp=2, pp=2,
        num_microbatches=4, num_heads=4, vocab_size=128, ep=2,
    )  # fmt: skip
    assert bad.first_failure is not None and "ep=2 does not divide dp=3" in bad.first_failure.message


@pytest.mark.slow
def test_merak_train_runs_an_ep_job_under_torchrun(tmp_path: Path) -> None:
    """The ranks' own set-up builds the layout with training.ep (it built ep=1 and refused the job); the
    first step's loss is one process's on the whole first batch (the loader's order at seed 0)."""
    import subprocess
    import sys

    from tests.e2e._fault_support import job_env

    training = {
        "output_dir": str(tmp_path / "out"),
        "per_device_train_batch_size": 8,
        "max_steps": 1,
        "ep": 2,
        "dtype": "float64",
        "logging_steps": 1,
        "seed": 0,
    }
    spec = {
        "model": {"factory": f"{HERE}:build_moe"},
        "data": {"factory": f"{HERE}:tokens"},
        "training": training,
    }
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(spec))
    proc = subprocess.run(
        [sys.executable, "-m", "merak_core.cli", "train", str(job), "--nproc-per-node", "2"],
        env=job_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    torch.manual_seed(0)
    model = build_moe().double()
    ids = _Tokens().ids  # 16 samples: the global batch of 2 ranks x 8
    with torch.no_grad():
        logits = model(ids[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1))
    assert f"loss {float(loss):.4f}" in proc.stdout + proc.stderr, (float(loss), proc.stdout[-2000:])
