"""Compiled stages (``training.compile``): equal to eager within float32 rounding, refused by name where they cannot run.

- the values and their job-file spellings; what compile refuses (pure, no process group);
- a traced stage compiled per unit (partial recomputation) and whole (none, full) equals eager (one process);
- against the eager run of the same layout, 5 steps, the loss of every step and every parameter:
  ``compile: true`` at dp2 x pp2 with full recomputation, ``compile: regional`` on the reference Llama
  at tp=2; dp2 x tp2 x pp2 (8 ranks) by hand only (``MERAK_TEST_COMPILE_3D=1``: about two minutes of
  compiling on the 2-core CI machine, over the suite's budget; its result is in docs/compile.md).

The backend is ``aot_eager`` (torch's graph capture and AOTAutograd without code generation): inductor
builds C++ kernels, about a minute per rank on this machine, too slow for the suite; it was run by hand
(docs/compile.md). [Note: compiled stages] in merak_core.parallel.compile.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from merak_core.config import TrainingArguments
from merak_core.parallel.compile import compile_mode, compile_stage, repeated_blocks
from tests.e2e._trainer_support import train_on_ranks
from tests.support.compare import assert_tensors_close
from tests.support.dist import run_on_ranks


def test_values_and_job_file_spellings() -> None:
    assert [compile_mode(v) for v in (True, False, "true", "False", " Regional ")] == [
        True,
        False,
        True,
        False,
        "regional",
    ]
    assert TrainingArguments(compile="regional").compile == "regional"
    assert TrainingArguments(compile="true", compile_backend="aot_eager").compile is True
    with pytest.raises(ValueError, match=r"compile='fast' is invalid: expected true .* regional .* false"):
        TrainingArguments(compile="fast")
    with pytest.raises(ValueError, match=r"compile_backend='nope' is not a torch.compile backend"):
        TrainingArguments(compile=True, compile_backend="nope")


_VIRTUAL = {"zb_h1": 1, "zb_v": 2}


@pytest.mark.parametrize("schedule", sorted(_VIRTUAL))
def test_split_backward_schedules_are_refused_by_name(schedule: str) -> None:
    with pytest.raises(
        ValueError, match=rf"compile with schedule='{schedule}' is not supported: .*I and W.*1f1b"
    ):
        TrainingArguments(compile=True, schedule=schedule, pp=2, virtual_stages=_VIRTUAL[schedule])
    TrainingArguments(
        compile=False, schedule=schedule, pp=2, virtual_stages=_VIRTUAL[schedule]
    )  # eager: fine


@pytest.mark.parametrize(
    "others",
    [
        {"virtual_stages": 2, "schedule": "interleaved_1f1b", "pp": 2},
        {"sequence_parallel": True, "tp": 2},
        {"overlap_chunks": 2, "tp": 2},
        {"cp": 2},
        {"ep": 2},
        {"zero_stage": 2},
        {"zero_stage": 3},
    ],
)
def test_lifted_combinations_are_accepted(others: dict) -> None:
    """Compiled stages run these (tests/core/test_compile_lifted.py proves them equal to eager)."""
    for mode in (True, "regional"):
        assert TrainingArguments(compile=mode, compile_backend="aot_eager", **others).compile == mode


def test_lora_is_accepted() -> None:
    from merak_core.lora import LoraConfig
    from merak_core.lora.config import check_lora_arguments

    lora = LoraConfig(r=2, target_modules=["q"])
    for mode in (False, True, "regional"):
        check_lora_arguments(tp=2, dp=2, args=TrainingArguments(compile=mode), config=lora)


def test_regional_finds_the_repeated_blocks_and_refuses_a_model_without() -> None:
    from tests.support.models import build_reference

    gpt = build_reference("gpt")
    assert repeated_blocks(gpt) == list(gpt.blocks)
    with pytest.raises(ValueError, match="found no repeated blocks in Linear.*compile: true"):
        compile_stage(torch.nn.Linear(2, 2), "regional", backend="eager")


def test_per_unit_regions_keep_partial_recomputation_exact() -> None:
    """``true`` with a partial recomputation compiles each unit (the checkpoint cuts between them): forward,
    recompute and backward of a stage of units equal eager."""
    import copy

    from merak_pipe import PipelineStage
    from tests.support.models import REFERENCE_MODELS, build_reference

    torch.manual_seed(0)
    model = build_reference("gpt", dtype=torch.float32)
    # A last stage as a chain of units (what a traced stage is, without the tracing's cost).
    stage = torch.nn.Sequential(*model.blocks, torch.nn.Sequential(model.ln_f, model.lm_head))
    hidden = torch.randn(2, 8, model.config.hidden_size)
    labels = torch.randint(0, model.config.vocab_size, (2, 8))

    def run(module: torch.nn.Module, fraction: float, compiled: bool) -> tuple[Any, ...]:
        module = copy.deepcopy(module)
        n = len(module)
        runs = (
            compile_stage(module, True, backend="aot_eager", checkpointed_units=round(fraction * n))
            if compiled
            else module
        )
        assert isinstance(runs, torch.nn.Sequential) == (not compiled or 0 < fraction < 1)
        st = PipelineStage(runs, stage_index=1, num_stages=2)
        x = hidden.clone().requires_grad_(True)
        _, loss = st.forward(
            0, (x,), {}, recompute_fraction=fraction, loss_fn=REFERENCE_MODELS["gpt"].loss, labels=labels
        )
        (grad_x,) = st.backward(0, None)
        return loss, grad_x, {k: p.grad for k, p in module.named_parameters()}

    from torch._dynamo.utils import counters

    counters.clear()
    loss, grad_x, grads = run(stage, 0.5, True)  # one region per stage: the dp2 x pp2 test below
    assert counters["stats"]["unique_graphs"] > 0, "no graph was compiled"
    ref_loss, ref_grad_x, ref_grads = run(stage, 0.5, False)
    assert torch.equal(loss, ref_loss) and torch.equal(grad_x, ref_grad_x)
    assert grads.keys() == ref_grads.keys() and all(torch.equal(grads[k], ref_grads[k]) for k in grads)


def test_a_planner_chosen_split_backward_schedule_is_refused_on_the_ranks() -> None:
    from merak_core.parallel.compile import compile_stages

    args = TrainingArguments(compile=True, compile_backend="aot_eager", pp=2)
    with pytest.raises(ValueError, match="compile with schedule='zb-h1' is not supported"):
        compile_stages({0: torch.nn.Linear(2, 2)}, args, recompute=None, schedule="zb-h1")


def train_counting(name: str, kwargs: dict[str, Any]) -> tuple[list[float], Any, int]:
    """``train_on_ranks`` and the number of graphs torch.compile made on this rank."""
    from torch._dynamo.utils import counters

    counters.clear()
    losses, state = train_on_ranks(name, kwargs)
    return losses, state, counters["stats"]["unique_graphs"]


def _compiled_equals_eager(name: str, kwargs: dict[str, Any], world: int) -> None:
    """The compiled run and the eager run of one layout: losses of 5 steps and every parameter after them."""
    base = dict(compile_backend="aot_eager", dtype="float32", max_steps=5, gradient_accumulation_steps=2)
    eager = run_on_ranks(world, train_counting, name, {**base, **kwargs, "compile": False}, timeout_s=600)
    compiled = run_on_ranks(world, train_counting, name, {**base, **kwargs}, timeout_s=600)
    assert all(graphs == 0 for _, _, graphs in eager)
    assert all(graphs > 0 for _, _, graphs in compiled), "no graph was compiled"
    losses, state, _ = compiled[0]
    ref_losses, ref_state, _ = eager[0]
    assert len(losses) == 5
    assert losses == pytest.approx(ref_losses, rel=1e-6)  # aot_eager: bit-identical in practice
    assert sorted(state) == sorted(ref_state)
    for key, ref in ref_state.items():
        assert_tensors_close(state[key], ref, name=f"{name} {kwargs} param {key}", rtol=1e-5, atol=1e-6)


def test_compiled_stages_with_dp_pp_and_full_recompute_equal_eager() -> None:
    """One region per stage at dp2 x pp2 (the DP hooks on the compiled stages' parameters, the checkpointed
    stage recomputed through its compiled region)."""
    _compiled_equals_eager("gpt", dict(compile=True, dp=2, pp=2, recompute="full"), 4)


def test_regional_llama_at_tp2_equals_eager() -> None:
    """Each TP-sharded Llama block compiled (its TP layers eager, [Note: TP layers stay eager])."""
    _compiled_equals_eager("llama", dict(compile="regional", tp=2), 2)


@pytest.mark.skipif(
    os.environ.get("MERAK_TEST_COMPILE_3D") != "1",
    reason="8 ranks compiling take ~2 min on the 2-core CI machine: run by hand with MERAK_TEST_COMPILE_3D=1",
)
def test_compiled_stages_at_2x2x2_equal_eager() -> None:
    _compiled_equals_eager("gpt", dict(compile=True, dp=2, tp=2, pp=2, recompute="full"), 8)


def test_a_job_file_is_refused_before_torchrun() -> None:
    """``merak train`` reads the job (``JobConfig.from_yaml``) before it starts torchrun: the refusal is there."""
    from pathlib import Path

    from merak_core.job import JobConfig

    demo = Path(__file__).resolve().parents[2] / "examples/addition/config.yaml"
    job = JobConfig.from_yaml(demo, ["training.compile=regional", "training.compile_backend=aot_eager"])
    assert job.training.compile == "regional"
    with pytest.raises(ValueError, match="compile with schedule='zb_h1' is not supported"):
        JobConfig.from_yaml(demo, ["training.compile=true", "training.schedule=zb_h1"])
