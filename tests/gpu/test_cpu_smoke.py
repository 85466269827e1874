"""The GPU checks' bodies at tiny sizes on CPU ranks of the gloo pool (``tests/gpu/checks.py``).

They run in the normal suite so that the logic of every GPU check (the references, the
comparisons, the throughput and MFU arithmetic) is exercised on machines without a GPU; the
``gpu``-marked tests run the same bodies at full size on CUDA.
"""

from __future__ import annotations

import pytest

from tests.gpu import checks
from tests.support.dist import run_on_ranks


@pytest.mark.parametrize("name", sorted(checks.SINGLE_CHECKS))
def test_single_rank_check_on_cpu(name: str) -> None:
    (result,) = run_on_ranks(1, checks.SINGLE_CHECKS[name], "cpu", "tiny", timeout_s=600)
    assert result


def test_throughput_numbers_on_cpu() -> None:
    (result,) = run_on_ranks(1, checks.llama_throughput, "cpu", "tiny")
    assert result["llama_tokens_per_s"] > 0 and result["llama_mfu"] is None


@pytest.mark.parametrize(("world", "pp", "schedule"), [(2, 2, "1f1b"), (4, 4, "zb_h1"), (2, 2, "zb_v")])
def test_pipeline_check_on_cpu(world: int, pp: int, schedule: str) -> None:
    results = run_on_ranks(
        world, checks.multi_pipeline, "cpu", "tiny", degrees=(pp,), schedules=(schedule,), timeout_s=600
    )
    assert f"pp{pp}_{schedule}" in results[0]


def test_tp_overlap_check_on_cpu() -> None:
    results = run_on_ranks(2, checks.multi_tp_overlap, "cpu", "tiny")
    assert set(results[0]["tp2_speedup"]) == {2, 4}


@pytest.mark.world8
def test_3d_check_on_cpu() -> None:
    results = run_on_ranks(8, checks.multi_3d, "cpu", "tiny", timeout_s=600)
    assert results[0]["worst_rel_diff"] <= 1e-4


def test_peak_table() -> None:
    assert checks.peak_bf16_flops("NVIDIA H200") == 989e12
    assert checks.peak_bf16_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert checks.peak_bf16_flops("NVIDIA H100 PCIe") == 756e12
    assert checks.peak_bf16_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert checks.peak_bf16_flops("NVIDIA L4") == 121e12
    assert checks.peak_bf16_flops("Some Future GPU") is None
