"""The cluster model's search over cp and ep ([Note: cluster cp search], [Note: expert-parallel cost terms]).

Pure, single process, meta device:
- a job at cp=1 is searched at the cp the run accepts (merak plan --cluster): a sequence too long for every
  cp=1 layout ranks a cp layout first (and writes cp: 2), a short one ranks cp=1 first; both modes priced;
- cp > 1 is never planned with ep > 1 (the run refuses the pair) and predict_config refuses it;
- transformers' MoE families (a tiny Mixtral, fused experts) are traced and priced: experts counted, k of
  E active, the expert bytes divided by ep, four all-to-alls per MoE layer and microbatch of the formula's
  bytes, and plan_cluster ranks ep > 1.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from merak_core.config.layout_choice import LayoutChoice
from merak_core.planner.cluster import load_cluster
from merak_core.planner.cluster_context import attach_attentions
from merak_core.planner.cluster_cost import model_costs, trace_for_cluster
from merak_core.planner.cluster_search import plan_cluster, predict_config
from tests.support.models import DecoderConfig, Llama

TWO = dataclasses.replace(load_cluster("h100-sxm-8x"), devices_per_node=2)
QUICK = dict(num_nodes=1, recompute_modes=("none",), zero_stages=(0,), tp_overlaps=(False,))


def _llama(seq: int, heads: int, layers: int = 2) -> tuple[Any, Any, Any]:
    """A bf16 Llama-style model with merak_tp's cp hook on meta, its costs on ``TWO`` and its inputs."""
    import merak_graph as mg

    cfg = DecoderConfig(
        num_layers=layers, num_heads=heads, num_kv_heads=heads, hidden_size=64, max_seq_len=seq
    )
    with mg.empty_init():
        model = Llama(cfg).to(torch.bfloat16)
    inputs = (torch.zeros(1, seq, dtype=torch.long, device="meta"),)
    costs = model_costs(trace_for_cluster(model, inputs, TWO), model, num_heads=heads, num_kv_heads=heads)
    return attach_attentions(costs, model), model, inputs


# ---------------------------------------------------------------------------- the cp degrees searched


def test_long_sequence_ranks_cp_first_short_one_does_not() -> None:
    # One head: no TP (and no Ulysses); 2 ranks; dp=2 or pp=2 hold a whole sample per rank, cp=2 half.
    costs, _, _ = _llama(4096, 1)
    modes = ("ring", "ulysses")
    every = plan_cluster(costs, TWO, global_batch_size=2, cps=(1, 2), cp_mode=modes, **QUICK)
    need = {cp: min(max(c.stage_memory_bytes) for c in every if c.cp == cp) for cp in (1, 2)}
    assert need[2] < need[1]
    tight = dataclasses.replace(TWO, memory_bytes=(need[1] + need[2]) / 2 / TWO.usable_memory_fraction)
    with pytest.raises(ValueError, match="nothing fits"):
        plan_cluster(costs, tight, global_batch_size=2, cps=(1,), **QUICK)
    cands = plan_cluster(costs, tight, global_batch_size=2, cps=(1, 2), cp_mode=modes, **QUICK)
    assert cands[0].cp == 2 and cands[0].cp_mode == "ring" and all(c.cp == 2 for c in cands)
    assert cands[0].training_fields()["cp"] == 2

    short, _, _ = _llama(64, 4)
    cands = plan_cluster(short, TWO, global_batch_size=2, cps=(1, 2), cp_mode=modes, **QUICK)
    assert cands[0].cp == 1
    assert {(c.cp, c.cp_mode) for c in cands if c.cp > 1} == {(2, "ring"), (2, "ulysses")}  # priced, slower
    assert min(c.step_time_s for c in cands if c.cp > 1) > cands[0].step_time_s


_MODEL = """
from tests.support.models import DecoderConfig, Llama


def build_model(seq, heads, layers):
    return Llama(DecoderConfig(num_layers=layers, num_heads=heads, num_kv_heads=heads, hidden_size=64, max_seq_len=seq))
"""
_DATA = """
import torch


class Tokens(torch.utils.data.Dataset):
    def __init__(self, seq):
        self.seq = seq

    def __len__(self):
        return 4

    def __getitem__(self, i):
        ids = torch.arange(self.seq) % 96
        return ids, ids


def build_datasets(seq):
    return Tokens(seq), Tokens(seq)
"""


def _job(tmp_path: Any, seq: int, heads: int, layers: int, memory_bytes: float) -> tuple[str, str]:
    """A job at cp: 1 (no cp key) of the bf16 Llama above, and a 2-device cluster of ``memory_bytes``."""
    import yaml

    (tmp_path / "model.py").write_text(_MODEL)
    (tmp_path / "data.py").write_text(_DATA)
    job = {
        "model": {
            "factory": "model.py:build_model",
            "kwargs": {"seq": seq, "heads": heads, "layers": layers},
        },
        "data": {"factory": "data.py:build_datasets", "kwargs": {"seq": seq}},
        "training": {
            "output_dir": str(tmp_path / "out"),
            "per_device_train_batch_size": 1,
            "dtype": "bfloat16",
        },
    }
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    source = yaml.safe_load(
        Path(load_cluster.__code__.co_filename).with_name("clusters").joinpath("h100-sxm-8x.yaml").read_text()
    )
    source.update(name="two-small", devices_per_node=2)
    source["device"]["memory_gb"] = memory_bytes / 1e9
    (tmp_path / "two.yaml").write_text(yaml.safe_dump(source))
    return str(tmp_path / "job.yaml"), str(tmp_path / "two.yaml")


def test_merak_plan_on_a_cluster_turns_cp_on_for_a_long_sequence(tmp_path: Any, capsys: Any) -> None:
    import yaml

    from merak_core.cli.main import main

    # What the CLI traces for the job below. One layer: no pipeline split holds less than half its
    # attention's activations, whatever the recomputation; cp=2 holds half of everything.
    costs, _, _ = _llama(4096, 1, layers=1)
    every = plan_cluster(costs, TWO, num_nodes=1, global_batch_size=2, cps=(1, 2))
    need = {cp: min(max(c.stage_memory_bytes) for c in every if c.cp == cp) for cp in (1, 2)}
    assert need[2] < need[1]
    job, cluster = _job(tmp_path, 4096, 1, 1, (need[1] + need[2]) / 2 / TWO.usable_memory_fraction)
    out = tmp_path / "best.yaml"
    assert main(["plan", job, "--cluster", cluster, "--nodes", "1", "--write-config", str(out)]) == 0
    table = capsys.readouterr().out
    assert "dp1-cp2-tp1-pp1" in table and "dp2-tp1-pp1" not in table
    assert yaml.safe_load(out.read_text())["training"]["cp"] == 2

    job, cluster = _job(tmp_path, 64, 4, 2, 80e9)  # short: cp=2 is priced (both modes) and ranks below cp=1
    assert (
        main(["plan", job, "--cluster", cluster, "--nodes", "1", "--top", "1000", "--write-config", str(out)])
        == 0
    )
    table = capsys.readouterr().out
    assert "1f1b ring" in table and "1f1b ulysses" in table
    assert "cp" not in yaml.safe_load(out.read_text())["training"]


def test_ring_log_sum_exp_is_priced_in_float32() -> None:
    from merak_core.planner.cluster_context import local_costs, ring_wire_factor

    costs, _, _ = _llama(64, 4)
    assert ring_wire_factor(costs) == 2.0  # bf16 activations, float32 ring
    ring, ulysses = local_costs(costs, 2, "ring"), local_costs(costs, 2, "ulysses")
    # per attention and sample: local tokens x 4 heads x 4 bytes, the tokens read (as every cp term) from
    # the residual stream's bytes: tp_message_bytes / (hidden 64 x 2 bytes)
    lse = costs.tp_message_bytes / (64 * 2) / 2 * 4 * 4
    ulysses_extra = costs.tp_message_bytes / 2  # context_cost's: the output's copy
    for r, u, n in zip(ring.layers, ulysses.layers, costs._cache["cp_attentions"], strict=True):
        assert r.activation_bytes - u.activation_bytes == pytest.approx(n * (lse - ulysses_extra))


# ---------------------------------------------------------------------------- transformers MoE: ep


def _moe_family(name: str, seq: int) -> tuple[Any, Any, Any]:
    """A tiny float32 transformers MoE model of the TP tests' families on meta, its costs and config."""
    import merak_graph as mg
    from tests.tp._hf_families import _config

    cfg, model_cls = _config(name)
    cfg.use_cache = False
    with mg.empty_init():
        model = model_cls(cfg)
    cluster = load_cluster("h100-sxm-8x")
    inputs = {"input_ids": torch.zeros(1, seq, dtype=torch.long, device="meta")}
    sharded = trace_for_cluster(model, inputs, cluster)
    heads = dict(num_heads=cfg.num_attention_heads, num_kv_heads=cfg.num_key_value_heads)
    costs = model_costs(sharded, model, vocab_size=cfg.vocab_size, **heads)
    return attach_attentions(costs, model), model, cfg


@pytest.fixture(scope="module")
def mixtral() -> tuple[Any, Any, Any]:
    return _moe_family("mixtral", 16)


def test_mixtral_experts_are_counted(mixtral) -> None:
    from merak_core.parallel.fused_experts import is_fused_experts

    costs, model, cfg = mixtral
    moe = costs.moe
    assert moe is not None
    layers, k = cfg.num_hidden_layers, cfg.num_experts_per_tok
    assert (moe.num_experts, moe.top_k, sum(moe.blocks_per_layer)) == (cfg.num_local_experts, k, layers)
    assert moe.expert_params == {
        f"model.layers.{i}.mlp.experts.{w}" for i in range(layers) for w in ("gate_up_proj", "down_proj")
    }
    assert moe.block_bytes_per_sample == 16 * cfg.hidden_size * 4  # tokens x hidden x float32
    # the MoE shard's FLOPs: the router over E experts and k experts' gate, up and down per token
    expert_flops = 2 * 3 * cfg.hidden_size * cfg.intermediate_size
    router_flops = 2 * cfg.hidden_size * cfg.num_local_experts
    moe_layers = [ly for ly, b in zip(costs.layers, moe.blocks_per_layer, strict=True) if b]
    assert [ly.flops for ly in moe_layers] == [16 * (k * expert_flops + router_flops)] * layers
    assert all(is_fused_experts(m) and type(m).__name__ == "MixtralExperts" for _, m in _fused(model))


def _fused(model: Any) -> list[tuple[str, Any]]:
    from merak_core.parallel.fused_experts import fused_experts

    return fused_experts(model)


def test_mixtral_all_to_all_bytes_and_times_match_the_formula(mixtral) -> None:
    from merak_core.planner.expert_cost import all_to_all_s, model_step_all_to_all_bytes

    costs, _, cfg = mixtral
    cluster = load_cluster("h100-sxm-8x")
    seq, hidden, k, layers = 16, cfg.hidden_size, cfg.num_experts_per_tok, cfg.num_hidden_layers
    mbs, m = 2, 2
    for ep in (2, 4):
        per_block = mbs * seq * k * (ep - 1) / ep * hidden * 4  # one all-to-all's off-rank bytes
        want = 4 * layers * m * per_block  # two forward, two backward, per MoE layer and microbatch
        assert model_step_all_to_all_bytes(costs, ep, micro_batch_size=mbs, num_microbatches=m) == want
        base = dict(dp=8, tp=1, pp=1, schedule="1f1b", num_microbatches=1, micro_batch_size=mbs)
        one = predict_config(costs, cluster, LayoutChoice(**base))
        at_ep = predict_config(costs, cluster, LayoutChoice(**base, ep=ep))
        assert one is not None and at_ep is not None
        a2a = all_to_all_s(per_block, ep, 1, cluster)
        assert at_ep.pipeline_s - one.pipeline_s == pytest.approx(4 * layers * a2a, rel=1e-9)
        experts = sum(costs.param_numel[n] for n in costs.moe.expert_params)
        saved = experts * (1 - 1 / ep) * (4 + 4 + 8)  # float32 weights, gradients, Adam's states
        assert one.stage_static_bytes[0] - at_ep.stage_static_bytes[0] == pytest.approx(saved, rel=1e-9)


def test_plan_ranks_ep_for_mixtral_never_with_cp(mixtral) -> None:
    costs, _, _ = mixtral
    cluster = load_cluster("h100-sxm-8x")
    cands = plan_cluster(
        costs,
        cluster,
        num_nodes=1,
        global_batch_size=8,
        cps=(1, 2),
        recompute_modes=("none",),
        tp_overlaps=(False,),
    )
    assert {c.ep for c in cands} == {1, 2, 4}  # dividing dp=8 and the 4 experts
    assert any(c.cp == 2 for c in cands)
    assert not [c.layout for c in cands if c.cp > 1 and c.ep > 1]
    choice = LayoutChoice(
        dp=4, cp=2, ep=2, tp=1, pp=1, schedule="1f1b", num_microbatches=1, micro_batch_size=1
    )
    with pytest.raises(ValueError, match="cp=2 with ep=2"):
        predict_config(costs, cluster, choice)


def test_qwen3_moe_is_priced_and_ranked_at_ep() -> None:
    costs, _, cfg = _moe_family("qwen3_moe", 16)
    moe = costs.moe
    assert moe is not None and (moe.num_experts, moe.top_k) == (cfg.num_experts, cfg.num_experts_per_tok)
    assert (
        sum(moe.blocks_per_layer) == cfg.num_hidden_layers
        and len(moe.expert_params) == 2 * cfg.num_hidden_layers
    )
    cluster = load_cluster("h100-sxm-8x")
    cands = plan_cluster(costs, cluster, global_batch_size=8, **{**QUICK, "zero_stages": (0, 1)})
    assert {c.ep for c in cands} == {1, 2, 4}
