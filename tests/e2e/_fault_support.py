"""Bodies and job files of the fault tests: a rank that dies mid-step, a torchrun job that restarts."""

from __future__ import annotations

import os
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from tests.e2e._checkpoint_support import layout_kwargs
from tests.e2e._trainer_support import TokenDataset, build_model, make_args
from tests.support.models import lm_loss


def die_mid_step_body(layout: tuple[int, int, int], victim: int, die_at_call: int, timeout_s: float) -> None:
    """Train; rank ``victim`` exits inside its ``die_at_call``-th loss call. Survivors raise, naming the failure."""
    from merak_core import ParallelLayout, Trainer

    dp, tp, pp = layout
    group_layout = ParallelLayout.build(dp, tp, pp, timeout=timedelta(seconds=timeout_s))
    calls = [0]

    def loss_fn(output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if output.is_meta:  # the Trainer's up-front check of the loss on meta tensors: not a step
            return lm_loss(output, labels)
        calls[0] += 1
        if dist.get_rank() == victim and calls[0] == die_at_call:
            os._exit(19)
        return lm_loss(output, labels)

    args = make_args(**layout_kwargs(dp, tp, pp, max_steps=3, output_dir=os.path.join(tempfile.gettempdir(), f"merak-fault-{os.getpid()}")))
    model = build_model("gpt")
    trainer = Trainer(model, args, TokenDataset(64, model.config.vocab_size), loss_fn=loss_fn, layout=group_layout)
    start = time.monotonic()
    try:
        trainer.train()
    except RuntimeError as exc:
        raise RuntimeError(f"SURVIVOR rank {dist.get_rank()} failed after {time.monotonic() - start:.1f} s with "
                           f"{type(exc).__name__}: {exc}") from None
    raise AssertionError(f"rank {dist.get_rank()} finished although rank {victim} died")


# ---------------------------------------------------------------------------- job-file factories (merak train)


def job_model(name: str = "gpt") -> torch.nn.Module:
    return build_model(name)


def job_data(size: int = 64) -> TokenDataset:
    return TokenDataset(size, build_model("gpt").config.vocab_size)


def job_loss(output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The LM loss; kills this rank once (no marker file yet) at the configured loss call."""
    marker = os.environ.get("MERAK_TEST_KILL_MARKER")
    if marker:
        job_loss.calls = getattr(job_loss, "calls", 0) + 1  # type: ignore[attr-defined]
        rank = int(os.environ.get("RANK", "0"))
        if (rank == int(os.environ["MERAK_TEST_KILL_RANK"]) and not os.path.exists(marker)
                and job_loss.calls == int(os.environ["MERAK_TEST_KILL_AT_CALL"])):  # type: ignore[attr-defined]
            with open(marker, "w") as f:
                f.write(f"rank {rank} killed itself at loss call {job_loss.calls}\n")  # type: ignore[attr-defined]
            os._exit(13)
    return lm_loss(output, labels)

