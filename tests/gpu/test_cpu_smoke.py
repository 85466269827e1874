"""The GPU checks' bodies at tiny sizes on CPU ranks of the gloo pool (``tests/gpu/checks.py``).

They run in the normal suite so that the logic of every GPU check (the references, the
comparisons, the throughput and MFU arithmetic) is exercised on machines without a GPU; the
``gpu``-marked tests run the same bodies at full size on CUDA.
"""

from __future__ import annotations

import argparse

import pytest
import torch

from tests.gpu import checks, common, multi, run
from tests.gpu.zero_check import multi_zero
from tests.support.dist import run_on_ranks


@pytest.mark.parametrize("name", sorted(checks.SINGLE_CHECKS))
def test_single_rank_check_on_cpu(name: str) -> None:
    (result,) = run_on_ranks(1, checks.SINGLE_CHECKS[name], "cpu", "tiny", timeout_s=600)
    assert result


def test_throughput_numbers_on_cpu() -> None:
    (result,) = run_on_ranks(1, checks.llama_throughput, "cpu", "tiny")
    assert result["llama_tokens_per_s"] > 0 and result["llama_mfu"] is None


@pytest.mark.parametrize(
    ("world", "degrees", "schedule"), [(2, (2, 4), "1f1b"), (4, (4,), "zb_h1"), (2, (2,), "zb_v")]
)
def test_pipeline_check_on_cpu(world: int, degrees: tuple[int, ...], schedule: str) -> None:
    results = run_on_ranks(
        world, multi.multi_pipeline, "cpu", "tiny", degrees=degrees, schedules=(schedule,), timeout_s=600
    )
    pp = degrees[0]
    assert f"pp{pp}_{schedule}" in results[0]
    assert results[0][f"pp{pp}_{schedule}_cpu_first_rel_diff"] <= 1e-4  # rank 0 only
    assert results[0][f"pp{pp}_{schedule}_tokens_per_s"] > 0 and results[0][f"pp{pp}_{schedule}_mfu"] is None
    # pp=4 at world 2 is skipped, and says why
    assert results[0]["skipped"] == [
        f"pp={d}: needs a multiple of {d} ranks, the world has {world}" for d in degrees[1:]
    ]


def test_tp_overlap_check_on_cpu() -> None:
    results = run_on_ranks(2, multi.multi_tp_overlap, "cpu", "tiny")
    assert set(results[0]["tp2_speedup"]) == {2, 4}
    assert all(results[0][f"tp2_chunks{c}_tokens_per_s"] > 0 for c in (1, 2, 4))
    assert results[0]["tp2_fp32_max_abs_diff"] <= 1e-5  # against one CPU process
    assert results[0]["skipped"] == [
        "tp=4: needs a multiple of 4 ranks, the world has 2",
        "tp=8: needs a multiple of 8 ranks, the world has 2",
    ]


def test_zero_check_on_cpu() -> None:
    """ZeRO-1/2/3 at dp=2 against one CPU process: float32 losses and norms, bf16 losses; throughput."""
    results = run_on_ranks(2, multi_zero, "cpu", "tiny", timeout_s=600)
    head = results[0]
    for stage in (1, 2, 3):
        assert head[f"zero{stage}_loss_rel_diff"] <= 1e-4 and head[f"zero{stage}_norm_rel_diff"] <= 1e-4
        assert head[f"zero{stage}_tokens_per_s"] > 0 and head[f"zero{stage}_mfu"] is None
        assert results[1][f"zero{stage}_losses"] == head[f"zero{stage}_losses"]
    assert "reference_losses" not in results[1]  # rank 0 alone computes the reference


@pytest.mark.world8
def test_3d_check_on_cpu() -> None:
    results = run_on_ranks(8, multi.multi_3d, "cpu", "tiny", timeout_s=600)
    assert results[0]["worst_rel_diff"] <= 1e-4
    assert results[0]["demo_3d_tokens_per_s"] > 0 and results[0]["demo_3d_mfu"] is None


def test_peak_table() -> None:
    assert checks.peak_bf16_flops("NVIDIA H200") == 989e12
    assert checks.peak_bf16_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert checks.peak_bf16_flops("NVIDIA H100 PCIe") == 756e12
    assert checks.peak_bf16_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert checks.peak_bf16_flops("NVIDIA L4") == 121e12
    assert checks.peak_bf16_flops("Some Future GPU") is None


def test_mfu_arithmetic() -> None:
    # 1000 tokens/s x 6e9 FLOP/token = 6e12 FLOP/s: all of 2 devices of 3e12 each
    assert common.mfu(1000.0, 6e9, 3e12, 2) == pytest.approx(1.0)
    assert common.mfu(1000.0, 6e9, 989e12, 8) == pytest.approx(6e12 / (8 * 989e12))
    assert common.mfu(1000.0, 6e9, None, 2) is None
    assert common.throughput(
        "x", tokens_per_step=64, step_s=0.5, flops_per_token=1.0, device="cpu", devices=1
    ) == {"x_tokens_per_s": 128.0, "x_mfu": None}


def test_flops_per_token_counts_every_matmul_weight() -> None:
    from tests.support.models import Llama

    model = Llama(common.llama_config("tiny", seq=8))
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    cfg = model.config
    assert linear > 0 and cfg.vocab_size * cfg.hidden_size <= linear  # the output head is one of them
    assert common.llama_flops_per_token(model, 8) == 6 * linear + 6 * cfg.num_layers * 8 * cfg.hidden_size


def test_multi_checks_skipped_for_lack_of_devices_say_why(capsys: pytest.CaptureFixture[str]) -> None:
    args = argparse.Namespace(
        only="multi_3d,multi_zero", nproc=1, device="cpu", size="tiny", threads=1,
        single_budget_s=10.0, multi_budget_s=10.0,
    )  # fmt: skip
    report = run.run(args)
    by_name = {r["check"]: r for r in report["checks"]}
    assert by_name["multi_3d"]["status"] == by_name["multi_zero"]["status"] == "skipped"
    assert by_name["multi_3d"]["error"] == "needs 8 devices, this machine has 1"
    assert by_name["multi_zero"]["error"] == "needs 2 devices, this machine has 1"
    printed = capsys.readouterr().out
    assert "[gpu check] multi_3d: skipped: needs 8 devices, this machine has 1" in printed
    assert "- multi_zero: needs 2 devices, this machine has 1" in run.markdown(report)
