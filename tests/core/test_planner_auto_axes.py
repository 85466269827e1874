"""The profiled planner and ``layout: auto`` consider cp and ep on their own (issues 28 item 4, 29 item 4).

Pure: hand-written profiles and communication models for the exact terms, and the measured profile of
the reference MoE Llama (tests/support/moe.py) for the search; which cp and ep a model allows is read
from the run's own checks on the model and a training batch, without any process group.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from merak_core import TrainingArguments
from merak_core.autoplan.givens import model_cp_degrees, model_ep_degrees
from merak_core.config.layout_choice import LayoutChoice
from merak_core.planner import CommModel, ModelProfile, plan, predict, profile_model
from merak_core.planner.expert_cost import all_to_all_bytes
from merak_core.planner.memory import model_state_bytes, usable_memory
from merak_core.planner.search import ep_refusal
from tests.support.moe import MoEConfig, MoELlama

COMM = CommModel(p2p_latency_s=1e-5, p2p_bandwidth=1e6, allreduce_latency_s=2e-5, allreduce_bandwidth=1e7)
LAYERS = 4


def _dense(act: float = 40960.0) -> ModelProfile:
    return ModelProfile(
        layer_forward_s=[1e-3] * LAYERS,
        layer_backward_s=[2e-3] * LAYERS,
        layer_activation_bytes=[act] * LAYERS,
        layer_param_bytes=[1000.0] * LAYERS,
        boundary_bytes=4096.0,
        num_heads=4,
        num_kv_heads=1,  # tp=1 only
        vocab_size=64,
    )


def _moe(expert: float = 8000.0, param: float = 10000.0) -> ModelProfile:
    return dataclasses.replace(
        _dense(),
        layer_param_bytes=[param] * LAYERS,
        layer_expert_bytes=[expert] * LAYERS,
        layer_moe_blocks=[1] * LAYERS,
        num_experts=4,
        top_k=2,
    )


# ---------------------------------------------------------------------------- cp


def test_cp_is_chosen_only_when_cp1_does_not_fit_a_long_sequence() -> None:
    # 2 ranks, 2 samples per step: dp=2 (or pp=2) at cp=1, dp=1 x cp=2 at cp=2; the same compute per rank,
    # so cp=2 pays its ring passes for nothing unless the memory needs it.
    short = _dense()
    cands = plan(
        short, world_size=2, memory_per_device=1e12, global_batch_size=2, comm=COMM, cp_degrees=(1, 2)
    )
    assert cands[0].cp == 1
    assert min(c.step_time_s for c in cands if c.cp == 2) > cands[0].step_time_s
    long = _dense(act=4e6)  # a long sequence: its activations dwarf the weights
    at_cp1 = min(max(c.device_peak_bytes) for c in cands_of(long, (1,)))
    at_cp2 = min(max(c.device_peak_bytes) for c in cands_of(long, (1, 2)) if c.cp == 2)
    assert at_cp2 < at_cp1
    memory = (at_cp1 + at_cp2) / 2 / usable_memory(1.0)
    with pytest.raises(ValueError, match="nothing fits"):
        plan(long, world_size=2, memory_per_device=memory, global_batch_size=2, comm=COMM)
    chosen = plan(
        long, world_size=2, memory_per_device=memory, global_batch_size=2, comm=COMM, cp_degrees=(1, 2)
    )
    assert chosen[0].cp == 2 and chosen[0].training_fields()["cp"] == 2


def cands_of(profile: ModelProfile, cp_degrees: tuple[int, ...]) -> list:  # type: ignore[type-arg]
    return plan(
        profile, world_size=2, memory_per_device=1e15, global_batch_size=2, comm=COMM, cp_degrees=cp_degrees
    )


def test_layout_auto_offers_the_cp_degrees_the_model_and_the_batch_allow() -> None:
    from tests.support.models import GPT, DecoderConfig, Llama

    args = TrainingArguments(layout="auto")  # cp: 1, yet the planner may turn it on
    llama = Llama(DecoderConfig(num_layers=2, num_heads=4, num_kv_heads=2))
    tokens = torch.zeros(2, 16, dtype=torch.long)
    assert model_cp_degrees(llama, tokens, args, 4) == (1, 2, 4)
    assert model_cp_degrees(llama, tokens[:, :12], args, 4) == (1, 2)  # 12 tokens: 4 chunks, not 8
    assert model_cp_degrees(llama, tokens, args, 6) == (1, 2)  # cp divides the ranks
    ulysses = dataclasses.replace(args, cp_mode="ulysses")
    assert model_cp_degrees(llama, tokens, ulysses, 4) == (1, 2)  # 2 kv heads
    assert model_cp_degrees(llama, tokens, args, 4, loss_fn_given=True) == (1,)  # a custom loss is refused
    assert model_cp_degrees(llama, tokens, args, 4, compute_metrics_given=True) == (1,)
    assert model_cp_degrees(GPT(DecoderConfig(num_layers=2)), tokens, args, 4) == (1,)  # no cp hook
    padded = {"input_ids": tokens, "attention_mask": torch.ones_like(tokens)}
    padded["attention_mask"][0, -1] = 0
    assert model_cp_degrees(llama, padded, args, 2) == (1,)


# ---------------------------------------------------------------------------- ep


def test_ep_prices_the_experts_bytes_and_the_all_to_alls() -> None:
    prof = _moe()
    base = LayoutChoice(dp=4, tp=1, pp=1, schedule="1f1b", num_microbatches=1, micro_batch_size=2)
    one = predict(prof, base, comm=COMM)
    for ep in (2, 4):
        got = predict(prof, dataclasses.replace(base, ep=ep), comm=COMM)
        sent = all_to_all_bytes(2 * 4096.0, 2, ep, 1, 1.0)  # 2 samples' rows, top-2
        a2a = (ep - 1) * COMM.p2p_latency_s + sent / COMM.p2p_bandwidth + COMM.sync_wait_s
        # two all-to-alls per MoE block in forward, two in backward
        assert got.stage_forward_s[0] - one.stage_forward_s[0] == pytest.approx(2 * LAYERS * a2a, rel=1e-9)
        assert got.stage_backward_s[0] - one.stage_backward_s[0] == pytest.approx(2 * LAYERS * a2a, rel=1e-9)
        dense, experts = LAYERS * 2000.0, LAYERS * 8000.0
        held = sum(model_state_bytes(dense, zero_stage=0, dp=4)) + sum(
            model_state_bytes(experts / ep, zero_stage=0, dp=1)
        )
        assert got.peak_memory_bytes[0] - one.peak_memory_bytes[0] == pytest.approx(
            held - sum(model_state_bytes(dense + experts, zero_stage=0, dp=4)), rel=1e-12
        )
        assert got.layout == f"dp4-ep{ep}-tp1-pp1" and got.training_fields()["ep"] == ep
    zero1 = predict(prof, dataclasses.replace(base, ep=2, zero_stage=1), comm=COMM)
    plain1 = predict(prof, dataclasses.replace(base, zero_stage=1), comm=COMM)
    # ZeRO-1: the dense optimizer states over dp=4, the experts' (half of them here) over dp / ep = 2
    saved = 2 * LAYERS * 8000.0 / 4 - 2 * LAYERS * 4000.0 / 2 + LAYERS * 8000.0 * (1 + 1) / 2
    assert plain1.peak_memory_bytes[0] - zero1.peak_memory_bytes[0] == pytest.approx(saved, rel=1e-12)
    with pytest.raises(ValueError, match="ep must divide dp and the experts"):
        predict(prof, dataclasses.replace(base, dp=2, ep=4, micro_batch_size=4), comm=COMM)
    with pytest.raises(ValueError, match="ep must divide dp and the experts"):
        predict(_dense(), dataclasses.replace(base, ep=2), comm=COMM)


def test_the_search_asks_expert_parallelisms_own_refusals() -> None:
    from merak_core.parallel.expert_parallel import check_ep_arguments

    base = LayoutChoice(dp=4, tp=1, pp=2, schedule="1f1b", num_microbatches=2, micro_batch_size=1, ep=2)
    assert ep_refusal(base) is None and ep_refusal(dataclasses.replace(base, ep=1)) is None
    for field, value in (("virtual_stages", 2), ("cp", 2), ("zero_stage", 3)):
        choice = dataclasses.replace(base, **{field: value})
        probe = TrainingArguments(dp=4, pp=2, ep=1)
        setattr(probe, field, value)
        probe.ep = 2
        try:
            check_ep_arguments(probe)
            runs = True
        except ValueError:
            runs = False
        assert (ep_refusal(choice) is None) == runs, field  # whatever the runtime refuses today
    cands = plan(
        _moe(), world_size=4, memory_per_device=1e12, global_batch_size=4, comm=COMM, ep_degrees=(1, 2, 4)
    )
    assert {c.ep for c in cands} == {1, 2, 4}
    assert all(ep_refusal(c) is None and c.dp % c.ep == 0 for c in cands)
    assert {
        c.ep
        for c in plan(
            _dense(),
            world_size=4,
            memory_per_device=1e12,
            global_batch_size=4,
            comm=COMM,
            ep_degrees=(1, 2, 4),
        )
    } == {1}


def _reference_profile() -> tuple[ModelProfile, MoELlama]:
    torch.manual_seed(0)
    cfg = MoEConfig(num_kv_heads=1, hidden_size=32, expert_size=64, num_experts=4, top_k=2, num_layers=2)
    model = MoELlama(cfg)
    return profile_model(model, torch.randint(0, cfg.vocab_size, (2, 8)), repeats=1), model


def test_the_reference_moe_model_plans_ep_when_its_experts_do_not_fit_replicated() -> None:
    prof, model = _reference_profile()
    experts = sum(
        p.numel() * p.element_size() for layer in model.layers for p in layer.moe.experts.parameters()
    )
    assert prof.layer_expert_bytes is not None and sum(prof.layer_expert_bytes) == experts
    assert prof.layer_moe_blocks == [1, 1] and prof.num_experts == 4 and prof.top_k == 2
    kw = dict(world_size=4, global_batch_size=4, comm=COMM)
    every = plan(prof, memory_per_device=1e15, ep_degrees=(1, 2, 4), **kw)  # type: ignore[arg-type]
    need = {e: min(max(c.device_peak_bytes) for c in every if c.ep == e) for e in (1, 2, 4)}
    sharded = min(need[2], need[4])  # ep=2 also runs at pp=2 (half the dense layers), ep=4 at dp=4 only
    assert sharded < need[1]
    memory = (need[1] + sharded) / 2 / usable_memory(1.0)
    with pytest.raises(ValueError, match="nothing fits"):
        plan(prof, memory_per_device=memory, **kw)  # type: ignore[arg-type]
    chosen = plan(prof, memory_per_device=memory, ep_degrees=(1, 2, 4), **kw)  # type: ignore[arg-type]
    assert chosen[0].ep > 1 and all(c.ep > 1 for c in chosen)
    # No memory pressure: the first is the fastest predicted, and predict() gives each its own price.
    times = [float(f"{c.step_time_s:.9g}") for c in every]  # the ranking's key: ties within 9 digits
    assert times == sorted(times)  # go by the other keys (fewer tp, cp, ep ranks first)
    top = every[0]
    for ep in (1, 2, 4):
        if top.dp % ep == 0:
            again = predict(prof, dataclasses.replace(top.choice(), ep=ep), comm=COMM)
            assert again.step_time_s >= top.step_time_s
            if ep == top.ep:
                assert again.step_time_s == top.step_time_s


def test_layout_auto_offers_the_ep_degrees_the_model_allows() -> None:
    from merak_core.lora import LoraConfig
    from tests.support.models import DecoderConfig, Llama

    moe = MoELlama(MoEConfig())
    args = TrainingArguments(layout="auto")
    assert model_ep_degrees(moe, args, 4) == (1, 2, 4)
    assert model_ep_degrees(moe, args, 6) == (1, 2)  # ep divides the ranks (and the 4 experts: not 3, 6)
    assert model_ep_degrees(Llama(DecoderConfig(num_layers=1)), args, 4) == (1,)  # dense
    assert model_ep_degrees(moe, args, 4, lora=LoraConfig(r=2, target_modules=["q_proj"])) == (1,)


@pytest.mark.transformers
def test_a_transformers_moe_model_profiles_its_fused_experts_and_keeps_cp1_with_a_router_loss() -> None:
    tf = pytest.importorskip("transformers")
    common = dict(vocab_size=32, hidden_size=16, intermediate_size=16, num_hidden_layers=2)
    common.update(num_attention_heads=2, num_key_value_heads=2, num_experts_per_tok=2, num_local_experts=4)
    torch.manual_seed(0)
    model = tf.MixtralForCausalLM(tf.MixtralConfig(**common))
    tokens = torch.randint(0, 32, (2, 8))
    prof = profile_model(model, {"input_ids": tokens}, repeats=1)
    experts = [
        sum(p.numel() * p.element_size() for p in layer.mlp.experts.parameters())
        for layer in model.model.layers
    ]
    assert prof.layer_expert_bytes == experts and prof.layer_moe_blocks == [1, 1]
    assert (prof.num_experts, prof.top_k) == (4, 2)
    args = TrainingArguments(layout="auto")
    assert model_ep_degrees(model, args, 4) == (1, 2, 4)
    assert model_cp_degrees(model, {"input_ids": tokens}, args, 2) == (1, 2)
    model.config.output_router_logits, model.router_aux_loss_coef = True, 0.02
    assert model_cp_degrees(model, {"input_ids": tokens}, args, 2) == (
        1,
    )  # the aux loss needs whole sequences


def test_no_configuration_at_all_is_named_as_such() -> None:
    # One sample per step, one key/value head, 2 ranks: dp=2 needs 2 samples, pp=2 two microbatches, tp=2 two
    # kv heads; no memory figure could help (the message used to say "needs inf bytes").
    with pytest.raises(
        ValueError, match="nothing fits: no configuration of 2 ranks runs a global batch of 1"
    ):
        plan(_dense(), world_size=2, memory_per_device=1e12, global_batch_size=1, comm=COMM)
    assert plan(
        _dense(), world_size=2, memory_per_device=1e12, global_batch_size=1, comm=COMM, cp_degrees=(1, 2)
    )


def test_a_tiny_llama_with_a_long_sequence_plans_cp2_and_with_a_short_one_cp1() -> None:
    from tests.support.models import DecoderConfig, Llama

    # One layer (no pp=2) with one key/value head (no tp=2): at cp=1 a rank holds a whole sequence's
    # activations (dp=2); at cp=2 a microbatch holds half of one.
    torch.manual_seed(0)
    llama = Llama(DecoderConfig(num_layers=1, num_kv_heads=1, max_seq_len=512))
    args = TrainingArguments(layout="auto")
    kw = dict(world_size=2, global_batch_size=2, comm=COMM)
    for seq, pressed in ((512, True), (16, False)):
        tokens = torch.randint(0, 96, (2, seq))
        degrees = model_cp_degrees(llama, tokens, args, 2)
        assert degrees == (1, 2)  # the model has the cp hook and both lengths split into 4 chunks
        prof = profile_model(llama, tokens, repeats=1)
        every = plan(prof, memory_per_device=1e15, cp_degrees=degrees, **kw)  # type: ignore[arg-type]
        assert every[0].cp == 1  # no pressure: cp=2 does dp=2's work plus its ring passes
        if pressed:  # the activations dominate
            need = {c: min(max(x.device_peak_bytes) for x in every if x.cp == c) for c in (1, 2)}
            assert need[2] < need[1]
            memory = (need[1] + need[2]) / 2 / usable_memory(1.0)
            chosen = plan(prof, memory_per_device=memory, cp_degrees=degrees, **kw)  # type: ignore[arg-type]
            assert chosen[0].cp == 2 and {c.cp for c in chosen} == {2}


@pytest.mark.transformers
def test_the_planners_drop_pp_above_1_for_a_router_aux_loss() -> None:
    # The run refuses a transformers MoE model's router aux loss at pp > 1 (check_router_aux): layout: auto,
    # merak plan and the cluster model leave those candidates out (runnable_cp); without the loss pp > 1 stays.
    from types import SimpleNamespace

    from merak_core.planner.context_cost import runnable_cp

    tf = pytest.importorskip("transformers")
    common = dict(vocab_size=32, hidden_size=16, intermediate_size=16, num_hidden_layers=2)
    common.update(num_attention_heads=2, num_key_value_heads=2, num_experts_per_tok=2, num_local_experts=4)
    model = tf.MixtralForCausalLM(tf.MixtralConfig(**common))
    cands = [SimpleNamespace(cp=1, tp=1, pp=p, cp_mode="ring") for p in (2, 1)]
    assert [c.pp for c in runnable_cp(cands, model)] == [2, 1]
    model.config.output_router_logits, model.router_aux_loss_coef = True, 0.02
    assert [c.pp for c in runnable_cp(cands, model)] == [1]
    with pytest.raises(ValueError, match="refuses every fitting configuration.*router auxiliary loss.*pp=2"):
        runnable_cp(cands[:1], model)


def test_the_planners_drop_recomputation_for_a_protocol_blocks_router_aux_loss() -> None:
    from types import SimpleNamespace

    from merak_core.planner.context_cost import runnable_cp

    cands = [SimpleNamespace(cp=1, tp=1, pp=1, cp_mode="ring", recompute=r) for r in ("full", "none")]
    assert [c.recompute for c in runnable_cp(cands, MoELlama(MoEConfig()))] == ["full", "none"]
    aux = MoELlama(MoEConfig(router_aux_loss_coef=0.01))
    assert [c.recompute for c in runnable_cp(cands, aux)] == ["none"]  # the run refuses recompute with it


@pytest.mark.parametrize("bad", [0, -1, True, 2.0, "2", None])
def test_the_planners_share_one_count_check(bad: object) -> None:
    # plan, predict and plan_cluster refuse a count that is not an int >= 1 with one helper's message.
    from merak_core.planner.choices import check_counts
    from merak_core.planner.cluster import load_cluster
    from merak_core.planner.cluster_search import plan_cluster

    with pytest.raises(ValueError, match=rf"^where: n={bad!r}; expected an int >= 1$"):
        check_counts("where", (("ok", 1), ("n", bad)))
    with pytest.raises(ValueError, match=r"^plan: world_size=.*; expected an int >= 1$"):
        plan(_dense(), world_size=bad, memory_per_device=1e12, global_batch_size=1, comm=COMM)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^plan_cluster: num_nodes=.*; expected an int >= 1$"):
        plan_cluster(None, load_cluster("h100-sxm-8x"), num_nodes=bad, global_batch_size=1)  # type: ignore[arg-type]


@pytest.mark.parametrize("zero", [2, 3])
def test_zero2_and_zero3_with_ep_price_the_experts_over_their_replica_group(zero: int) -> None:
    # The run shards the experts over dp / ep ranks under ZeRO-2/3 (parallel/zero_experts.py); the profiled
    # planner prices that and its search proposes the pair.
    prof = _moe()
    base = LayoutChoice(
        dp=4, tp=1, pp=1, schedule="1f1b", num_microbatches=1, micro_batch_size=1, zero_stage=zero
    )
    got = predict(prof, dataclasses.replace(base, ep=2), comm=COMM)
    dense, experts = LAYERS * 2000.0, LAYERS * 8000.0
    unit = 10000.0  # the largest layer, ZeRO-3's gathered unit (in both groups' prices)
    held = sum(model_state_bytes(dense, zero_stage=zero, dp=4, largest_unit_bytes=unit)) + sum(
        model_state_bytes(experts / 2, zero_stage=zero, dp=2, largest_unit_bytes=unit)
    )
    one = predict(prof, base, comm=COMM)
    plain = sum(model_state_bytes(dense + experts, zero_stage=zero, dp=4, largest_unit_bytes=unit))
    assert got.peak_memory_bytes[0] - one.peak_memory_bytes[0] == pytest.approx(held - plain, rel=1e-12)
    cands = plan(
        prof, world_size=4, memory_per_device=1e12, global_batch_size=4, comm=COMM, zero_stage=zero,
        ep_degrees=(1, 2, 4),
    )  # fmt: skip
    assert {c.ep for c in cands if c.zero_stage == zero} == {1, 2, 4}
