"""The planner's price of context parallelism (merak_core.planner.context_cost): exact terms, and the search.

Pure: a hand-written profile and communication model, every expected number computed here from the
documented formulas (one cp rank's share of the profile, the ring's passes overlapped with its
blocks, Ulysses' two all-to-alls, the gradient all-reduce over dp x cp).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
from torch import nn

from merak_core.config.layout_choice import LayoutChoice
from merak_core.planner import CommModel, ModelProfile, plan, predict
from merak_core.planner.context_cost import (
    cp_allowed,
    cp_attention_extra_bytes,
    cp_layer_comm_s,
    cp_local_profile,
    runnable_cp,
)
from merak_core.planner.memory import usable_memory

DEMO = str(Path(__file__).resolve().parents[2] / "examples" / "addition" / "config.yaml")
LAYERS = 4
BOUNDARY = 4096.0
ACT = 40960.0


def _profile(**overrides: object) -> ModelProfile:
    values: dict[str, object] = dict(
        layer_forward_s=[1e-3] * LAYERS,
        layer_backward_s=[2e-3] * LAYERS,
        layer_activation_bytes=[ACT] * LAYERS,
        layer_param_bytes=[1000.0] * LAYERS,
        boundary_bytes=BOUNDARY,
        num_heads=8,
        num_kv_heads=2,
        vocab_size=64,
    )
    values.update(overrides)
    return ModelProfile(**values)  # type: ignore[arg-type]


COMM = CommModel(p2p_latency_s=1e-5, p2p_bandwidth=1e6, allreduce_latency_s=2e-5, allreduce_bandwidth=1e7)


def test_local_profile_divides_by_cp_and_adds_the_attention_extra() -> None:
    prof = _profile()
    assert cp_local_profile(prof, 1, "ring") is prof
    for cp in (2, 4):
        ring = cp_local_profile(prof, cp, "ring")
        assert cp_attention_extra_bytes(prof, cp, "ring") == 0.0  # its local q, k, v, output and lse only
        assert ring.layer_activation_bytes == [ACT / cp] * LAYERS
        assert ring.layer_forward_s == [1e-3 / cp] * LAYERS
        assert ring.layer_backward_s == [2e-3 / cp] * LAYERS
        assert ring.boundary_bytes == BOUNDARY / cp
        assert ring.layer_param_bytes == prof.layer_param_bytes  # cp ranks hold the same parameters
        uly = cp_local_profile(prof, cp, "ulysses")
        assert uly.layer_activation_bytes == [ACT / cp + BOUNDARY / cp] * LAYERS


def test_ring_overlaps_its_passes_and_ulysses_pays_two_all_to_alls() -> None:
    local = cp_local_profile(_profile(), 4, "ring")
    b, kv = 2, 2 * BOUNDARY / 4 * (2 * 2 / 8)  # the local key/value bytes of two samples
    one_pass, two_pass = 1e-5 + kv / 1e6, 1e-5 + 2 * kv / 1e6
    slow_block = 1.0  # compute longer than a pass: the passes are hidden, only the gradients' way home shows
    assert cp_layer_comm_s(
        local,
        COMM,
        cp=4,
        cp_mode="ring",
        micro_batch_size=b,
        layer_forward_s=4 * slow_block,
        layer_backward_s=8 * slow_block,
    ) == (0.0, pytest.approx(one_pass, rel=1e-12))
    fast, fast_back = (
        4e-6,
        8e-6,
    )  # each block 1e-6 s forward, 2e-6 s backward: every pass shows, less its block
    fwd, bwd = cp_layer_comm_s(
        local,
        COMM,
        cp=4,
        cp_mode="ring",
        micro_batch_size=b,
        layer_forward_s=fast,
        layer_backward_s=fast_back,
    )
    assert fwd == pytest.approx(3 * (one_pass - 1e-6), rel=1e-12)
    # merak_tp.ring [Note: ring overlap]: the block alone, the block with the previous block's gradients
    # (twice), those gradients alone, each behind its block's backward; then the gradients home.
    overlapped = (one_pass - 2e-6) + 2 * (two_pass - 2e-6) + (one_pass - 2e-6)
    assert bwd == pytest.approx(overlapped + one_pass, rel=1e-12)
    two = cp_local_profile(_profile(), 2, "ring")
    kv2, block = 2 * BOUNDARY / 2 * 0.5, 1e-7  # cp=2: the block, then its gradients, then the gradients home
    got = cp_layer_comm_s(
        two, COMM, cp=2, cp_mode="ring", micro_batch_size=b, layer_forward_s=0.0, layer_backward_s=2 * block
    )
    assert got[1] == pytest.approx(3 * (1e-5 + kv2 / 1e6) - 2 * block, rel=1e-12)
    uly = cp_local_profile(_profile(), 4, "ulysses")
    hidden = b * BOUNDARY / 4

    def a2a(nbytes: float) -> float:
        return 3 * 1e-5 + 3 / 4 * nbytes / 1e6

    expected = a2a(hidden + hidden * 0.5) + a2a(hidden)
    got = cp_layer_comm_s(
        uly,
        COMM,
        cp=4,
        cp_mode="ulysses",
        micro_batch_size=b,
        layer_forward_s=fast,
        layer_backward_s=fast_back,
    )
    assert got == pytest.approx((expected, expected), rel=1e-12)
    assert cp_layer_comm_s(
        _profile(), COMM, cp=1, cp_mode="ring", micro_batch_size=b, layer_forward_s=1.0, layer_backward_s=2.0
    ) == (
        0.0,
        0.0,
    )


def test_predict_at_cp_prices_the_local_tokens_and_the_dp_x_cp_all_reduce() -> None:
    prof = _profile()
    base = LayoutChoice(dp=1, tp=1, pp=1, schedule="1f1b", num_microbatches=1, micro_batch_size=2)
    one = predict(prof, base, comm=COMM)
    two = predict(prof, dataclasses.replace(base, cp=2), comm=COMM)
    assert (two.cp, two.cp_mode, two.layout) == (2, "ring", "dp1-cp2-tp1-pp1")
    assert two.training_fields()["cp"] == 2 and "cp" not in one.training_fields()
    assert two.dp_allreduce_s == COMM.allreduce_s(4000.0, 2)  # the gradients averaged over dp x cp
    assert one.dp_allreduce_s == 0.0
    local = cp_local_profile(prof, 2, "ring")
    state = 4000.0 * (1 + 1 + 2)  # weights, gradients, Adam's two moments
    assert one.peak_memory_bytes == (state + 2 * LAYERS * ACT,)
    assert two.peak_memory_bytes == (state + 2 * sum(local.layer_activation_bytes),)
    fwd, bwd = cp_layer_comm_s(
        local,
        COMM,
        cp=2,
        cp_mode="ring",
        micro_batch_size=2,
        layer_forward_s=2 * 1e-3 / 2,
        layer_backward_s=2 * 2e-3 / 2,
    )
    assert two.stage_forward_s == pytest.approx((LAYERS * (2 * 1e-3 / 2 + fwd),), rel=1e-12)
    assert two.stage_backward_s == pytest.approx((LAYERS * (2 * 2e-3 / 2 + bwd),), rel=1e-12)
    with pytest.raises(ValueError, match="ulysses"):
        predict(prof, dataclasses.replace(base, cp=4, cp_mode="ulysses"), comm=COMM)  # 2 kv heads


def test_plan_considers_cp_when_no_cp1_layout_fits() -> None:
    # One key/value head: no tp > 1 and no Ulysses; one sample per replica: pp > 1 has too few
    # microbatches. At cp=1 no layout of 4 ranks runs; dp=2 x cp=2, cp=2 x pp=2 and cp=4 do.
    prof = _profile(num_kv_heads=1)
    with pytest.raises(ValueError, match="nothing fits"):  # dp=2 x pp=2 would need 2 microbatches
        plan(prof, world_size=4, memory_per_device=1e12, global_batch_size=2, comm=COMM)
    cands = plan(
        prof, world_size=4, memory_per_device=1e12, global_batch_size=2, comm=COMM, cp_degrees=(1, 2, 4)
    )
    assert {(c.dp, c.cp, c.tp, c.pp) for c in cands} == {(2, 2, 1, 1), (1, 2, 1, 2), (1, 4, 1, 1)}
    peaks = {(c.cp, c.pp): max(c.device_peak_bytes) for c in cands if c.recompute == "none"}
    assert peaks[4, 1] < peaks[2, 1]  # a quarter of the tokens (and of the GQA key/values passed)
    low, high = sorted(peaks.values())[:2]
    memory = (low + high) / 2 / usable_memory(1.0)  # the smallest fits, no other layout without recomputation
    fits = plan(
        prof, world_size=4, memory_per_device=memory, global_batch_size=2, comm=COMM, cp_degrees=(1, 2, 4)
    )
    smallest = min(peaks, key=lambda k: peaks[k])
    assert {(c.cp, c.pp) for c in fits if c.recompute == "none"} == {smallest}
    with pytest.raises(ValueError, match="nothing fits"):
        plan(prof, world_size=4, memory_per_device=memory, global_batch_size=2, comm=COMM)
    assert cp_allowed(_profile(), 2, "ulysses", 1) and not cp_allowed(_profile(), 4, "ulysses", 1)
    assert cp_allowed(_profile(), 4, "ring", 2)


def test_merak_plan_searches_the_cp_and_ep_degrees_layout_auto_does(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # merak plan asks the same function as layout: auto (givens.model_degrees) for the cp and ep degrees of
    # the job's model and batch, whatever the job's cp, and hands both to the planner.
    import merak_core.autoplan.auto as auto
    import merak_core.autoplan.givens as givens
    import merak_core.planner as planner
    from merak_core.cli.main import main

    fixed = _profile(num_heads=1, num_kv_heads=1, vocab_size=None)
    monkeypatch.setattr(auto, "profile_for_plan", lambda *a, **k: fixed)
    asked: list[tuple[int, int]] = []

    def degrees(model: nn.Module, batch: object, args: Any, world: int, **kw: object) -> dict:
        asked.append((args.cp, world))
        return {"cp": (1, 2), "ep": (1,)}

    seen: dict[str, object] = {}
    real_plan = planner.plan

    def spy(*a: object, **kw: object) -> object:
        seen.update(cp=kw["cp_degrees"], ep=kw["ep_degrees"])
        return real_plan(*a, **kw)

    monkeypatch.setattr(givens, "model_degrees", degrees)
    monkeypatch.setattr(planner, "plan", spy)
    monkeypatch.setattr(nn.Module, "supports_context_parallel", True, raising=False)
    base = ["plan", DEMO, "data.kwargs.train_size=64", "--world-size", "2", "--global-batch-size", "1"]
    assert main([*base, "--memory-per-device", "1GiB"]) == 0  # the job's cp is 1
    assert asked == [(1, 2)] and seen == {"cp": (1, 2), "ep": (1,)}
    assert "dp1-cp2-tp1-pp1" in capsys.readouterr().out


def test_runnable_cp_keeps_what_the_run_accepts() -> None:
    # The run trains cp > 1 at pp > 1 for a handwritten model with the cp hook: kept. What the run's
    # check_cp_model refuses (no cp hook; Ulysses with cp not dividing the heads per TP rank) goes.
    from types import SimpleNamespace

    from tests.support.models import GPT, DecoderConfig, Llama

    def cand(cp: int, pp: int, tp: int = 1, mode: str = "ring") -> SimpleNamespace:
        return SimpleNamespace(cp=cp, pp=pp, tp=tp, cp_mode=mode)

    cands = [cand(1, 2), cand(2, 1), cand(2, 2), cand(2, 1, 2, "ulysses")]
    handwritten = Llama(DecoderConfig(num_kv_heads=2))
    kept = runnable_cp(cands, handwritten)
    assert [(c.cp, c.pp, c.tp) for c in kept] == [(1, 2, 1), (2, 1, 1), (2, 2, 1)]
    assert runnable_cp(cands, lambda: handwritten) == cands  # a builder: the run checks it once built
    no_hook = GPT(DecoderConfig(num_layers=1))
    assert [(c.cp, c.pp) for c in runnable_cp(cands, no_hook)] == [(1, 2)]
    with pytest.raises(ValueError, match="refuses every fitting configuration.*cp_attention"):
        runnable_cp(cands[1:], no_hook)


def test_merak_plan_considers_the_jobs_cp(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    import yaml

    import merak_core.autoplan.auto as auto
    import merak_core.autoplan.givens as givens
    from merak_core.cli.main import main

    # One sample per step and no tp (one head): at cp=1 no layout of two ranks runs (the search test
    # above), at cp=2 one does.
    fixed = _profile(num_heads=1, num_kv_heads=1, vocab_size=None)
    monkeypatch.setattr(auto, "profile_for_plan", lambda *a, **k: fixed)
    # The demo's model as if it called the cp hook and its batch split into cp=2 shards (the run's checks
    # refuse both otherwise).
    monkeypatch.setattr(nn.Module, "supports_context_parallel", True, raising=False)
    monkeypatch.setattr(givens, "model_degrees", lambda *a, **k: {"cp": (1, 2), "ep": (1,)})
    base = ["plan", DEMO, "data.kwargs.train_size=64", "--world-size", "2", "--global-batch-size", "1"]
    base += ["--memory-per-device", "1GiB"]
    out = tmp_path / "planned.yaml"
    assert main([*base, "training.cp=2", "--write-config", str(out)]) == 0
    table = capsys.readouterr().out
    assert "dp1-cp2-tp1-pp1" in table and "1f1b ring" in table
    written = yaml.safe_load(out.read_text())["training"]
    assert (written["cp"], written["cp_mode"], written["dp"], written["pp"]) == (2, "ring", 1, 1)
    assert written["ep"] == 1  # the plan's ep, written too


def test_zero_shards_over_dp_or_dp_x_cp_as_the_run_does() -> None:
    from merak_core.planner.memory import model_state_bytes

    prof = _profile()
    base = LayoutChoice(dp=1, tp=1, pp=1, schedule="1f1b", num_microbatches=1, micro_batch_size=2, cp=2)
    acts = 2 * sum(cp_local_profile(prof, 2, "ring").layer_activation_bytes)
    # ZeRO-1: the optimizer over the dp group (1 rank here); ZeRO-3: FSDP2 over dp x cp = 2 ranks.
    one = predict(prof, dataclasses.replace(base, zero_stage=1), comm=COMM)
    assert one.peak_memory_bytes == (sum(model_state_bytes(4000.0, zero_stage=1, dp=1)) + acts,)
    three = predict(prof, dataclasses.replace(base, zero_stage=3), comm=COMM)
    state = model_state_bytes(4000.0, zero_stage=3, dp=2, largest_unit_bytes=1000.0)
    assert three.peak_memory_bytes == (sum(state) + acts,)
