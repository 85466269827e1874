"""Shard chains: boundaries line up, skip and broadcast values are carried, split points are honoured."""

from __future__ import annotations

import pytest
import torch

from merak_graph import PartitionError, annotate_costs, natural_shard_count, shard, trace
from tests.support.compare import assert_tensors_close
from tests.support.models import REFERENCE_MODELS, build_reference


def _traced(name: str, method: str = "fx"):  # type: ignore[no-untyped-def]
    model = build_reference(name)
    spec = REFERENCE_MODELS[name]
    inputs = spec.make_inputs(2, 8, 0)
    gm = trace(model, example_inputs=inputs, input_names=spec.input_names, method=method)
    annotate_costs(gm, inputs)
    return model, gm, inputs


@pytest.mark.parametrize("name", sorted(REFERENCE_MODELS))
def test_outputs_of_each_shard_are_inputs_of_the_next(name: str) -> None:
    model, gm, inputs = _traced(name, "export")
    sg = shard(gm, 6, model=model)
    assert len(sg.shards) == 6
    assert [b.name for b in sg.shards[0].inputs] == list(REFERENCE_MODELS[name].input_names)
    values = inputs
    for k, s in enumerate(sg.shards):
        out = s.module(*values)
        if k < len(sg.shards) - 1:
            assert isinstance(out, tuple)
            assert [b.name for b in s.outputs] == [b.name for b in sg.shards[k + 1].inputs]
            for b, v in zip(s.outputs, out, strict=True):
                assert isinstance(v, torch.Tensor), f"non-tensor {b.name} crosses a cut"
                assert tuple(v.shape) == b.shape and v.dtype == b.dtype
        values = out
    assert_tensors_close(values, model(*inputs), name="chain output")


def test_broadcast_mask_is_carried_not_recomputed() -> None:
    """BERT's additive mask is computed once in shard 0 and passed through every later boundary."""
    model, gm, inputs = _traced("bert", "fx")
    sg = shard(gm, 5, model=model)
    mask_producers = [k for k, s in enumerate(sg.shards) if "mul" in s.node_names]
    assert mask_producers == [0], "the mask is computed in exactly one shard"
    for s in sg.shards[:-2]:
        assert "mul" in [b.name for b in s.outputs]
    assert "attention_mask" not in [b.name for b in sg.shards[1].inputs]


def test_rotary_tables_pass_through_shards_that_do_not_use_them() -> None:
    """Llama's cos/sin tables skip the MLP-only shards: those shards forward them unchanged."""
    model, gm, inputs = _traced("llama", "fx")
    sg = shard(gm, natural_shard_count(gm), model=model)
    tables = {b.name for s in sg.shards[2:-1] for b in s.outputs if len(b.shape) == 2}
    assert len(tables) == 2, tables
    passed_through = 0
    for s in sg.shards[1:-1]:
        for node in s.module.graph.nodes:
            if node.op == "placeholder" and node.name in tables:
                users = list(node.users)
                if len(users) == 1 and users[0].op == "output":
                    passed_through += 1
    assert passed_through >= 2 * (model.config.num_layers - 1), "tables are forwarded by the MLP-only shards"
    assert_tensors_close(sg.run(*inputs), model(*inputs), name="output")


def test_split_points_override_automatic_cuts() -> None:
    model, gm, inputs = _traced("gpt", "fx")
    sg = shard(gm, split_points=["blocks.1", "blocks.3", "ln_f"], model=model)
    assert len(sg.shards) == 4
    assert sg.shards[1].node_names[0] == "blocks_1_ln_1"
    assert sg.shards[2].node_names[0] == "blocks_3_ln_1"
    assert sg.shards[3].node_names[0] == "ln_f"
    assert_tensors_close(sg.run(*inputs), model(*inputs), name="output")
    with pytest.raises(PartitionError, match="matches no module"):
        shard(gm, split_points=["blocks.9"], model=model)


def test_cuts_prefer_small_boundaries() -> None:
    """With one shard per natural cut, every GPT boundary is the residual stream only."""
    model, gm, inputs = _traced("gpt", "export")
    sg = shard(gm, model=model)
    residual = 2 * 8 * 32 * 8
    assert len(sg.shards) >= 2 * model.config.num_layers
    for s in sg.shards[:-1]:
        # The residual stream, plus at most the int64 position ids right after the embedding.
        assert sum(b.nbytes for b in s.outputs) <= residual + 8 * 8, [b.name for b in s.outputs]
    assert sum(len(s.outputs) == 1 for s in sg.shards[:-1]) >= 2 * model.config.num_layers


def test_shard_costs_add_up() -> None:
    model, gm, inputs = _traced("llama", "export")
    sg = shard(gm, 4, model=model)
    total = sum(n.meta["merak_cost"].flops for n in gm.graph.nodes if "merak_cost" in n.meta)
    assert sum(s.flops for s in sg.shards) == total > 0
    assert sum(s.param_bytes for s in sg.shards) == sum(p.numel() * 8 for p in model.parameters()) + sum(
        b.numel() * b.element_size() for b in model.buffers()
    )


def test_profiled_costs_replace_estimates_and_drive_partition() -> None:
    from merak_graph import empty_init, partition_sharded, profile_shards
    from tests.support.models import GPT

    with empty_init():
        meta = GPT()
    x = REFERENCE_MODELS["gpt"].make_inputs(2, 8, 0)
    gm = trace(meta, example_inputs=tuple(t.to("meta") for t in x), method="export")
    annotate_costs(gm, tuple(t.to("meta") for t in x))
    sg = shard(gm, model=meta)
    estimated = [s.time_s for s in sg.shards]
    measured = profile_shards(sg, x, device="cpu", repeats=2)
    assert len(measured) == len(sg.shards) and all(t > 0 for t in measured)
    assert [s.time_s for s in sg.shards] == measured != estimated
    part = partition_sharded(sg, 3, model=meta)
    assert abs(sum(part.stage_costs) - sum(measured)) < 1e-12
    assert all(p.is_meta for p in meta.parameters()), "profiling never materialises the model"


def test_partition_with_profiling_device() -> None:
    from merak_graph import partition

    model = build_reference("llama")
    spec = REFERENCE_MODELS["llama"]
    x = spec.make_inputs(2, 8, 0)
    part = partition(model, 2, example_inputs=x, input_names=spec.input_names, profile_device="cpu")
    assert all(s.time_s > 0 for s in part.shards)
    assert_tensors_close(part.run(*x), model(*x), name="output")
