"""The cluster planner (``merak plan --cluster``) with frozen weights (a LoRA run): priced as weights only
([Note: frozen weights] in merak_core.planner.memory). Pure, single process, meta device."""

from __future__ import annotations

import pytest

from merak_core import LoraConfig
from merak_core.lora.apply import apply_lora
from merak_core.planner.cluster import ClusterSpec, load_cluster
from merak_core.planner.cluster_cost import model_costs, stage_costs, trace_for_cluster
from merak_core.planner.cluster_search import plan_cluster
from merak_core.planner.gpt_shapes import DecoderShape, build_decoder, decoder_inputs
from tests.core.test_cluster import _tiny_cluster

SHAPE = DecoderShape(num_layers=4, hidden=1024, num_heads=8, vocab_size=4096, seq_len=64)
LAYOUT = (8, 1, 1)  # pure data parallelism: every rank holds every weight


def _costs(lora: bool):
    cluster = load_cluster("h100-sxm-8x")
    model = build_decoder(SHAPE)
    if lora:
        apply_lora(model, LoraConfig(r=8, alpha=16, target_modules="all-linear"))
    return model_costs(trace_for_cluster(model, decoder_inputs(SHAPE), cluster), model, num_heads=8)


def _least_memory(costs, cluster: ClusterSpec, **kw) -> float:
    cands = plan_cluster(costs, cluster, num_nodes=1, global_batch_size=8, layouts=[LAYOUT], **kw)
    return min(max(c.stage_memory_bytes) for c in cands)


def test_cluster_planner_prices_frozen_weights_as_weights_only() -> None:
    full, lora = _costs(False), _costs(True)
    assert not full.frozen and lora.frozen
    params = sum(full.param_numel.values())
    trainable = sum(n for name, n in lora.param_numel.items() if name not in lora.frozen)
    assert 0 < trainable < 0.05 * params
    assert sum(lora.param_numel.values()) == params + trainable  # the base plus its adapters
    cluster, bounds, prec = load_cluster("h100-sxm-8x"), [0, lora.num_layers], lora.precision
    w, g, o = prec.weight_bytes, prec.grad_bytes, prec.optimizer_bytes
    for zero in (0, 1, 2, 3):
        kw = dict(bounds=bounds, dp=8, tp=1, micro_batch_size=1, zero_stage=zero)
        (f,) = stage_costs(full, cluster, **kw).static_bytes
        (mine,) = stage_costs(lora, cluster, **kw).static_bytes
        assert mine < (0.3 if zero < 3 else 0.5) * f, zero  # ZeRO-3 shards the full fine-tune's weights too
        if zero == 0:  # every weight, the adapters' gradients and optimizer states
            assert mine == pytest.approx((params + trainable) * w + trainable * (g + o), rel=1e-12)
            assert f == pytest.approx(params * (w + g + o), rel=1e-12)
        if zero == 2:  # the frozen weights whole (FSDP2 leaves them alone), the adapters sharded and gathered
            expected = params * w + trainable * w * (1 + 1 / 8) + trainable * (g + o / 8)
            assert mine == pytest.approx(expected, rel=1e-12)


def test_lora_job_fits_a_layout_full_fine_tuning_does_not() -> None:
    full, lora = _costs(False), _costs(True)
    big = _tiny_cluster(memory_gb=1000.0)
    need_full, need_lora = _least_memory(full, big), _least_memory(lora, big)
    assert need_lora < 0.5 * need_full
    memory_gb = (need_lora + need_full) / 2 / 1e9 / big.usable_memory_fraction  # between the two needs
    cluster = _tiny_cluster(memory_gb=memory_gb)
    with pytest.raises(ValueError):
        plan_cluster(full, cluster, num_nodes=1, global_batch_size=8, layouts=[LAYOUT])
    cands = plan_cluster(lora, cluster, num_nodes=1, global_batch_size=8, layouts=[LAYOUT])
    assert cands and all(c.fits and (c.dp, c.tp, c.pp) == LAYOUT for c in cands)


def test_merak_plan_cluster_builds_the_job_with_its_adapters() -> None:
    """The job path of ``merak plan --cluster``: the demo job with ``model.lora`` is priced with its adapters
    trainable and every other weight frozen, and fits a device the full fine-tune of the demo does not."""
    from pathlib import Path

    from merak_core.autoplan.cluster_job import job_model
    from merak_core.job import JobConfig

    demo = str(Path(__file__).resolve().parents[2] / "examples/addition/config.yaml")
    lora = ["model.lora.r=2", "model.lora.target_modules=[query,value,up]"]
    costs = {}
    for name, overrides in (("full", []), ("lora", lora)):
        jm = job_model(JobConfig.from_yaml(demo, ["data.kwargs.train_size=64", *overrides]))
        sharded = trace_for_cluster(jm.model, jm.example_inputs, load_cluster("h100-sxm-8x"))
        costs[name] = model_costs(sharded, jm.model, num_heads=jm.num_heads, vocab_size=jm.vocab_size)
    full, mine = costs["full"], costs["lora"]
    assert not full.frozen and mine.frozen
    assert {n for n in mine.param_numel if n not in mine.frozen} and all(
        "lora_" in n for n in mine.param_numel if n not in mine.frozen
    )
    big = _tiny_cluster(memory_gb=1000.0)
    need_full, need_lora = _least_memory(full, big), _least_memory(mine, big)
    assert need_lora < need_full
    cluster = _tiny_cluster(memory_gb=(need_lora + need_full) / 2 / 1e9 / big.usable_memory_fraction)
    with pytest.raises(ValueError, match="nothing fits"):
        plan_cluster(full, cluster, num_nodes=1, global_batch_size=8, layouts=[LAYOUT])
    assert plan_cluster(mine, cluster, num_nodes=1, global_batch_size=8, layouts=[LAYOUT])
