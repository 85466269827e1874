"""The cluster planner prices expert parallelism ([Note: expert-parallel cost terms]).

- the meta trace of an MoE model costs each block's active experts (k of E) and keeps all its experts'
  parameters in the layer (before: the trace failed on the data-dependent dispatch);
- the all-to-all bytes the model prices equal the bytes the dispatch really sends off-rank in a Trainer
  step (dp2·ep2, a routing that is exactly uniform), forward and backward;
- the per-rank parameter bytes the cluster model holds at ep=1, 2, 4 equal the real per-rank parameters
  after the experts are split (dp=4);
- predict_config adds four all-to-alls per block and microbatch and divides the experts' bytes; plan_cluster
  ranks ep for an MoE model (and only ep=1 for a dense one).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tests.support.dist import run_on_ranks
from tests.support.moe import MoEBlock, MoEConfig, MoELlama

SEQ, VOCAB = 8, 96


class UniformRouted(MoEBlock):
    """Token i of the rank's microbatch goes to experts i % E and (i + 1) % E: every EP rank receives exactly
    its share (uniform routing), the weights from the router (so gradients flow)."""

    def route(self, x_nh: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n = x_nh.size(0)
        first = torch.arange(n, device=x_nh.device) % self.num_experts
        experts_nk = torch.stack([first, (first + 1) % self.num_experts], dim=1)[:, : self.top_k]
        weights_nk = F.softmax(self.router(x_nh), dim=-1).gather(1, experts_nk)
        return weights_nk, experts_nk


def _uniform_model(meta: bool = False, dtype: torch.dtype = torch.float64) -> MoELlama:
    import merak_graph as mg

    torch.manual_seed(0)
    with mg.empty_init() if meta else torch.device("cpu"):
        model = MoELlama(MoEConfig(vocab_size=VOCAB))
    for layer in model.layers:
        layer.moe.__class__ = UniformRouted
    return model.to(dtype)


def _costs(model: torch.nn.Module) -> Any:
    from merak_core.planner.cluster import load_cluster
    from merak_core.planner.cluster_cost import model_costs, trace_for_cluster

    cluster = load_cluster("h100-sxm-8x")
    sharded = trace_for_cluster(model, (torch.zeros(1, SEQ, dtype=torch.long),), cluster)
    return model_costs(sharded, model), cluster


def test_trace_prices_the_active_experts() -> None:
    """Each MoE layer's FLOPs: the router and k experts per token (not E), and every expert's parameters."""
    model = _uniform_model(meta=True, dtype=torch.float32)
    costs, _ = _costs(model)
    cfg = model.config
    assert costs.moe is not None and sum(costs.moe.blocks_per_layer) == cfg.num_layers
    assert costs.moe.top_k == cfg.top_k and costs.moe.num_experts == cfg.num_experts
    expert_flops = 2 * 3 * cfg.hidden_size * cfg.expert_size  # gate, up, down per row
    router_flops = 2 * cfg.hidden_size * cfg.num_experts
    moe_layers = [ly for ly, b in zip(costs.layers, costs.moe.blocks_per_layer, strict=True) if b]
    for layer in moe_layers:
        assert layer.flops == SEQ * (cfg.top_k * expert_flops + router_flops)
    experts = {n for n, _ in model.named_parameters() if ".experts." in n}
    assert costs.moe.expert_params == experts
    assert experts <= {n for ly in moe_layers for n in ly.param_names}
    assert costs.moe.block_bytes_per_sample == SEQ * cfg.hidden_size * 4
    assert type(model.layers[0].moe) is UniformRouted  # the trace's stand-in is gone


# ---------------------------------------------------------------------------- all-to-all bytes


def _measured_sent_bytes() -> int:
    """Off-rank bytes the dispatch's all-to-alls send in one dp2·ep2 Trainer step (forward and backward)."""
    import tempfile

    import torch.distributed as dist
    from torch.utils.data import Dataset

    import merak_tp.all_to_all as a2a
    from merak_core import Trainer, TrainingArguments

    class Tokens(Dataset):
        def __len__(self) -> int:
            return 4

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            ids = torch.arange(SEQ + 1) * (i + 1) % VOCAB
            return {"input_ids": ids[:-1], "labels": ids[1:]}

    sent = [0]
    inner = a2a._exchange

    def counting(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any) -> torch.Tensor:
        me = dist.get_rank(group)
        row_bytes = x[0].numel() * x.element_size() if x.size(0) else 0
        sent[0] += sum(n for j, n in enumerate(in_splits) if j != me) * row_bytes
        return inner(x, out_splits, in_splits, group)

    args = TrainingArguments(
        output_dir=tempfile.mkdtemp(prefix="merak-ep-bytes-"),
        ep=2,
        per_device_train_batch_size=2,
        max_steps=1,
        dtype="float64",
        logging_steps=1,
    )
    trainer = Trainer(_uniform_model(), args, Tokens())
    a2a._exchange = counting  # type: ignore[assignment]
    try:
        trainer.train()
    finally:
        a2a._exchange = inner  # type: ignore[assignment]
    return sent[0]


def test_priced_all_to_all_bytes_equal_the_measured() -> None:
    from merak_core.planner.expert_cost import model_step_all_to_all_bytes, step_all_to_all_bytes

    measured = run_on_ranks(2, _measured_sent_bytes)
    costs, _ = _costs(_uniform_model(meta=True))
    priced = model_step_all_to_all_bytes(costs, 2, micro_batch_size=2, num_microbatches=1)
    cfg = MoEConfig()
    formula = step_all_to_all_bytes(
        tokens=2 * SEQ,
        top_k=2,
        ep=2,
        hidden=cfg.hidden_size,
        dtype_bytes=8,
        moe_layers=cfg.num_layers,
        microbatches=1,
    )
    assert measured == [priced, priced] and priced == formula > 0


# ---------------------------------------------------------------------------- per-rank parameters


def _real_params(ep: int) -> int:
    from merak_core.parallel.expert_parallel import apply_expert_parallel
    from merak_core.parallel.layout import ParallelLayout

    model = _uniform_model(dtype=torch.float32)
    if ep > 1:
        apply_expert_parallel(model, ParallelLayout.build(dp=4, ep=ep, device="cpu"))
    return sum(p.numel() * p.element_size() for p in model.parameters())


def test_per_rank_parameter_bytes_at_each_ep() -> None:
    from merak_core.config.layout_choice import LayoutChoice
    from merak_core.planner.cluster_cost import stage_costs
    from merak_core.planner.expert_pricing import price_expert_parallel

    costs, cluster = _costs(_uniform_model(meta=True, dtype=torch.float32))
    bounds = [0, costs.num_layers]
    for ep in (1, 2, 4):
        real = run_on_ranks(4, _real_params, ep)
        assert len(set(real)) == 1
        st = stage_costs(costs, cluster, bounds=bounds, dp=4, tp=1, micro_batch_size=1)
        choice = LayoutChoice(
            dp=4, tp=1, pp=1, ep=ep, schedule="1f1b", num_microbatches=1, micro_batch_size=1
        )
        st = price_expert_parallel(costs, cluster, st, choice, bounds=bounds)
        assert st.params_per_device[0] * costs.precision.weight_bytes == real[0], ep


# ---------------------------------------------------------------------------- the search


def test_predict_and_plan_rank_ep() -> None:
    from merak_core.config.layout_choice import LayoutChoice
    from merak_core.planner.cluster_search import plan_cluster, predict_config
    from merak_core.planner.expert_cost import all_to_all_bytes_per_sample, all_to_all_s

    costs, cluster = _costs(_uniform_model(meta=True, dtype=torch.float32))
    base = dict(dp=8, tp=1, pp=1, schedule="1f1b", num_microbatches=1, micro_batch_size=2)
    one = predict_config(costs, cluster, LayoutChoice(**base))
    two = predict_config(costs, cluster, LayoutChoice(**base, ep=2))
    assert one is not None and two is not None
    a2a = all_to_all_s(2 * all_to_all_bytes_per_sample(costs, 2), 2, 1, cluster)
    assert two.pipeline_s - one.pipeline_s == pytest.approx(4 * 2 * a2a, rel=1e-9)  # 2 blocks, 4 each
    assert two.stage_static_bytes[0] < one.stage_static_bytes[0]
    assert two.training_fields()["ep"] == 2 and two.layout == "dp8-ep2-tp1-pp1"
    cands = plan_cluster(
        costs, cluster, num_nodes=1, global_batch_size=8, recompute_modes=("none",), zero_stages=(0, 1, 2, 3)
    )
    eps = {c.ep for c in cands}
    assert eps == {1, 2, 4}  # dividing dp=8 and the 4 experts, with every ZeRO stage
    assert {(c.zero_stage, c.ep) for c in cands if c.dp == 8} >= {
        (z, e) for z in (0, 1, 2, 3) for e in (2, 4)
    }
    times = [c.step_time_s for c in cands]
    assert times == sorted(times)


def test_dense_model_plans_no_ep() -> None:
    import merak_graph as mg
    from merak_core.planner.expert_cost import expert_degrees
    from tests.support.models import DecoderConfig, Llama

    with mg.empty_init():
        model = Llama(DecoderConfig(num_layers=1, num_heads=4, num_kv_heads=2, vocab_size=VOCAB))
    costs, _ = _costs(model)
    assert costs.moe is None and expert_degrees(costs, 8) == [1]


def test_zero2_and_zero3_with_experts_shard_them_over_the_replica_group() -> None:
    # ZeRO-2/3 at ep > 1 (parallel/zero_experts.py): the experts' parameters, gradients and optimizer states
    # divided by ep, then sharded over dp / ep; ZeRO-3 gathers the experts over that replica group.
    from merak_core.config.layout_choice import LayoutChoice
    from merak_core.parallel.fsdp import default_reshard_after_forward
    from merak_core.planner.cluster_collectives import zero3_gathers_s
    from merak_core.planner.cluster_cost import stage_costs, state_bytes
    from merak_core.planner.expert_pricing import price_expert_parallel

    costs, cluster = _costs(_uniform_model(meta=True, dtype=torch.float32))
    moe, prec, bounds = costs.moe, costs.precision, [0, costs.num_layers]
    assert moe is not None
    expert = sum(costs.param_numel[n] for n in moe.expert_params)
    dense = costs.stage_params(0, costs.num_layers) - expert
    dp, ep = 4, 2
    for zero in (2, 3):
        st = stage_costs(costs, cluster, bounds=bounds, dp=dp, tp=1, micro_batch_size=1, zero_stage=zero)
        choice = LayoutChoice(
            dp=dp, tp=1, pp=1, ep=ep, zero_stage=zero, schedule="1f1b", num_microbatches=1, micro_batch_size=1
        )
        got = price_expert_parallel(costs, cluster, st, choice, bounds=bounds)
        unit = costs.largest_layer_params(0, costs.num_layers, trainable=True) if zero == 3 else 0.0
        want = state_bytes(dense, prec, zero_stage=zero, dp=dp, unit_numel=unit) + state_bytes(
            expert / ep, prec, zero_stage=zero, dp=dp // ep
        )
        assert got.static_bytes[0] == pytest.approx(want, rel=1e-12), zero
        added = got.forward_s[0] - st.forward_s[0]
        if zero == 2:
            continue
        again = default_reshard_after_forward(3, stage_index=0, num_stages=1)
        gathers = [zero3_gathers_s(n, prec.weight_bytes, cluster, dp=d, tp=t, backward_too=again)[0]
                   for n, d, t in ((dense + expert, dp, 1), (dense, dp, 1), (expert / ep, dp // ep, ep))]  # fmt: skip
        two = price_expert_parallel(
            costs, cluster, st, dataclasses.replace(choice, zero_stage=2), bounds=bounds
        )
        # the experts' gathers: 1 / ep of their bytes over dp / ep ranks, not all of them over dp
        assert added - (two.forward_s[0] - st.forward_s[0]) == pytest.approx(
            gathers[1] + gathers[2] - gathers[0], rel=1e-9
        )
