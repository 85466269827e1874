"""Compiled stages with what compile refused before (issue 25 item 7): equal to eager within float32 rounding.

Each test trains the same layout eagerly and compiled (backend ``aot_eager``, as tests/core/test_compile.py,
3 steps of 2 microbatches) on the smallest world that has the feature, and compares the loss of every step
and every parameter (the adapters too) after them:

- virtual stages: ``compile: true`` at pp = 2 with 2 stages per rank (``interleaved_1f1b``), each of a
  rank's stages one region;
- LoRA: ``compile: regional`` on the reference Llama at tp = 2 with adapters on every linear, the adapters
  traced inside the compiled blocks (the TP base layers eager, [Note: TP layers stay eager]);
- ZeRO-3: ``compile: regional`` at dp = 2, each block compiled inside its FSDP2 unit (FSDP2's hooks are
  dynamo-disabled in torch: they run eagerly around the block's graph).
- sequence parallelism: ``compile: regional`` at tp = 2 with ``sequence_parallel``, its TP regions' compute
  traced, their bookkeeping not ([Note: compiled TP regions]); the blocks found though the first one's class
  is swapped;
- the same at tp = 2, pp = 2 (the stages traced by torch.export, then compiled);
- sub-pipelined TP: ``compile: regional`` at tp = 2 with ``overlap_chunks: 2``, the same way;
- context parallelism: ``compile: regional`` at cp = 2, ring and Ulysses (float64, the CP tests' run);
- expert parallelism: ``compile: regional`` at ep = 2 (float64, the EP tests' MoE Llama).

And the evidence for what stays refused: a split backward (``I`` then ``W``) runs a compiled region's
whole backward twice.

[Note: compiled stages] in merak_core.parallel.compile.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.support.compare import assert_tensors_close
from tests.support.dist import run_on_ranks


def _train(name: str, kwargs: dict[str, Any], lora: dict[str, Any] | None) -> tuple[list[float], Any, int]:
    """Run on every rank: (losses, full state dict on rank 0, graphs torch.compile made on this rank)."""
    import torch.distributed as dist
    from torch._dynamo.utils import counters

    from merak_core import Trainer
    from merak_core.lora import LoraConfig
    from tests.e2e._trainer_support import TokenDataset, build_model, make_args
    from tests.support.models import REFERENCE_MODELS

    torch._dynamo.reset()  # a fresh cache: a graph an earlier test left in this worker is not counted
    counters.clear()
    model = build_model(name)
    trainer = Trainer(
        model,
        make_args(**kwargs),
        TokenDataset(64, model.config.vocab_size),
        loss_fn=REFERENCE_MODELS[name].loss,
        lora=None if lora is None else LoraConfig(**lora),
    )
    losses = [h["loss"] for h in trainer.train()]
    state = trainer.full_state_dict()
    return losses, state if dist.get_rank() == 0 else None, counters["stats"]["unique_graphs"]


def _compiled_equals_eager(
    name: str, kwargs: dict[str, Any], world: int, lora: dict[str, Any] | None = None
) -> dict[str, Any]:
    base = dict(compile_backend="aot_eager", dtype="float32", max_steps=3, gradient_accumulation_steps=2)
    eager = run_on_ranks(world, _train, name, {**base, **kwargs, "compile": False}, lora, timeout_s=600)
    compiled = run_on_ranks(world, _train, name, {**base, **kwargs}, lora, timeout_s=600)
    assert all(graphs == 0 for *_, graphs in eager)
    assert all(graphs > 0 for *_, graphs in compiled), "no graph was compiled"
    (losses, state, _), (ref_losses, ref_state, _) = compiled[0], eager[0]
    assert len(losses) == 3 and losses[0] != losses[-1]
    assert losses == pytest.approx(ref_losses, rel=1e-6)  # aot_eager: bit-identical in practice
    assert sorted(state) == sorted(ref_state)
    for key, ref in ref_state.items():
        assert_tensors_close(state[key], ref, name=f"{name} {kwargs} {key}", rtol=1e-5, atol=1e-6)
    return state


def test_virtual_stages_compiled_equal_eager() -> None:
    """Each of a rank's two stages compiled as one region (4 stages on 2 ranks)."""
    _compiled_equals_eager("gpt", dict(compile=True, pp=2, virtual_stages=2, schedule="interleaved_1f1b"), 2)


def test_lora_regional_at_tp2_equals_eager() -> None:
    lora = dict(r=2, alpha=4, target_modules="all-linear")
    state = _compiled_equals_eager("llama", dict(compile="regional", tp=2), 2, lora)
    trained = [k for k in state if "lora_B" in k]
    assert trained and all(float(state[k].abs().max()) > 0 for k in trained), "the adapters did not train"


def test_zero3_regional_at_dp2_equals_eager() -> None:
    _compiled_equals_eager(
        "llama", dict(compile="regional", dp=2, zero_stage=3, per_device_train_batch_size=2), 2
    )


def test_sequence_parallel_regional_at_tp2_equals_eager() -> None:
    """Traced whole, the sequence-parallel TP regions summed later blocks' input gradients twice."""
    _compiled_equals_eager("llama", dict(compile="regional", tp=2, sequence_parallel=True), 2)


def test_sequence_parallel_regional_at_tp2_pp2_equals_eager() -> None:
    """A pipelined (torch.export-traced) stage with SP: its TP regions are leaves of the traced shards, run
    under export's flags while tracing (their untraced code runs as itself there) and compiled after."""
    _compiled_equals_eager("llama", dict(compile="regional", tp=2, pp=2, sequence_parallel=True), 4)


def test_sub_pipelined_tp_regional_at_tp2_equals_eager() -> None:
    """``overlap_chunks: 2``: each TP region runs its two chunks, their compute compiled."""
    _compiled_equals_eager("llama", dict(compile="regional", tp=2, overlap_chunks=2), 2)


def _train_cp(overrides: dict[str, Any]) -> tuple[float, Any, int]:
    """tests/e2e/test_context_parallel.py's run (its model, data, SGD, default loss) for 3 steps, and the
    graphs torch.compile made on this rank."""
    from torch._dynamo.utils import counters

    from tests.e2e.test_context_parallel import _train

    torch._dynamo.reset()  # a fresh cache: a graph an earlier test left in this worker is not counted
    counters.clear()
    loss, state = _train("reference4", {"cp": 2, "max_steps": 3, "compile_backend": "aot_eager", **overrides})
    return loss, state, counters["stats"]["unique_graphs"]


@pytest.mark.parametrize("mode", ["ring", "ulysses"])
def test_context_parallel_regional_at_cp2_equals_eager(mode: str) -> None:
    """float64; the CP exchange runs eagerly at a graph break (the active CP context is a ContextVar)."""
    eager = run_on_ranks(2, _train_cp, {"cp_mode": mode, "compile": False})
    compiled = run_on_ranks(2, _train_cp, {"cp_mode": mode, "compile": "regional"})
    assert all(graphs == 0 for *_, graphs in eager) and all(graphs > 0 for *_, graphs in compiled)
    assert compiled[0][0] == pytest.approx(eager[0][0], rel=1e-12)
    state, ref_state = compiled[0][1], eager[0][1]
    assert sorted(state) == sorted(ref_state)
    for key, ref in ref_state.items():
        assert_tensors_close(state[key], ref, name=f"cp {mode} {key}", rtol=1e-12, atol=1e-14)


def _train_ep(overrides: dict[str, Any]) -> tuple[list[float], Any, int]:
    """tests/e2e/test_expert_parallel.py's run (MoE Llama, SGD, float64) for 3 steps, and the graphs made."""
    from torch._dynamo.utils import counters

    from tests.e2e.test_expert_parallel import _train

    torch._dynamo.reset()  # a fresh cache: a graph an earlier test left in this worker is not counted
    counters.clear()
    losses, state = _train({"ep": 2, "max_steps": 3, "compile_backend": "aot_eager", **overrides})
    return losses, state, counters["stats"]["unique_graphs"]


def test_expert_parallel_regional_at_ep2_equals_eager() -> None:
    """The all-to-alls run eagerly at the graph break where the dispatch reads its split sizes."""
    eager = run_on_ranks(2, _train_ep, {"compile": False})
    compiled = run_on_ranks(2, _train_ep, {"compile": "regional"})
    assert all(graphs == 0 for *_, graphs in eager) and all(graphs > 0 for *_, graphs in compiled)
    assert len(compiled[0][0]) == 3 and compiled[0][0] == pytest.approx(eager[0][0], rel=1e-12)
    state, ref_state = compiled[0][1], eager[0][1]
    assert sorted(state) == sorted(ref_state)
    for key, ref in ref_state.items():
        assert_tensors_close(state[key], ref, name=f"ep {key}", rtol=1e-12, atol=1e-14)


def test_blocks_are_found_when_a_wrapper_swaps_the_first_ones_class() -> None:
    from merak_core.parallel.compile import repeated_blocks
    from tests.support.models import build_reference

    llama = build_reference("llama")
    first = llama.layers[0]
    first.__class__ = type("SequenceScatter[Block]", (type(first),), {})
    assert repeated_blocks(llama) == list(llama.layers)


def test_a_split_backward_would_run_a_compiled_regions_backward_twice() -> None:
    """Why zb_h1/zb_v stay refused (docs/compile.md): ``I`` then ``W`` on a compiled region are exact, but
    the region's one AOTAutograd backward node runs whole in each (two backwards instead of one split)."""
    import copy

    torch.manual_seed(0)
    eager = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 8))
    compiled = torch.compile(copy.deepcopy(eager), backend="aot_eager")
    x = torch.randn(4, 8, requires_grad=True)
    seed = torch.randn(4, 8)
    out = compiled(x)
    assert type(out.grad_fn).__name__ == "CompiledFunctionBackward"
    runs: list[int] = []
    out.grad_fn.register_prehook(lambda grads: runs.append(1))
    (grad_x,) = torch.autograd.grad([out], [x], [seed], retain_graph=True)  # I
    assert len(runs) == 1
    grad_w = torch.autograd.grad([out], list(compiled.parameters()), [seed])  # W
    assert len(runs) == 2, "torch now runs a compiled region's weight gradients alone: revisit the refusal"
    ref = torch.autograd.grad([eager(x)], [x, *eager.parameters()], [seed])
    assert torch.equal(grad_x, ref[0])
    assert all(torch.allclose(a, b, rtol=1e-6, atol=1e-7) for a, b in zip(grad_w, ref[1:], strict=True))
