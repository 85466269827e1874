"""The pipeline runtime against single-process references, on gloo worker pools of 2 and 4 ranks.

Every built-in schedule, for the GPT model (tied embeddings across the first and last stage,
synchronised by the shared-parameter groups) and the Llama model (tuple boundary, and a dict
boundary with a non-tensor constant), without recompute, with full recompute and with half
the units recomputed, over two steps whose sequence lengths differ: the loss and every
parameter gradient by name equal a float64 single-process run of the full batch.

Every test runs twice: with the gloo transport's distinct tags, and under NCCL's rules
(``nccl_rules=True``: every p2p op on tag 0, so gloo matches the messages of a pair in issue
order alone, like NCCL, and every batch yields one Work). In the second mode an order on which
two ranks disagree shows up as wrong gradients, a size mismatch or a timeout.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from merak_pipe import RecomputePlan
from tests.pipe import _runtime_bodies as bodies
from tests.support.compare import assert_tensors_close
from tests.support.dist import run_on_ranks

SCHEDULES = ["gpipe", "1f1b", "interleaved-1f1b", "shifted-critical-path", "zb-h1"]
MODELS = ["gpt", "llama", "llama-dict"]
RECOMPUTE = [None, "full", 0.5]
TRANSPORT = pytest.mark.parametrize("nccl_rules", [False, True], ids=["tags", "nccl-rules"])


def make_case(
    schedule: str,
    world: int,
    model: str,
    recompute: Any,
    *,
    seqs: tuple[int, ...] = (8, 6),
    num_microbatches: int = 4,
    batch: int = 8,
    **extra: Any,
) -> dict[str, Any]:
    """A test case (see ``_runtime_bodies``); ``extra`` may hold ``nccl_rules``."""
    num_stages = 2 * world if schedule == "interleaved-1f1b" else world
    return dict(
        model=model,
        schedule=schedule,
        num_stages=num_stages,
        num_microbatches=num_microbatches,
        recompute=recompute,
        seqs=list(seqs),
        batch=batch,
        **extra,
    )


def assert_matches(
    results: list[list[dict[str, Any]]],
    ref: list[dict[str, Any]],
    *,
    rtol: float | None = None,
    atol: float | None = None,
) -> None:
    """Per step: exactly one rank returns the loss and it matches; every gradient matches by name."""
    for step, expected in enumerate(ref):
        losses = [rank_res[step]["loss"] for rank_res in results if rank_res[step]["loss"] is not None]
        assert len(losses) == 1, f"step {step}: {len(losses)} ranks returned a loss, expected exactly 1"
        assert_tensors_close(losses[0], expected["loss"], name=f"step {step} loss", rtol=rtol, atol=atol)
        seen: set[str] = set()
        for rank, rank_res in enumerate(results):
            for name, grad in rank_res[step]["grads"].items():
                assert_tensors_close(
                    grad,
                    expected["grads"][name],
                    name=f"step {step} rank {rank} grad[{name}]",
                    rtol=rtol,
                    atol=atol,
                )
                seen.add(name)
        missing = sorted(set(expected["grads"]) - seen)
        assert not missing, f"step {step}: no rank produced gradients for {missing}"


@TRANSPORT
@pytest.mark.parametrize("recompute", RECOMPUTE, ids=lambda r: f"recompute={r}")
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_step_matches_single_process(
    schedule: str, world: int, model: str, recompute: Any, nccl_rules: bool
) -> None:
    case = make_case(schedule, world, model, recompute, nccl_rules=nccl_rules)
    results = run_on_ranks(world, bodies.train_body, case)
    assert_matches(results, bodies.reference(case))


@TRANSPORT
@pytest.mark.parametrize("world", [2, 4])
def test_tied_embedding_copies_agree(world: int, nccl_rules: bool) -> None:
    """Both copies of the tied GPT embedding hold the full (summed) gradient after the step."""
    case = make_case("1f1b", world, "gpt", None, seqs=(8,), nccl_rules=nccl_rules)
    results = run_on_ranks(world, bodies.train_body, case)
    holders = [r[0]["grads"]["wte.weight"] for r in results if "wte.weight" in r[0]["grads"]]
    assert len(holders) == 2
    assert_tensors_close(holders[0], holders[1], name="wte.weight copies")
    assert_tensors_close(holders[0], bodies.reference(case)[0]["grads"]["wte.weight"], name="wte.weight")


@TRANSPORT
def test_shifted_critical_path_with_a_later_stage_recomputing_more(nccl_rules: bool) -> None:
    """Stage 1 recomputes everything, stage 0 nothing: the warm-up depths are cut so it runs (it deadlocked)."""
    case = make_case(
        "shifted-critical-path",
        4,
        "gpt",
        RecomputePlan((0.0, 1.0, 0.0, 0.0)),
        seqs=(8,),
        num_microbatches=8,
        nccl_rules=nccl_rules,
    )
    results = run_on_ranks(4, bodies.train_body, case)
    assert_matches(results, bodies.reference(case))


@TRANSPORT
def test_buffers_reused_across_steps_and_shapes(nccl_rules: bool) -> None:
    """Shapes change (8 -> 6) and repeat (6 -> 6 -> 8): headers re-sent only on change, pooled buffers reused."""
    case = make_case(
        "1f1b", 2, "llama-dict", 0.5, seqs=(8, 6, 6, 8), num_microbatches=2, batch=4, nccl_rules=nccl_rules
    )
    results = run_on_ranks(2, bodies.train_body, case)
    assert_matches(results, bodies.reference(case))
    for rank_results in results:
        assert all(p == [] for step in rank_results for p in step["pending"])  # no autograd state kept
        # Steps 0 and 1 allocate (new shapes); steps 2 and 3 repeat earlier shapes and reuse.
        allocated = [step["allocated"] for step in rank_results]
        assert allocated[0] > 0 and allocated[1] > allocated[0], allocated
        assert allocated[3] == allocated[1], allocated
        assert rank_results[3]["reused"] > 0


@TRANSPORT
def test_more_microbatches_than_stages_and_sum_reduction(nccl_rules: bool) -> None:
    case = make_case(
        "1f1b",
        2,
        "gpt",
        "full",
        seqs=(8,),
        num_microbatches=8,
        batch=8,
        loss_reduction="sum",
        nccl_rules=nccl_rules,
    )
    results = run_on_ranks(2, bodies.train_body, case)
    assert_matches(results, bodies.reference(case))


@TRANSPORT
@pytest.mark.parametrize("schedule", ["1f1b", "shifted-critical-path", "zb-h1"])
def test_recompute_restores_rng_for_dropout(schedule: str, nccl_rules: bool) -> None:
    """With dropout, recomputing (explicit R, or inside B/I) gives exactly the run without recompute."""
    case = make_case(schedule, 2, "gpt", "full", seqs=(8,), dropout=0.2, seed=1234, nccl_rules=nccl_rules)
    with_recompute = run_on_ranks(2, bodies.dropout_body, case, False)
    without = run_on_ranks(2, bodies.dropout_body, case, True)
    for rank, (got, expected) in enumerate(zip(with_recompute, without, strict=True)):
        step_got, step_expected = got[0], expected[0]
        assert (step_got["loss"] is None) == (step_expected["loss"] is None)
        if step_got["loss"] is not None:
            assert_tensors_close(step_got["loss"], step_expected["loss"], name="loss", rtol=0.0, atol=0.0)
        assert step_got["grads"].keys() == step_expected["grads"].keys()
        for name, grad in step_got["grads"].items():
            assert_tensors_close(
                grad, step_expected["grads"][name], name=f"rank {rank} grad[{name}]", rtol=1e-12, atol=1e-14
            )
    # Dropout really was active: the loss differs from the dropout-free reference.
    loss = next(r[0]["loss"] for r in with_recompute if r[0]["loss"] is not None)
    assert not torch.allclose(loss, bodies.reference(case)[0]["loss"])


@TRANSPORT
@pytest.mark.parametrize("model", ["gpt", "llama-dict"])
def test_evaluate_matches_forward(model: str, nccl_rules: bool) -> None:
    case = make_case("1f1b", 2, model, "full", seqs=(7,), nccl_rules=nccl_rules)
    results = run_on_ranks(2, bodies.evaluate_body, case)
    assert results[0]["evaluate"] is None and results[0]["step_loss"] is None
    loss, outputs = results[1]["evaluate"]
    again_loss, again_outputs = results[1]["again"]
    assert_tensors_close(again_outputs, outputs, name="second evaluate outputs", rtol=0.0, atol=0.0)
    assert_tensors_close(results[1]["step_loss"], loss, name="step loss vs evaluate loss")
    ref_model = bodies.build_model(model, num_layers=bodies.layers_for(2))
    ids, labels = bodies.batch_for(case, 0, 7)
    with torch.no_grad():
        expected = ref_model(ids)
    assert_tensors_close(outputs, expected, name="evaluate outputs")
    assert_tensors_close(loss, bodies.lm_loss(expected, labels), name="evaluate loss")


@TRANSPORT
def test_pipelines_on_subgroups(nccl_rules: bool) -> None:
    """Two 2-stage pipelines side by side in a world of 4 (groups {0, 2} and {1, 3})."""
    case = make_case("1f1b", 2, "gpt", None, seqs=(8, 6), nccl_rules=nccl_rules)
    results = run_on_ranks(4, bodies.subgroup_body, case)
    ref = bodies.reference(case)
    assert_matches([results[0], results[2]], ref)
    assert_matches([results[1], results[3]], ref)


@TRANSPORT
@pytest.mark.parametrize("model,recompute", [("gpt", None), ("llama-dict", "full"), ("llama", 0.5)])
def test_user_registered_v_schedule_hands_over_locally(model: str, recompute: Any, nccl_rules: bool) -> None:
    """Two stages per rank in a V (0 and 3 on rank 0, 1 and 2 on rank 1): local hand-over between stages."""
    case = dict(
        model=model,
        schedule="test-v-gpipe",
        num_stages=4,
        num_microbatches=4,
        recompute=recompute,
        seqs=[8, 6],
        batch=8,
        nccl_rules=nccl_rules,
    )
    results = run_on_ranks(2, bodies.registered_v_body, case)
    assert_matches(results, bodies.reference(case))


@TRANSPORT
@pytest.mark.parametrize("lowered", [False, True], ids=["compute-only", "with-comms"])
def test_schedule_from_csv(lowered: bool, nccl_rules: bool) -> None:
    case = make_case("interleaved-1f1b", 2, "llama", "full", seqs=(8,), nccl_rules=nccl_rules)
    results = run_on_ranks(2, bodies.csv_body, case, lowered)
    assert_matches(results, bodies.reference(case))
