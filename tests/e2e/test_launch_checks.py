"""The launch checks of sizes and functions accept correct jobs (their refusals are rows of test_bad_input.py).

Each job sits next to a mistake of the table: the same model and data with the value right, so a
check that refuses too much fails here. Runs ``merak train --dry-run`` in this process.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e._bad_input_launch_cases import ATTENTION_PLAN, HERE, train_dry_run, write_job
from tests.e2e._bad_input_support import CaseContext

LLAMA = {"factory": f"{HERE}:hf_llama"}

GOOD = {
    "microbatches_equal_pp": dict(
        model={**LLAMA, "kwargs": {"use_cache": False}}, training={"pp": 2, "gradient_accumulation_steps": 2}
    ),
    "attention_plan_whole_heads": dict(
        model={**LLAMA, "kwargs": {"heads": 4, "kv_heads": 2}},
        training={"tp": 2, "tp_plan": ATTENTION_PLAN},
    ),
    "mlp_plan_odd_heads": dict(  # attention replicated: its 3 heads need not divide tp
        model={**LLAMA, "kwargs": {"heads": 3, "kv_heads": 3, "hidden": 12}},
        training={
            "tp": 2,
            "tp_plan": {"model.layers.*.mlp.up_proj": "column", "model.layers.*.mlp.down_proj": "row"},
        },
    ),
    "dataset_of_one_global_batch": dict(
        model=LLAMA,
        data={"factory": f"{HERE}:tokens", "kwargs": {"size": 16}},
        training={"per_device_train_batch_size": 4, "gradient_accumulation_steps": 4},
    ),
    "seq_len_equal_positions": dict(
        model={"factory": f"{HERE}:hf_gpt2", "kwargs": {"positions": 6}},
        data={"factory": f"{HERE}:tokens", "kwargs": {"seq_len": 6}},
    ),
    "rotary_model_beyond_max_positions": dict(  # rotary positions take any length
        model=LLAMA, data={"factory": f"{HERE}:tokens", "kwargs": {"seq_len": 40}}
    ),
    "per_example_metrics": dict(model=LLAMA, metrics=f"{HERE}:accuracy"),
    "untraceable_module_kept_whole": dict(  # the fix the refusal suggests
        model={"factory": "tests.e2e._bad_input_model_cases:Gated"},
        data={"factory": "tests.e2e._bad_input_model_cases:features"},
        training={
            "pp": 2,
            "gradient_accumulation_steps": 2,
            "tp_plan": {"layers": {}, "trace_leaves": ["gate"]},
        },
    ),
}


@pytest.mark.parametrize("name", sorted(GOOD))
def test_launch_checks_accept_a_correct_job(name: str, tmp_path: Path) -> None:
    ctx = CaseContext(tmp_path)
    train_dry_run(ctx, write_job(ctx, **GOOD[name]))  # raises CliExit on a refusal


def test_overrides_after_the_options_are_overrides(tmp_path: Path) -> None:
    """``merak train JOB --dry-run training.max_steps=5``: the override reaches the job (and the ranks' command)."""
    import contextlib
    import io

    from merak_core.cli import main

    ctx = CaseContext(tmp_path)
    job = write_job(ctx, model=LLAMA)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = main(
            [
                "--log-level",
                "WARNING",
                "train",
                str(job),
                "training.seed=3",
                "--dry-run",
                "training.max_steps=5",
            ]
        )
    assert status == 0
    assert out.getvalue().split()[-2:] == ["training.seed=3", "training.max_steps=5"]
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as exc:
        main(["train", str(job), "--dry-run", "--max-step", "5"])  # not an override: still a usage error
    assert exc.value.code == 2 and "unrecognized arguments: --max-step 5" in err.getvalue()
