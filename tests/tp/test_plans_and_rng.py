"""Plans, errors, fx leaves and the RNG tracker."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import merak_tp
from merak_tp.shard_spec import has_shard_spec
from tests.support.dist import run_on_ranks
from tests.support.models import GPT, DecoderConfig, Llama, ResNet
from tests.tp import _bodies as B


def test_plan_lookup_and_registry() -> None:
    assert merak_tp.plan_for_model(GPT(DecoderConfig(num_layers=1))).name == "gpt"
    assert merak_tp.plan_for_model(Llama(DecoderConfig(num_layers=1, num_kv_heads=2))).name == "llama"
    with pytest.raises(ValueError, match="no built-in TP plan for ResNet"):
        merak_tp.plan_for_model(ResNet())
    with pytest.raises(ValueError, match="unknown TP plan 'nope'"):
        merak_tp.get_plan("nope")
    with pytest.raises(ValueError, match="unknown styles"):
        merak_tp.TPPlan(name="bad", layers={"fc": "diagonal"})
    plan = merak_tp.TPPlan(name="test_registry_plan", layers={"fc1": "column", "fc2": "row"})
    merak_tp.register_plan(plan, classes=(B.MLPBlock,))
    with pytest.raises(ValueError, match="exists"):
        merak_tp.register_plan(plan)
    assert merak_tp.plan_for_model(B.MLPBlock()).name == "test_registry_plan"

    # A user class that shares a registered class's name gets no plan by accident.
    namesake = type("GPT", (nn.Module,), {})
    with pytest.raises(ValueError, match="no built-in TP plan for GPT"):
        merak_tp.plan_for_model(namesake())


def test_single_process_parallelize_is_the_identity() -> None:
    """Without a process group (TP = 1) the layers are swapped and the math is unchanged."""
    torch.manual_seed(0)
    ref = GPT(DecoderConfig(num_layers=1)).double()
    model = merak_tp.parallelize(copy.deepcopy(ref), group=None)
    assert isinstance(model.blocks[0].attn.q_proj, merak_tp.ColumnParallelLinear)
    assert model.lm_head.weight is model.wte.weight
    ids = torch.randint(0, 96, (2, 5))
    torch.testing.assert_close(model(ids), ref(ids), rtol=0, atol=0)
    assert {n for n, _ in model.named_parameters()} == {n for n, _ in ref.named_parameters()}
    assert all(has_shard_spec(p) for p in model.parameters())


def test_errors_name_the_module_and_the_fix() -> None:
    with pytest.raises(ValueError, match="matched no module"):
        merak_tp.parallelize(
            nn.Sequential(nn.Linear(2, 2)), merak_tp.TPPlan(name="x", layers={"fc": "column"}), group=None
        )
    with pytest.raises(ValueError, match="needs an nn.Linear"):
        merak_tp.parallelize(
            nn.Sequential(nn.ReLU()), merak_tp.TPPlan(name="x", layers={"0": "column"}), group=None
        )
    with pytest.raises(ValueError, match="overlap_chunks=0"):
        merak_tp.parallelize(GPT(DecoderConfig(num_layers=1)), group=None, overlap_chunks=0)


def test_non_divisible_sizes_raise_before_changing_anything() -> None:
    assert "num_kv_heads=2 is not divisible by the tensor-parallel size 4" in run_on_ranks(4, _kv_body)[0]


def _kv_body() -> str:
    model = Llama(DecoderConfig(num_layers=1, num_kv_heads=2))
    before = [type(m) for m in model.modules()]
    try:
        merak_tp.parallelize(model, group=torch.distributed.group.WORLD)
    except ValueError as err:
        assert [type(m) for m in model.modules()] == before, "model changed before the error"
        return str(err)
    raise AssertionError("no error")


@pytest.mark.parametrize(("chunks", "sp"), [(1, False), (2, False), (1, True)])
def test_fx_traces_parallelized_model_with_tp_leaves(chunks: int, sp: bool) -> None:
    targets = run_on_ranks(2, B.fx_body, 2, chunks, sp)[0]
    expected = {(1, False): "blocks.0.attn.q_proj", (2, False): "blocks.0.attn", (1, True): "blocks.1.attn"}
    assert expected[(chunks, sp)] in targets, targets
    assert "lm_head" in targets and "wte" in targets


def test_rng_tracker_and_sharded_dropout() -> None:
    assert all(run_on_ranks(2, B.rng_body, 2))
    assert all(run_on_ranks(4, B.rng_body, 4))


def test_parallelized_model_deep_copies() -> None:
    assert all(run_on_ranks(2, B.deepcopy_body, 2))


@pytest.mark.parametrize(("tp", "chunks"), [(2, 1), (2, 2), (4, 1)])
def test_dropout_with_rng_tracker(tp: int, chunks: int) -> None:
    assert all(run_on_ranks(tp, B.dropout_body, tp, chunks))
