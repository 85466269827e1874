"""ZeRO-2 and ZeRO-3 (FSDP2 over the DP axis) in the Trainer: the same math as one process, and resumes.

- Every layout of the trainer matrix with dp >= 2, ZeRO 2 and 3, with the reference GPT (the reference
  Llama at three of them): the losses
  of 3 steps and every parameter by name equal the single-process float64 reference (the check of
  ``test_trainer_layouts``; clipping at 0.5 is active, so the global norm over the DP-sharded
  gradients must be the global one).
- Resume at ZeRO 2/3 is bit-identical to the uninterrupted run (parameters, optimizer states, data
  position, random streams), and a checkpoint reshards across ZeRO stages and layouts
  (0/1 -> 2/3 and 2/3 -> 0/1): every ZeRO stage writes the same checkpoint.
- The model weights of a checkpoint load into a ZeRO-3 run (``load_full_state_dict``).
- ZeRO-3 with virtual stages (interleaved 1F1B, two stages per rank) equals one process too.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.e2e import _checkpoint_support as support
from tests.e2e.test_trainer_layouts import LAYOUTS, _check
from tests.support.compare import assert_tensors_close
from tests.support.dist import run_on_ranks

DP_LAYOUTS = [layout for layout in LAYOUTS if layout[0] >= 2]
COMMON = dict(max_steps=4, save_steps=2, lr_scheduler_type="cosine")


def _layout_id(layout: tuple[int, int, int]) -> str:
    return "dp{}_tp{}_pp{}".format(*layout)


# Every layout with dp >= 2 and both stages with the GPT-style model; the Llama-style one (untied
# embeddings, grouped-query attention: other parameter shapes to shard) at all three axes and dp=4.
MATCH = [("gpt", layout, zero) for layout in DP_LAYOUTS for zero in (2, 3)] + [
    ("llama", (2, 2, 2), 2),
    ("llama", (2, 2, 2), 3),
    ("llama", (4, 1, 1), 3),
]


@pytest.mark.parametrize(
    "name,layout,zero",
    MATCH,
    ids=lambda v: _layout_id(v) if isinstance(v, tuple) else v if isinstance(v, str) else f"zero{v}",
)
def test_zero23_matches_single_process(name: str, layout: tuple[int, int, int], zero: int) -> None:
    _check(name, *layout, zero_stage=zero)


RESUME = [("gpt", (2, 2, 2), 3), ("llama", (2, 1, 2), 2), ("llama", (4, 1, 1), 3), ("gpt", (2, 2, 1), 2)]


@pytest.mark.parametrize("case", RESUME, ids=lambda c: f"{c[0]}-{_layout_id(c[1])}-zero{c[2]}")
def test_zero23_resume_is_bit_identical(tmp_path: Path, case: tuple[str, tuple[int, int, int], int]) -> None:
    name, (dp, tp, pp), zero = case
    kwargs = support.layout_kwargs(dp, tp, pp, output_dir=str(tmp_path), zero_stage=zero, **COMMON)
    results = run_on_ranks(dp * tp * pp, support.resume_pair_body, name, kwargs, 2)
    for rank, res in enumerate(results):
        assert res["resumed_step"] == 2
        assert res["bad_shapes"] == [], f"rank {rank}: optimizer states loaded with the wrong shape"
        for step in (3, 4):
            assert res["losses"][step] == res["full_losses"][step], (
                f"rank {rank} step {step}: not bit-identical"
            )
    head = results[0]
    differ = [k for k, v in head["full_state"].items() if not torch.equal(head["final_state"][k], v)]
    assert sorted(head["final_state"]) == sorted(head["full_state"]) and not differ, differ


RESHARD = [  # (saving layout, its ZeRO stage, loading layout, its ZeRO stage)
    ((2, 1, 2), 3, (2, 1, 2), 1),  # ZeRO-3 -> ZeRO-1, same layout
    ((2, 2, 1), 0, (2, 2, 2), 3),  # ZeRO off -> ZeRO-3, into pp > 1
    ((4, 1, 1), 2, (2, 2, 1), 3),  # ZeRO-2 -> ZeRO-3, dp 4 -> 2, into tp > 1
    ((2, 2, 2), 3, (1, 1, 1), 0),  # ZeRO-3 3D -> one process
]


@pytest.mark.parametrize(
    "case", RESHARD, ids=lambda c: "{}x{}x{}-zero{}_to_{}x{}x{}-zero{}".format(*c[0], c[1], *c[2], c[3])
)
def test_zero23_checkpoints_reshard_across_zero_stages(tmp_path: Path, case: tuple) -> None:
    src, src_zero, dst, dst_zero = case
    kwargs = support.layout_kwargs(*src, output_dir=str(tmp_path), zero_stage=src_zero, **COMMON)
    full = run_on_ranks(src[0] * src[1] * src[2], support.train_body, "gpt", kwargs)[0]
    step_2 = str(tmp_path / "checkpoints" / "step_2")
    saved = support.saved_state_body(step_2)
    other = support.layout_kwargs(*dst, output_dir=str(tmp_path / "resharded"), zero_stage=dst_zero, **COMMON)
    head = run_on_ranks(dst[0] * dst[1] * dst[2], support.train_body, "gpt", other, step_2)[0]
    assert head["resumed_step"] == 2
    differ = [k for k, v in saved.items() if not torch.equal(head["loaded_state"][k], v)]
    assert sorted(head["loaded_state"]) == sorted(saved) and not differ, f"loaded under {dst}: {differ}"
    for step in (3, 4):
        assert head["losses"][step] == pytest.approx(full["losses"][step], rel=1e-11, abs=1e-12), step
    for key, ref in full["final_state"].items():
        assert_tensors_close(
            head["final_state"][key], ref, name=f"{src}->{dst} final {key}", rtol=1e-8, atol=1e-10
        )


def test_model_weights_load_into_a_zero3_run(tmp_path: Path) -> None:
    kwargs = support.layout_kwargs(2, 1, 1, output_dir=str(tmp_path), max_steps=2, save_steps=2)
    run_on_ranks(2, support.train_body, "gpt", kwargs)
    source = tmp_path / "checkpoints" / "step_2"
    other = support.layout_kwargs(2, 1, 2, output_dir=str(tmp_path / "zero3"), zero_stage=3, max_steps=2)
    loaded = run_on_ranks(4, support.load_weights_from_checkpoint_body, "gpt", other, str(source))[0]
    expected = support.saved_state_body(str(source))
    assert sorted(loaded) == sorted(expected) and all(torch.equal(loaded[k], expected[k]) for k in expected)


def test_zero3_with_virtual_stages_matches_single_process() -> None:
    """Two stages per rank (interleaved 1F1B, v=2): every stage module's units are sharded over DP."""
    _check(
        "gpt",
        2,
        1,
        2,
        zero_stage=3,
        virtual_stages=2,
        schedule="interleaved_1f1b",
        gradient_accumulation_steps=4,
    )
