"""No host stall in the step ([Note: device-side skip] in merak_core.run.nonfinite).

With an optimizer that drops an update on the device (torch's fused AdamW: the default on CUDA, usable
on CPU) and ``nonfinite: stop``, a step reads nothing from its tensors: the loss, the gradient norm and
the flags are read on logged steps, and the flags of other steps one step later from their host copy.
Proved on CPU by counting every host read of a tensor (``item``, ``tolist``, ``bool``, ``float``,
``int``, ``cpu``, ``numpy``) during the steps that do not log. The numbers are the same as when the
step reads its flags at once (``nonfinite: skip``), and a non-finite step still stops the run naming the
step and its first bad gradient, with the parameters of the step before it, bit for bit.
"""

from __future__ import annotations

import sys
from typing import Any

import pytest
import torch

from tests.e2e._checkpoint_support import layout_kwargs
from tests.e2e._trainer_support import TokenDataset, build_model, make_args
from tests.e2e.test_nonfinite import _PoisonAt
from tests.support.dist import run_on_ranks
from tests.support.models import lm_loss

LR = 1e-2
READS = ("item", "tolist", "__bool__", "__float__", "__int__", "cpu", "numpy")
HOST_TENSORS = ("merak_tp/rng.py",)
"""Reads of tensors that live on the host on every device, not counted: the TP random stream's seed draw
from torch's CPU generator (``merak_tp.rng``)."""


def _fused_adamw(groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(groups, lr=LR, fused=True)


def _trainer(
    dp: int,
    pp: int,
    *,
    tp: int = 1,
    max_steps: int,
    logging_steps: int,
    policy: str,
    bad_step: int | None,
    fused: bool = True,
    zero_stage: int = 0,
) -> Any:
    from merak_core import Trainer

    args = make_args(
        **layout_kwargs(
            dp,
            tp,
            pp,
            max_steps=max_steps,
            logging_steps=logging_steps,
            nonfinite=policy,
            learning_rate=LR,
            lr_scheduler_type="constant",
            warmup_steps=0,
            zero_stage=zero_stage,
        )
    )
    model = build_model("gpt")
    loss_fn = lm_loss if bad_step is None else _PoisonAt(bad_step, args.gradient_accumulation_steps)
    return Trainer(
        model,
        args,
        TokenDataset(128, model.config.vocab_size),
        loss_fn=loss_fn,
        optimizer_factory=_fused_adamw if fused else None,
    )


def run_body(
    dp: int,
    pp: int,
    max_steps: int,
    logging_steps: int,
    policy: str,
    bad_step: int | None,
    fused: bool = True,
    zero_stage: int = 0,
) -> dict[str, Any]:
    """Train; the history, the error (if any), the step reached, the full state and whether the step read nothing."""
    from merak_core.run.nonfinite import NonFiniteError

    trainer = _trainer(
        dp,
        pp,
        max_steps=max_steps,
        logging_steps=logging_steps,
        policy=policy,
        bad_step=bad_step,
        fused=fused,
        zero_stage=zero_stage,
    )
    error = None
    try:
        trainer.train()
    except NonFiniteError as exc:
        error = str(exc)
    return {
        "on_device": trainer.engine.late_flags is not None,
        "error": error,
        "losses": [h["loss"] for h in trainer.history],
        "norms": [h.get("grad_norm") for h in trainer.history],
        "global_step": trainer.global_step,
        "state": trainer.full_state_dict(),
    }


def count_reads_body(dp: int, tp: int, pp: int, max_steps: int) -> dict[str, Any]:
    """Every host read of a tensor during training, by the step in progress (only steps 1 and the last log)."""
    from merak_core.run import engine as engine_module
    from merak_core.run.step_values import StepValues
    from merak_pipe.comm import P2PTransport

    trainer = _trainer(
        dp, pp, tp=tp, max_steps=max_steps, logging_steps=max_steps, policy="stop", bad_step=None
    )
    # The loader's id check reads its CPU batch by design (merak_core.data.batch_ids), not the step's
    # tensors: counted apart. At tp > 1 it replaces the vocab-parallel embedding's check on the device.
    loader_check = trainer.id_ranges.check

    def check_ids(*args: Any) -> bool:
        in_copy[0] = True
        try:
            return loader_check(*args)
        finally:
            in_copy[0] = False

    trainer.id_ranges = _Checker(trainer.id_ranges.vocab, check_ids)
    reads: list[tuple[int, str]] = []
    copies: list[tuple[int, int]] = []  # (step in progress, step whose host copy was read)
    headers: list[int] = []  # the pipeline's per-round shape header, read on a receiving stage
    made: dict[int, int] = {}
    in_copy = [False]
    originals = {name: getattr(torch.Tensor, name) for name in READS}

    def counting(name: str) -> Any:
        original = originals[name]

        def read(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            caller = sys._getframe(1).f_code.co_filename.replace("\\", "/")
            if not in_copy[0] and not caller.endswith(HOST_TENSORS):
                reads.append((trainer.global_step + 1, name))
            return original(self, *args, **kwargs)

        return read

    original_reduce, original_read = engine_module.reduce_step_values, StepValues.read
    original_header = P2PTransport.read_header

    def read_header(self: Any, pending: Any) -> tuple[bool, int]:
        headers.append(trainer.global_step + 1)
        in_copy[0] = True
        try:
            return original_header(self, pending)
        finally:
            in_copy[0] = False

    def reduce(*args: Any, **kwargs: Any) -> StepValues:
        values = original_reduce(*args, **kwargs)
        made[id(values)] = trainer.global_step + 1
        return values

    def read_copy(self: StepValues) -> list[float]:
        if not self.is_read:
            copies.append((trainer.global_step + 1, made[id(self)]))
        in_copy[0] = True
        try:
            return original_read(self)
        finally:
            in_copy[0] = False

    try:
        for name in READS:
            setattr(torch.Tensor, name, counting(name))
        engine_module.reduce_step_values = reduce  # type: ignore[assignment]
        StepValues.read = read_copy  # type: ignore[method-assign]
        P2PTransport.read_header = read_header  # type: ignore[method-assign]
        trainer.train()
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
        engine_module.reduce_step_values = original_reduce
        StepValues.read = original_read  # type: ignore[method-assign]
        P2PTransport.read_header = original_header  # type: ignore[method-assign]
    return {
        "on_device": trainer.engine.late_flags is not None,
        "reads": reads,
        "copies": copies,
        "headers": headers,
        "receives": not trainer.layout.is_first_stage,
    }


class _Checker:
    def __init__(self, vocab: int | None, check: Any) -> None:
        self.vocab, self.check = vocab, check


@pytest.mark.parametrize("layout", [(2, 1, 1), (1, 1, 2), (1, 2, 1)], ids=["dp2", "pp2", "tp2"])
def test_steps_that_do_not_log_read_nothing_from_their_tensors(layout: tuple[int, int, int]) -> None:
    steps = 6
    for rank, result in enumerate(run_on_ranks(2, count_reads_body, *layout, steps)):
        assert result["on_device"]
        quiet = [r for r in result["reads"] if 1 < r[0] < steps]
        assert quiet == [], (rank, quiet)
        # The counter sees reads where they belong: the logged steps read (the first step's loss).
        assert any(r[0] in (1, steps) for r in result["reads"]) or result["copies"], rank
        # A step that does not log waits only for the previous step's host copy (the device is past it).
        assert all(
            in_progress == made + 1 for in_progress, made in result["copies"] if 1 < in_progress < steps
        ), (
            rank,
            result["copies"],
        )
        assert {made for _, made in result["copies"]} == set(range(1, steps + 1)), result["copies"]
        # What remains (not a step's number): the pipeline runtime's shape header, int64[2] per round, read by
        # each stage that receives activations (merak_pipe.comm; gradients come in the shapes sent).
        receiving = result["receives"]
        assert sorted(set(result["headers"])) == (list(range(1, steps + 1)) if receiving else []), result[
            "headers"
        ]


@pytest.mark.parametrize("zero_stage", [0, 1], ids=["zero0", "zero1"])
def test_device_side_flags_give_the_numbers_of_host_side_flags(zero_stage: int) -> None:
    """nonfinite: stop (flags read late, update dropped on the device; ZeRO-1: by its inner optimizer) vs
    skip (flags read in the step)."""
    late = run_on_ranks(2, run_body, 2, 1, 4, 4, "stop", None, True, zero_stage)[0]
    now = run_on_ranks(2, run_body, 2, 1, 4, 4, "skip", None, True, zero_stage)[0]
    assert late["on_device"] and not now["on_device"]
    assert late["error"] is None and late["global_step"] == 4
    assert late["losses"] == now["losses"] and late["norms"] == now["norms"]
    assert len(late["losses"]) == 4
    for name, value in now["state"].items():
        assert torch.equal(late["state"][name], value), name


def test_nonfinite_step_found_one_step_later_stops_with_the_state_before_it() -> None:
    bad = 2
    late = run_on_ranks(2, run_body, 2, 1, 5, 5, "stop", bad)
    before = run_on_ranks(2, run_body, 2, 1, bad - 1, 5, "stop", None)[0]
    host = run_on_ranks(2, run_body, 2, 1, 5, 5, "stop", bad, False)[
        0
    ]  # foreach AdamW: flags read in the step
    first = late[0]
    assert first["on_device"] and all(r["error"] == first["error"] for r in late)
    assert first["error"] is not None and first["error"].startswith(
        f"step {bad}: non-finite training step (loss nan"
    )
    assert "the first non-finite gradient is '" in first["error"] and "(nan, on rank 0" in first["error"]
    assert "The step was not applied" in first["error"]
    # The run is back at the step before the bad one, bit for bit, though step bad + 1 ran.
    assert first["global_step"] == bad - 1 and first["losses"] == before["losses"]
    for name, value in before["state"].items():
        assert torch.equal(first["state"][name], value), name
    # The same error, word for word, as when the step reads its flags and the gradients name the bad one.
    assert not host["on_device"] and host["global_step"] == bad - 1
    assert first["error"] == host["error"], (first["error"], host["error"])
