"""empty_init builds on meta; materialize and build_stage restore real tensors (ties kept, only needed keys read)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from merak_graph import empty_init, is_meta_module, materialize, partition
from tests.graph._graph_support import run_stages
from tests.support.compare import assert_grads_match, assert_tensors_close, reference_step
from tests.support.models import (
    GPT,
    REFERENCE_MODELS,
    CNNConfig,
    Llama,
    ResNet,
    build_reference,
    init_like_gpt2,
)


class _Custom(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.full((3,), 2.0))
        self.register_buffer("table", torch.arange(6.0).reshape(2, 3))
        self.register_buffer("scratch", torch.zeros(3), persistent=False)


def test_everything_is_on_meta() -> None:
    with empty_init():
        models = [
            GPT(),
            Llama(),
            ResNet(CNNConfig(norm="batch")),
            _Custom(),
            nn.Conv1d(2, 3, 3),
            nn.LSTM(4, 4),
            nn.MultiheadAttention(8, 2),
        ]
    for m in models:
        tensors = [*m.parameters(), *m.buffers()]
        assert tensors and all(t.is_meta for t in tensors), type(m).__name__
        assert is_meta_module(m)
    gpt = models[0]
    assert gpt.lm_head.weight is gpt.wte.weight, "ties survive construction on meta"
    # Outside the context, construction is normal again.
    assert not nn.Linear(2, 2).weight.is_meta


def test_materialize_from_state_dict_keeps_ties_and_constructor_buffers() -> None:
    ref = build_reference("llama", dtype=torch.float32)
    with empty_init():
        torch.manual_seed(0)
        model = Llama()
    materialize(model, device="cpu", state_dict=ref.state_dict(), strict=True)
    assert not is_meta_module(model)
    # rope tables are non-persistent (not in the state dict): restored from the constructor's values.
    assert torch.equal(model.rope_cos, ref.rope_cos)
    x = REFERENCE_MODELS["llama"].make_inputs(2, 8, 0)
    assert_tensors_close(model(*x), ref(*x), name="logits")

    with empty_init():
        gpt = GPT()
    materialize(gpt, device="cpu", init_fn=init_like_gpt2)
    assert gpt.lm_head.weight is gpt.wte.weight
    assert abs(gpt.wte.weight.std().item() - 0.02) < 0.005, "init_fn was used"
    assert torch.equal(gpt.ln_f.weight, torch.ones_like(gpt.ln_f.weight))


def test_materialize_uses_reset_parameters_and_strict_reports_missing() -> None:
    with empty_init():
        m = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    with pytest.raises(ValueError, match="missing from the checkpoint"):
        materialize(m, device="cpu", state_dict={}, strict=True)
    with empty_init():
        m = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    materialize(m, device="cpu", state_dict={"0.bias": torch.full((4,), 7.0)})
    assert torch.equal(m[0].bias, torch.full((4,), 7.0)), "loaded tensor kept after reset_parameters"
    assert m[0].weight.abs().max() > 0 and torch.equal(m[1].running_var, torch.ones(4))


@pytest.mark.parametrize("name", ["gpt", "llama", "bert", "resnet"])
def test_meta_model_partitioned_then_stages_built_alone(name: str) -> None:
    spec = REFERENCE_MODELS[name]
    ref = build_reference(name)
    with empty_init():
        meta = spec.build().to(torch.float64)
    inputs = spec.make_inputs(2, 8, 0)
    labels = spec.make_labels(2, 8, 0)
    meta_inputs = tuple(x.to("meta") for x in inputs)
    part = partition(meta, 3, example_inputs=meta_inputs, input_names=spec.input_names)
    state = ref.state_dict()
    stages = [part.build_stage(i, device="cpu", state_dict=state) for i in range(3)]
    assert is_meta_module(meta), "partitioning and building stages never materialise the model"
    for stage in stages:
        assert not is_meta_module(stage)
    ref_out, ref_loss, ref_grads = reference_step(ref, inputs, labels, spec.loss)
    out, loss, grads = run_stages(part, stages, inputs, labels, spec.loss)
    assert_tensors_close(out, ref_out, name="output")
    assert_tensors_close(loss, ref_loss, name="loss")
    assert_grads_match(grads, ref_grads)


def test_build_stage_initialises_from_modules_when_no_checkpoint() -> None:
    with empty_init():
        meta = GPT()
    x = REFERENCE_MODELS["gpt"].make_inputs(2, 8, 0)
    part = partition(meta, 2, example_inputs=tuple(t.to("meta") for t in x), input_names=("input_ids",))
    last = part.build_stage(1, device="cpu", init_fn=init_like_gpt2)
    names = part.stage_parameter_names(1)
    head = [local for local, original in names.items() if original == "wte.weight"]
    assert head, "the tied head lives on the last stage"
    w = last.get_parameter(head[0])
    assert not w.is_meta and abs(w.std().item() - 0.02) < 0.005
    ln = [local for local, original in names.items() if original == "ln_f.weight"]
    assert torch.equal(last.get_parameter(ln[0]), torch.ones(32))
    first = part.build_stage(0, device="cpu")  # reset_parameters path
    assert not is_meta_module(first)


@pytest.mark.transformers  # runs in the nox session that installs the optional extras (safetensors)
def test_safetensors_reads_only_the_stage_tensors(tmp_path) -> None:  # type: ignore[no-untyped-def]
    safetensors_torch = pytest.importorskip("safetensors.torch")
    ref = build_reference("gpt")
    state = {k: v.contiguous() for k, v in ref.state_dict().items() if k != "lm_head.weight"}
    path = tmp_path / "gpt.safetensors"
    safetensors_torch.save_file(state, str(path))
    with empty_init():
        meta = GPT().to(torch.float64)
    spec = REFERENCE_MODELS["gpt"]
    inputs = spec.make_inputs(2, 8, 0)
    part = partition(
        meta, 3, example_inputs=tuple(t.to("meta") for t in inputs), input_names=spec.input_names
    )

    from merak_graph import empty as empty_mod

    reads: list[str] = []
    original_get = empty_mod._SafetensorsReader.get

    def spy(self, key):  # type: ignore[no-untyped-def]
        reads.append(key)
        return original_get(self, key)

    empty_mod._SafetensorsReader.get = spy  # type: ignore[method-assign]
    try:
        stage1 = part.build_stage(1, device="cpu", safetensors_path=str(path))
    finally:
        empty_mod._SafetensorsReader.get = original_get  # type: ignore[method-assign]
    expected = set(part.stage_parameter_names(1).values()) | set(part.stage_buffer_names(1).values())
    assert set(reads) == expected and len(reads) < len(state)
    for local, original in part.stage_parameter_names(1).items():
        assert torch.equal(stage1.get_parameter(local), state[original])
    stages = [part.build_stage(i, device="cpu", safetensors_path=str(path)) for i in range(3)]
    values = inputs
    for i, s in enumerate(stages):
        values = s(*values)
        values = values if i == 2 or isinstance(values, tuple) else (values,)
    assert_tensors_close(values.detach(), ref(*inputs).detach(), name="logits")


class _Scaled(nn.Module):
    """A module whose constructor computes a non-persistent buffer (as Gemma's scaled embedding)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 3))
        self.register_buffer("scale", torch.tensor(2.5), persistent=False)


class _Swapped(nn.Module):
    """What a tensor-parallel layer does to a meta module: a new object copying its (meta) buffer."""

    def __init__(self, original: _Scaled) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty_like(original.weight))
        self.register_buffer("scale", original.scale.detach().clone(), persistent=False)


def test_replaced_module_adopts_the_constructor_value_of_its_buffer() -> None:
    """[Note: replaced modules] Without adopt_constructor_buffers the swapped module had no value for its
    buffer; materialize left it as uninitialised memory (issue 24, Gemma's embedding scale at tp=2)."""
    from merak_graph import adopt_constructor_buffers, constructor_buffers

    with empty_init():
        model = nn.Sequential(_Scaled())
    remembered = constructor_buffers(model)
    assert set(remembered) == {"0.scale"} and float(remembered["0.scale"]) == 2.5
    model[0] = _Swapped(model[0])
    assert adopt_constructor_buffers(model, remembered) == ["0.scale"]
    materialize(model, device="cpu", init_fn=lambda m: None)
    assert float(model[0].scale) == 2.5


def test_a_buffer_nothing_gives_a_value_is_refused() -> None:
    """[Note: unset buffers] No state dict entry, no remembered value, an initialiser that leaves it: an
    error naming the buffer, not uninitialised memory."""
    with empty_init():
        model = nn.Sequential(_Scaled())
    model[0] = _Swapped(model[0])
    with pytest.raises(ValueError, match=r"buffer '0.scale' of _Swapped has no value after materialisation"):
        materialize(model, device="cpu", init_fn=lambda m: None)
    with empty_init():
        model = nn.Sequential(_Scaled())
    model[0] = _Swapped(model[0])

    def init(m: nn.Module) -> None:
        if isinstance(m, _Swapped):
            m.scale.fill_(3.0)

    materialize(model, device="cpu", init_fn=init)  # an initialiser that sets it is enough
    assert float(model[0].scale) == 3.0


def test_materialised_and_stage_parameters_keep_their_gradient_hooks() -> None:
    """[Note: gradient hooks] A hook registered on a meta parameter (TP's gradient sum of a replicated
    weight) runs on the parameter materialisation makes in its place, and on a built stage's copy."""
    with empty_init():
        model = GPT()
    for p in model.parameters():
        p.register_hook(lambda g: torch.zeros_like(g))
    x = REFERENCE_MODELS["gpt"].make_inputs(2, 8, 0)
    part = partition(model, 2, example_inputs=tuple(t.to("meta") for t in x), input_names=("input_ids",))
    stage = part.build_stage(1, device="cpu", init_fn=init_like_gpt2)
    materialize(model, device="cpu", init_fn=init_like_gpt2)
    for module in (model, stage):
        params = [p for p in module.parameters() if p.requires_grad]
        (sum((p * p).sum() for p in params)).backward()  # type: ignore[union-attr]
        for p in params:
            assert p.grad is not None and not p.grad.any()
