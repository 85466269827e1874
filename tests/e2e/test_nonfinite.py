"""Non-finite steps: ``nonfinite: stop`` names the step, the loss, the norm and the first bad gradient on every
rank; ``nonfinite: skip`` drops exactly that step (parameters unchanged, later steps equal to a single-process
reference that skipped it); metrics and summaries stay valid JSON; float16 is refused up front."""

from __future__ import annotations

import json
import math
import re
import tempfile
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.e2e._checkpoint_support import layout_kwargs
from tests.e2e._trainer_support import (
    TokenDataset,
    build_model,
    make_args,
    reference_microbatches,
    reference_optimizer,
)
from tests.support.dist import run_on_ranks
from tests.support.models import lm_loss

BAD_STEP = 2


def _strict_json(text: str) -> Any:
    def refuse(name: str) -> None:
        raise ValueError(f"bare {name} in JSON")

    return json.loads(text, parse_constant=refuse)


class _PoisonAt:
    """A loss that is NaN (``kind='nan'``) in every microbatch of step ``step``; the LM loss otherwise."""

    def __init__(self, step: int, num_micro: int) -> None:
        self.step, self.num_micro, self.calls = step, num_micro, 0

    def __call__(self, output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss = lm_loss(output, labels)
        if output.is_meta:
            return loss
        self.calls += 1
        if (self.calls - 1) // self.num_micro + 1 == self.step:
            return loss * float("nan")
        return loss


def lr_blowup_body(dp: int, pp: int) -> dict[str, Any]:
    """learning_rate=1e6 until a step is non-finite; the error and the state when it came."""
    from merak_core import Trainer
    from merak_core.run.nonfinite import NonFiniteError

    args = make_args(
        **layout_kwargs(
            dp,
            1,
            pp,
            learning_rate=1e6,
            max_steps=12,
            lr_scheduler_type="constant",
            warmup_steps=0,
            max_grad_norm=0.0,
            dtype="float32",
        )
    )
    model = build_model("gpt").float()
    trainer = Trainer(model, args, TokenDataset(64, model.config.vocab_size), loss_fn=lm_loss)
    try:
        trainer.train()
    except NonFiniteError as exc:
        finite = all(bool(torch.isfinite(p).all()) for p in trainer.params)
        names = [n for n, _ in trainer.model.named_parameters()]
        return {
            "error": str(exc),
            "losses": [h["loss"] for h in trainer.history],
            "params_finite": finite,
            "names": names,
            "global_step": trainer.global_step,
        }
    raise AssertionError("learning_rate=1e6 trained 12 steps without a non-finite step")


@pytest.mark.parametrize("layout", [(2, 1), (1, 2)], ids=["dp2", "pp2"])
def test_learning_rate_1e6_stops_naming_the_step(layout: tuple[int, int]) -> None:
    results = run_on_ranks(2, lr_blowup_body, *layout)
    first = results[0]
    assert all(r["error"] == first["error"] for r in results), [r["error"] for r in results]
    step = len(first["losses"]) + 1
    assert all(math.isfinite(x) for x in first["losses"]), first["losses"]
    assert first["error"].startswith(f"step {step}: non-finite training step (loss "), first["error"]
    assert "gradient norm not computed (max_grad_norm=0)" in first["error"]
    named = re.search(r"the first non-finite gradient is '([^']+)' \((nan|inf), on rank (\d)", first["error"])
    assert named is not None, first["error"]
    assert named.group(1) in sum((r["names"] for r in results), []), (named.group(1), first["names"])
    assert "set nonfinite: skip" in first["error"]
    # The bad step was not applied: the parameters are the finite ones of the last good step.
    assert all(r["params_finite"] and r["global_step"] == step - 1 for r in results)


def poisoned_gradient_body(victim: str) -> str:
    """dp=2: an infinite gradient for parameter ``victim`` alone at step 2; the stop error's text."""
    from merak_core import Trainer
    from merak_core.run.nonfinite import NonFiniteError

    args = make_args(**layout_kwargs(2, 1, 1, max_steps=3))
    model = build_model("gpt")
    calls = [0]

    def poison(grad: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        if (calls[0] - 1) // args.gradient_accumulation_steps + 1 == BAD_STEP and dist.get_rank() == 1:
            return grad * float("inf")
        return grad

    dict(model.named_parameters())[victim].register_hook(poison)
    trainer = Trainer(model, args, TokenDataset(64, model.config.vocab_size), loss_fn=lm_loss)
    with pytest.raises(NonFiniteError) as info:
        trainer.train()
    return str(info.value)


def test_stop_names_the_first_nonfinite_gradient_on_every_rank() -> None:
    victim = [n for n, _ in build_model("gpt").named_parameters()][5]
    texts = run_on_ranks(2, poisoned_gradient_body, victim)
    assert texts[0] == texts[1]
    # The DP all-reduce spreads rank 1's infinity to both replicas; the name is the same.
    assert re.match(
        rf"step {BAD_STEP}: non-finite training step \(loss [0-9.]+, gradient norm (inf|nan)\); "
        rf"the first non-finite gradient is '{re.escape(victim)}' \((inf|nan), on rank 0: pp_rank 0, "
        r"dp_rank 0, tp_rank 0\)\. The step was not applied",
        texts[0],
    ), texts[0]


def skip_body(dp: int, pp: int, max_steps: int, out: str) -> dict[str, Any]:
    """``nonfinite: skip`` with a NaN loss at step BAD_STEP; losses, the final state and the metrics file."""
    from merak_core import Trainer

    kwargs = layout_kwargs(
        dp,
        1,
        pp,
        max_steps=max_steps,
        nonfinite="skip",
        lr_scheduler_type="constant",
        warmup_steps=0,
        output_dir=out,
        logging_steps=10,
    )
    args = make_args(**kwargs)
    model = build_model("gpt")
    trainer = Trainer(
        model,
        args,
        TokenDataset(64, model.config.vocab_size),
        loss_fn=_PoisonAt(BAD_STEP, args.gradient_accumulation_steps),
    )
    history = trainer.train()
    state = trainer.full_state_dict()
    return {
        "losses": [h["loss"] for h in history],
        "skipped": [h.get("skipped", False) for h in history],
        "state": state,
        "skipped_steps": trainer.skipped_steps,
    }


def _reference_skipping(
    max_steps: int, dp: int, skip: set[int]
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The single-process reference that reads every batch but applies no update at the steps in ``skip``."""
    args = make_args(
        **layout_kwargs(dp, 1, 1, max_steps=max_steps, lr_scheduler_type="constant", warmup_steps=0)
    )
    model = build_model("gpt")
    data = TokenDataset(64, model.config.vocab_size)
    opt, sched = reference_optimizer(model, args)
    losses = []
    for step, chunks in enumerate(reference_microbatches(len(data), args, dp), start=1):
        model.zero_grad(set_to_none=True)
        total = 0.0
        for chunk in chunks:
            batch = torch.utils.data.default_collate([data[i] for i in chunk])
            loss = lm_loss(model(batch["input_ids"]), batch["labels"]) / len(chunks)
            loss.backward()
            total += float(loss.detach())
        losses.append(float("nan") if step in skip else total)
        if step in skip:
            continue
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        opt.step()
        sched.step()
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("layout", [(2, 1), (1, 2)], ids=["dp2", "pp2"])
def test_skip_drops_exactly_the_bad_step(layout: tuple[int, int], tmp_path: Any) -> None:
    dp, pp = layout
    before = run_on_ranks(2, skip_body, dp, pp, BAD_STEP - 1, str(tmp_path / "before"))[0]
    at = run_on_ranks(2, skip_body, dp, pp, BAD_STEP, str(tmp_path / "at"))[0]
    after = run_on_ranks(2, skip_body, dp, pp, 4, str(tmp_path / "after"))[0]
    # The skipped step leaves every parameter bit for bit as the step before left it.
    assert at["skipped"] == [False, True] and at["skipped_steps"] == 1
    for name, value in before["state"].items():
        assert torch.equal(at["state"][name], value), name
    # Later steps equal the single-process reference that skipped the same step.
    ref_losses, ref_state = _reference_skipping(4, dp, {BAD_STEP})
    assert math.isnan(after["losses"][BAD_STEP - 1])
    for i, (got, want) in enumerate(zip(after["losses"], ref_losses, strict=True)):
        if i != BAD_STEP - 1:
            assert got == pytest.approx(want, rel=1e-10, abs=1e-12), (i + 1, after["losses"], ref_losses)
    for name, want in ref_state.items():
        torch.testing.assert_close(after["state"][name], want, rtol=1e-9, atol=1e-11, msg=name)
    # The skipped step is logged and counted; every line of metrics.jsonl is strict JSON (null, not NaN).
    records = [_strict_json(line) for line in (tmp_path / "after" / "metrics.jsonl").read_text().splitlines()]
    bad = [r for r in records if r.get("step") == BAD_STEP]
    assert bad == [dict(bad[0], loss=None, skipped=True, skipped_steps=1)], records
    assert [r["step"] for r in records if "loss" in r] == [1, BAD_STEP, 4]


class _PoisonSteps:
    """A loss that is NaN in every microbatch of the steps in ``steps`` (all steps when None); LM loss otherwise."""

    def __init__(self, steps: set[int] | None, num_micro: int) -> None:
        self.steps, self.num_micro, self.calls = steps, num_micro, 0

    def __call__(self, output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss = lm_loss(output, labels)
        if output.is_meta or not torch.is_grad_enabled():  # evaluation (no_grad) is left alone
            return loss
        self.calls += 1
        if self.steps is None or (self.calls - 1) // self.num_micro + 1 in self.steps:
            return loss * float("nan")
        return loss


def skip_limit_body(out: str, poisoned: list[int] | None, max_steps: int, limit: int) -> dict[str, Any]:
    """dp=2, ``nonfinite: skip`` with the limit ``limit``, NaN at the steps ``poisoned`` (None: all), a save
    every step: the error (or None), the step reached and the committed checkpoints."""
    from pathlib import Path

    from merak_core import Trainer
    from merak_core.run.nonfinite import NonFiniteError

    args = make_args(
        **layout_kwargs(2, 1, 1, max_steps=max_steps, nonfinite="skip", save_steps=1, output_dir=out),
        nonfinite_max_consecutive_skips=limit,
    )
    model = build_model("gpt")
    loss_fn = _PoisonSteps(None if poisoned is None else set(poisoned), args.gradient_accumulation_steps)
    trainer = Trainer(model, args, TokenDataset(64, model.config.vocab_size), loss_fn=loss_fn)
    error = None
    try:
        trainer.train()
    except NonFiniteError as exc:
        error = str(exc)
    dist.barrier()
    saved = sorted(p.name for p in (Path(out) / "checkpoints").glob("step_*"))
    return {"error": error, "step": trainer.global_step, "saved": saved, "skipped": trainer.skipped_steps}


def test_skip_limit_stops_the_run_as_stop_would(tmp_path: Any) -> None:
    """Steps 2, 3 skipped, 4 applied (the count restarts), 5 and 6 skipped: step 7 is one too many for a limit of 2."""
    results = run_on_ranks(2, skip_limit_body, str(tmp_path), [2, 3, 5, 6, 7, 8], 9, 2)
    first = results[0]
    assert all(r["error"] == first["error"] for r in results), [r["error"] for r in results]
    assert first["error"] is not None and first["error"].startswith(
        "step 7: non-finite training step (loss nan"
    ), first
    assert "The 2 steps before it were skipped already (nonfinite: skip)" in first["error"]
    assert "training.nonfinite_max_consecutive_skips=2" in first["error"]
    assert "raise nonfinite_max_consecutive_skips (0: no limit)" in first["error"]
    assert first["step"] == 6 and first["skipped"] == 4
    assert first["saved"] == [f"step_{s}" for s in range(1, 7)]  # nothing of step 7


def test_every_step_skipped_fails_and_saves_nothing_at_the_end(tmp_path: Any) -> None:
    """Fewer steps than the limit, every one of them skipped: the run fails at its end (no final save)."""
    results = run_on_ranks(2, skip_limit_body, str(tmp_path), None, 3, 5)
    first = results[0]
    assert all(r["error"] == first["error"] for r in results)
    assert first["error"] is not None and first["error"].startswith(
        "steps 1..3: every one of the 3 steps of this run was non-finite and skipped (nonfinite: skip)"
    ), first["error"]
    assert "training.nonfinite_max_consecutive_skips=5" in first["error"]
    # No limit (0): the run is the user's to judge.
    again = run_on_ranks(2, skip_limit_body, str(tmp_path / "nolimit"), None, 3, 0)[0]
    assert again["error"] is None and again["skipped"] == 3


def _nan_when_evaluating(output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The LM loss in training; NaN in evaluation (no_grad), as for a model whose eval outputs are NaN."""
    loss = lm_loss(output, labels)
    return loss if output.is_meta or torch.is_grad_enabled() else loss * float("nan")


def nan_eval_body(out: str) -> dict[str, Any]:
    """dp=2, an evaluation and a save due at step 2 of 4, the eval loss NaN (the weights finite)."""
    from pathlib import Path

    from merak_core import Trainer
    from merak_core.run.nonfinite import NonFiniteError

    args = make_args(**layout_kwargs(2, 1, 1, max_steps=4, eval_steps=2, save_steps=2, output_dir=out))
    model = build_model("gpt")
    data, eval_data = TokenDataset(64, model.config.vocab_size), TokenDataset(8, model.config.vocab_size)
    trainer = Trainer(model, args, data, eval_data, loss_fn=_nan_when_evaluating)
    error = None
    try:
        trainer.train()
    except NonFiniteError as exc:
        error = str(exc)
    dist.barrier()
    finite = all(bool(torch.isfinite(p).all()) for p in trainer.params)
    saved = sorted(p.name for p in (Path(out) / "checkpoints").glob("step_*"))
    return {"error": error, "saved": saved, "params_finite": finite}


def test_nan_evaluation_fails_the_run_before_its_checkpoint(tmp_path: Any) -> None:
    results = run_on_ranks(2, nan_eval_body, str(tmp_path))
    first = results[0]
    assert all(r["error"] == first["error"] for r in results)
    assert first["params_finite"]
    assert first["error"] is not None and first["error"].startswith("step 2: the evaluation loss is nan"), (
        first
    )
    assert "no checkpoint of it is committed" in first["error"]
    assert first["saved"] == []


def test_float16_is_refused_with_the_fix() -> None:
    from merak_core.config import TrainingArguments

    with pytest.raises(ValueError, match=r"dtype='float16' trains without loss scaling.*use bf16: true"):
        TrainingArguments(dtype="float16", output_dir=tempfile.mkdtemp())


def test_json_safe_writes_null_for_nonfinite() -> None:
    from merak_core.run.nonfinite import json_safe

    value = {"loss": float("nan"), "xs": [1.0, float("inf"), -float("inf")], "ok": 2.5, "name": "a"}
    assert json.dumps(json_safe(value), allow_nan=False) == (
        '{"loss": null, "xs": [1.0, null, null], "ok": 2.5, "name": "a"}'
    )
