"""Resume at every layout: a run saved at step k and resumed by a fresh Trainer equals the uninterrupted run.

Every layout of the trainer's equivalence matrix (``test_trainer_layouts.LAYOUTS``), ZeRO-1 off
and on (on wherever dp > 1), with the reference GPT; the reference Llama at one layout per axis and
all three axes with ZeRO-1; and the reference GPT with dropout 0.1
(where every random stream of every rank must come back): the losses after the resume and the
final parameters equal the uninterrupted run's bit for bit. Resharding (another layout reads
the checkpoint) into and out of tp > 1 with ZeRO off and on equals it to rounding (the
reduction order changes with the layout).

Each case is one call into the worker pool: 4 steps with checkpoints at 2 and 4, then a fresh
Trainer resumes step_2 and trains steps 3 and 4. The case ``gpt-dp2_tp2_pp2-zero0`` is the main
job's layout, whose resume failed at the first step (AdamW's ``exp_avg_sq`` loaded unsharded
after the 0-d ``step`` state took over the parameter's shard spec); every case also checks that
each optimizer state has its parameter's shape after loading.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.e2e import _checkpoint_support as support
from tests.e2e.test_trainer_layouts import LAYOUTS
from tests.support.compare import assert_tensors_close
from tests.support.dist import run_on_ranks

COMMON = dict(max_steps=4, save_steps=2, lr_scheduler_type="cosine")
LLAMA_LAYOUTS = [((1, 4, 1), 0), ((1, 1, 4), 0), ((2, 1, 2), 1), ((2, 2, 2), 1)]


def _cases() -> list[tuple[str, tuple[int, int, int], int]]:
    cases = [("gpt", layout, zero) for layout in LAYOUTS for zero in (0, 1) if not (zero and layout[0] == 1)]
    # The Llama-style model (untied embeddings, grouped-query attention) resumes through the same code:
    # one layout per axis and all three with ZeRO-1, not the whole matrix again (CI time).
    cases += [("llama", layout, zero) for layout, zero in LLAMA_LAYOUTS]
    # Dropout: the layouts of the reported mismatch (dp2 pp2, dp2, pp2), TP, and all three axes with ZeRO-1.
    cases += [("gpt_dropout", layout, 0) for layout in [(2, 1, 2), (2, 1, 1), (1, 1, 2), (1, 2, 1)]]
    cases += [("gpt_dropout", (2, 2, 2), 1)]
    return cases


def _id(case: tuple[str, tuple[int, int, int], int]) -> str:
    name, (dp, tp, pp), zero = case
    return f"{name}-dp{dp}_tp{tp}_pp{pp}-zero{zero}"


def _assert_states_equal(
    actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], what: str
) -> None:
    assert sorted(actual) == sorted(expected), what
    differ = [key for key in expected if not torch.equal(actual[key], expected[key])]
    assert not differ, f"{what}: not bit-identical: {differ}"


@pytest.mark.parametrize("case", _cases(), ids=_id)
def test_resume_is_bit_identical_at_every_layout(
    tmp_path: Path, case: tuple[str, tuple[int, int, int], int]
) -> None:
    name, (dp, tp, pp), zero = case
    kwargs = support.layout_kwargs(dp, tp, pp, output_dir=str(tmp_path), zero_stage=zero, **COMMON)
    results = run_on_ranks(dp * tp * pp, support.resume_pair_body, name, kwargs, 2)
    for rank, res in enumerate(results):
        assert res["resumed_step"] == 2
        assert res["bad_shapes"] == [], f"rank {rank}: optimizer states loaded with the wrong shape"
        assert sorted(res["losses"]) == [3, 4], rank
        for step in (3, 4):
            assert res["losses"][step] == res["full_losses"][step], (
                f"rank {rank} step {step}: not bit-identical"
            )
    head = results[0]
    _assert_states_equal(head["final_state"], head["full_state"], f"{_id(case)} final parameters")


def test_every_random_stream_comes_back_per_rank(tmp_path: Path) -> None:
    results = run_on_ranks(4, support.rng_streams_body, str(tmp_path))
    for rank, res in enumerate(results):
        saved, resumed = res["saved"], res["resumed"]
        assert torch.equal(resumed["torch"], saved["torch"]), rank
        assert torch.equal(resumed["tracker"], saved["tracker"]), rank
        assert (resumed["python"], resumed["numpy"]) == (saved["python"], saved["numpy"]), rank
    assert len({r["saved"]["python"] for r in results}) == 4  # the streams differ per rank


RESHARD = [  # (saving layout, its ZeRO stage, loading layout, its ZeRO stage)
    ((1, 2, 1), 0, (2, 1, 1), 1),  # out of tp > 1, ZeRO off -> on
    ((2, 2, 1), 1, (1, 2, 2), 0),  # tp > 1 to tp > 1, ZeRO on -> off
    ((2, 1, 2), 0, (1, 2, 1), 0),  # into tp > 1, ZeRO off
    ((2, 1, 1), 1, (2, 2, 2), 1),  # into tp > 1, ZeRO on
    ((2, 2, 2), 0, (1, 1, 1), 0),  # out of 3D, ZeRO off
]


# Every resharding case with the GPT-style model, the first two with the Llama-style one too.
RESHARD_CASES = [("gpt", case) for case in RESHARD] + [("llama", case) for case in RESHARD[:2]]


@pytest.mark.parametrize(
    "name,case",
    RESHARD_CASES,
    ids=lambda c: (
        c if isinstance(c, str) else "{}x{}x{}-zero{}_to_{}x{}x{}-zero{}".format(*c[0], c[1], *c[2], c[3])
    ),
)
def test_reshard_with_zero_off_and_on(tmp_path: Path, name: str, case: tuple) -> None:
    src, src_zero, dst, dst_zero = case
    kwargs = support.layout_kwargs(*src, output_dir=str(tmp_path), zero_stage=src_zero, **COMMON)
    full = run_on_ranks(src[0] * src[1] * src[2], support.train_body, name, kwargs)[0]
    step_2 = str(tmp_path / "checkpoints" / "step_2")
    saved = support.saved_state_body(step_2)
    other = support.layout_kwargs(*dst, output_dir=str(tmp_path / "resharded"), zero_stage=dst_zero, **COMMON)
    head = run_on_ranks(dst[0] * dst[1] * dst[2], support.train_body, name, other, step_2)[0]
    assert head["resumed_step"] == 2
    _assert_states_equal(head["loaded_state"], saved, f"logical parameters after loading under {dst}")
    for step in (3, 4):
        assert head["losses"][step] == pytest.approx(full["losses"][step], rel=1e-11, abs=1e-12), step
    for key, ref in full["final_state"].items():
        assert_tensors_close(
            head["final_state"][key], ref, name=f"{src}->{dst} final {key}", rtol=1e-8, atol=1e-10
        )
