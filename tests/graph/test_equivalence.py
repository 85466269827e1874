"""Stage chains reproduce every reference model: outputs, loss and every gradient, float64.

For each reference model (GPT with tied embeddings, Llama, BERT with a
broadcast mask, a residual CNN), each tracer and 2, 3, 4 and 8 stages, the
stages are built as independent copies (``build_stage``), run as a pipeline
would run them (detached boundaries, boundary gradients passed back), and
compared with one forward/backward of the original model. Shared-parameter
groups must be exactly the tied embedding of GPT.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from merak_graph import annotate_costs, partition, partition_sharded, shard, trace
from tests.graph._graph_support import run_stages
from tests.support.compare import assert_grads_match, assert_tensors_close, reference_step
from tests.support.models import REFERENCE_MODELS, build_reference

MODELS = sorted(REFERENCE_MODELS)
BATCH, SEQ = 2, 8
_CACHE: dict[tuple[str, str], object] = {}


def _annotated(name: str, method: str):  # type: ignore[no-untyped-def]
    key = (name, method)
    if key not in _CACHE:
        model = build_reference(name)
        spec = REFERENCE_MODELS[name]
        inputs = spec.make_inputs(BATCH, SEQ, 0)
        gm = trace(model, example_inputs=inputs, input_names=spec.input_names, method=method)
        annotate_costs(gm, inputs)
        _CACHE[key] = (model, gm, inputs)
    return _CACHE[key]


def _expected_shared(name: str, num_stages: int) -> list[tuple[str, set[int]]]:
    return [("wte.weight", {0, num_stages - 1})] if name == "gpt" else []


@pytest.mark.parametrize("method", ["export", "fx"])
@pytest.mark.parametrize("num_stages", [2, 3, 4, 8])
@pytest.mark.parametrize("name", MODELS)
def test_stage_chain_matches_model(name: str, num_stages: int, method: str) -> None:
    model, gm, inputs = _annotated(name, method)  # type: ignore[misc]
    spec = REFERENCE_MODELS[name]
    labels = spec.make_labels(BATCH, SEQ, 0)
    ref_out, ref_loss, ref_grads = reference_step(model, inputs, labels, spec.loss)

    sharded = shard(gm, 8 * num_stages, model=model)
    part = partition_sharded(sharded, num_stages, method="cost", model=model)
    assert part.num_stages == num_stages
    assert all(len(s) >= 1 for s in part.stages)
    # Independent copies, as each pipeline rank would build its own stage.
    stages = [part.build_stage(i, device="cpu", state_dict=model.state_dict()) for i in range(num_stages)]
    for i, stage in enumerate(stages):
        for local, p in stage.named_parameters():
            assert all(p is not q for q in model.parameters()), f"stage {i} {local} aliases the model"

    out, loss, grads = run_stages(part, stages, inputs, labels, spec.loss)
    assert_tensors_close(out, ref_out, name=f"{name} output")
    assert_tensors_close(loss, ref_loss, name=f"{name} loss")
    assert_grads_match(grads, ref_grads)

    shared = [(g.name, {s for s, _ in g.stages}) for g in part.shared_parameters]
    assert shared == _expected_shared(name, num_stages)


@pytest.mark.parametrize("name", MODELS)
def test_partition_end_to_end_shares_model_tensors(name: str) -> None:
    """``partition`` on the model itself: stage modules hold the model's own tensors, by original names."""
    model = build_reference(name)
    spec = REFERENCE_MODELS[name]
    inputs = spec.make_inputs(BATCH, SEQ, 1)
    labels = spec.make_labels(BATCH, SEQ, 1)
    part = partition(model, 3, example_inputs=inputs, input_names=spec.input_names)
    ref_out, ref_loss, ref_grads = reference_step(model, inputs, labels, spec.loss)
    model.zero_grad(set_to_none=True)
    out = part.run(*inputs)
    spec.loss(out, labels).backward()
    assert_tensors_close(out.detach(), ref_out, name="output")
    by_name = dict(model.named_parameters())
    seen = set()
    for i in range(3):
        for local, original in part.stage_parameter_names(i).items():
            # Local names are '<shard>.<original-style fqn>' and point at the model's own tensor.
            assert part.stages[i].get_parameter(local) is by_name[original]
            seen.add(original)
        assert part.stage_info[i].time_s > 0
    assert seen == set(by_name), "every parameter is held by some stage"
    assert_grads_match({n: p.grad for n, p in model.named_parameters()}, ref_grads)


def test_gpt_tied_weight_names_and_holders() -> None:
    model = build_reference("gpt")
    spec = REFERENCE_MODELS["gpt"]
    inputs = spec.make_inputs(BATCH, SEQ, 0)
    part = partition(model, 4, example_inputs=inputs, input_names=spec.input_names, trace_method="fx")
    (group,) = part.shared_parameters
    assert group.name == "wte.weight"
    first, last = group.stages[0], group.stages[-1]
    assert first[0] == 0 and first[1].endswith("wte.weight")
    assert last[0] == 3 and last[1].endswith("lm_head.weight")  # fx keeps the head's own name
    assert part.stages[0].get_parameter(first[1]) is part.stages[3].get_parameter(last[1]) is model.wte.weight
    assert part.stage_parameter_names(3)[last[1]] == "wte.weight"


def test_untied_same_shape_weights_are_not_shared() -> None:
    """Detection is by identity, not shape: an untied head of the embedding's shape is not shared."""
    model = build_reference("gpt")
    model.lm_head.weight = torch.nn.Parameter(model.wte.weight.detach().clone())
    spec = REFERENCE_MODELS["gpt"]
    part = partition(model, 2, example_inputs=spec.make_inputs(BATCH, SEQ, 0), input_names=spec.input_names)
    assert part.shared_parameters == []


def test_keeping_only_returns_a_partition_of_the_kept_stages_and_leaves_the_result_unchanged() -> None:
    """What a pipeline rank holds once it built its stages: the others empty, no model reference; a
    partition is never changed in place."""
    model = build_reference("gpt")
    spec = REFERENCE_MODELS["gpt"]
    inputs = spec.make_inputs(BATCH, SEQ, 0)
    part = partition(model, 3, example_inputs=inputs, input_names=spec.input_names, trace_method="fx")
    built = part.build_stage(1, device="cpu")
    mine = part.keeping_only({1: built})
    assert mine.stages[1] is built and mine.model is None and mine.num_stages == 3
    assert [len(list(mine.stages[i].parameters())) for i in (0, 2)] == [0, 0]
    assert mine.stage_parameter_names(1) == part.stage_parameter_names(1)
    assert mine.input_names == part.input_names and mine.shared_parameters == part.shared_parameters
    assert part.model is model and part.stages[0] is not mine.stages[0], "the original is unchanged"
    assert len(list(part.stages[0].parameters())) > 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        part.model = None  # type: ignore[misc]
    with pytest.raises(ValueError, match=r"stage indices \[3\] are out of range for 3 stages"):
        part.keeping_only({3: built})
