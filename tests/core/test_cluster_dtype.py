"""A job is priced at the peak of the dtype it computes in (issue 24): pure, one process, meta device.

``training.bf16: true`` (bfloat16 autocast over float32 parameters) and ``training.dtype: bfloat16``
compute in bfloat16; the model a job file builds is float32 whatever it trains in, so the dtype
comes from the job, not from the model's parameters (which priced both at the fp32 peak).
"""

from __future__ import annotations

import pathlib

import pytest
import yaml

from merak_core.autoplan.cluster_job import job_model
from merak_core.cli import main
from merak_core.job import JobConfig
from merak_core.planner.cluster import compute_dtype, load_cluster, shipped_clusters
from merak_core.planner.cluster_cost import model_costs, stage_costs, trace_for_cluster

DEMO = str(pathlib.Path(__file__).resolve().parents[2] / "examples/addition/config.yaml")
PEAKS = {"bf16": 800.0, "fp32": 50.0}
"""TFLOP/s of the test cluster: bf16 16x fp32."""


@pytest.fixture(scope="module")
def cluster_file(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """The H100 file with the peaks above and a memory bandwidth so large that every operator is
    compute-bound: predicted compute time is then FLOPs over the dtype's peak alone."""
    raw = yaml.safe_load(shipped_clusters()["h100-sxm-8x"].read_text())
    raw["name"] = "peaks-test"
    raw["device"]["peak_tflops"] = dict(PEAKS)
    raw["device"]["memory_bandwidth_gb_s"] = 1e12
    raw["device"].pop("op_overhead_us", None)
    path = tmp_path_factory.mktemp("cluster") / "peaks.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _compute_s(overrides: list[str], cluster_path: pathlib.Path) -> tuple[str, float]:
    """(the job's priced dtype, one sample's forward seconds on one device of the whole model)."""
    cluster = load_cluster(str(cluster_path))
    jm = job_model(JobConfig.from_yaml(DEMO, overrides))
    costs = model_costs(
        trace_for_cluster(jm.model, jm.example_inputs, cluster, dtype=jm.dtype), jm.model, dtype=jm.dtype
    )
    stage = stage_costs(costs, cluster, bounds=[0, costs.num_layers], dp=1, tp=1, micro_batch_size=1)
    return jm.dtype, stage.forward_s[0]


@pytest.mark.parametrize(
    "overrides", [["training.bf16=true"], ["training.dtype=bfloat16"]], ids=["bf16", "dtype"]
)
def test_bf16_job_is_priced_at_the_bf16_peak(overrides: list[str], cluster_file: pathlib.Path) -> None:
    dtype, bf16_s = _compute_s(overrides, cluster_file)
    fp32_dtype, fp32_s = _compute_s([], cluster_file)
    assert (dtype, fp32_dtype) == ("bf16", "fp32")
    assert fp32_s / bf16_s == pytest.approx(PEAKS["bf16"] / PEAKS["fp32"], rel=1e-6)


def test_plan_header_names_the_job_dtype(
    capsys: pytest.CaptureFixture[str], cluster_file: pathlib.Path
) -> None:
    """`merak plan --cluster`: the header's rate and dtype are the job's (it said fp32 for bf16 jobs)."""
    sustained = PEAKS["bf16"] * load_cluster(str(cluster_file)).compute_efficiency
    for overrides, rate, dtype in (
        (["training.bf16=true"], sustained, "bf16"),
        (["training.dtype=bfloat16"], sustained, "bf16"),
        ([], PEAKS["fp32"] * load_cluster(str(cluster_file)).compute_efficiency, "fp32"),
    ):
        argv = ["plan", DEMO, *overrides, "--cluster", str(cluster_file), "--nodes", "1", "--top", "1"]
        assert main(argv) == 0
        assert f"at {rate:.1f} TFLOP/s sustained ({dtype})" in capsys.readouterr().out


def test_compute_dtype_of_a_job_and_a_dtype_without_a_peak() -> None:
    assert compute_dtype(dtype="float32", bf16=True) == "bf16"
    assert compute_dtype(dtype="bfloat16", bf16=False) == "bf16"
    assert compute_dtype(dtype="float32", bf16=False) == "fp32"
    with pytest.raises(
        ValueError, match=r"training.dtype='float64': a cluster description gives peaks for bf16"
    ):
        compute_dtype(dtype="float64", bf16=False)


def test_local_plan_profiles_the_job_as_it_trains(monkeypatch: pytest.MonkeyPatch) -> None:
    """`merak plan` without --cluster profiles in the job's dtype and under its autocast, as `layout: auto`
    does (it profiled every job in float32 without autocast)."""
    import merak_core.autoplan.auto as auto

    seen: list[tuple[object, bool]] = []

    def profile(model, batch, *, tp_plan, bf16=False, device=None, cache_dir=None):  # type: ignore[no-untyped-def]
        seen.append((next(model.parameters()).dtype, bf16))
        raise ValueError("profiled")

    monkeypatch.setattr(auto, "profile_for_plan", profile)
    import torch

    base = ["plan", DEMO, "data.kwargs.train_size=64", "--world-size", "2", "--memory-per-device", "1GiB"]
    for overrides, expected in (
        (["training.bf16=true"], (torch.float32, True)),
        (["training.dtype=bfloat16"], (torch.bfloat16, False)),
    ):
        assert main([*base[:2], *overrides, *base[2:]]) == 2
        assert seen.pop() == expected
