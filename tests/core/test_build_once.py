"""Issue 30's "each module once": once :func:`~merak_core.autoplan.prepare.prepare_run` has built a run,
assembling the Trainer from it and training never re-enter the start-up: no planner, no ``layout: auto``,
no probe, no launch checks, no rank bootstrap, no preparation (before, each step's autocast came from
``run/bootstrap.py`` and the step count from ``autoplan/prepare.py``).

Measured with :func:`sys.setprofile` on every rank (pp=2: the traced, partitioned path) over the Trainer's
assembly and two steps: the merak-core modules whose functions ran.
"""

from __future__ import annotations

import sys

from tests.e2e._trainer_support import TokenDataset, build_model, make_args
from tests.support.dist import run_on_ranks
from tests.support.models import REFERENCE_MODELS

START_UP = (
    "merak_core.planner",
    "merak_core.autoplan.auto",
    "merak_core.autoplan.probe",
    "merak_core.autoplan.givens",
    "merak_core.autoplan.prepare",
    "merak_core.autoplan.cluster_job",
    "merak_core.checks",
    "merak_core.run.bootstrap",
    "merak_core.launch",
    "merak_core.job",
)


def _modules_after_the_build() -> list[str]:
    from merak_core import Trainer
    from merak_core.autoplan.prepare import prepare_run

    args = make_args(pp=2, max_steps=2)
    model = build_model("gpt")
    data = TokenDataset(16, model.config.vocab_size)
    prepared = prepare_run(model, args, data, loss_fn=REFERENCE_MODELS["gpt"].loss)
    seen: set[str] = set()

    def profile(frame, event, arg):  # type: ignore[no-untyped-def]
        if event == "call":
            name = frame.f_globals.get("__name__", "")
            if name.startswith("merak_core."):
                seen.add(name)

    sys.setprofile(profile)
    try:
        Trainer.from_prepared(prepared).train()
    finally:
        sys.setprofile(None)
    return sorted(seen)


def test_the_trainer_and_its_steps_never_reenter_the_start_up() -> None:
    for modules in run_on_ranks(2, _modules_after_the_build):
        assert "merak_core.run.engine" in modules and "merak_core.trainer" in modules, (
            modules
        )  # it saw the run
        reentered = [m for m in modules if m.startswith(START_UP)]
        assert reentered == [], reentered
