"""TP plans in job files: the full plan vocabulary, names registered by the job's modules, ``merak check``."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import yaml

from tests.support.dist import run_on_ranks

pytest.importorskip("transformers")

from tests.tp import _hf_families as F  # noqa: E402

pytestmark = pytest.mark.transformers

PHI3_PLAN = {
    "name": "phi3_from_yaml",
    "layers": {
        "*qkv_proj": "column",
        "*o_proj": "row",
        "*gate_up_proj": "column",
        "*down_proj": "row",
        "*embed_tokens": "vocab",
        "lm_head": "lm_head",
    },
    "sections": {
        "*qkv_proj": [
            "num_attention_heads*head_dim",
            "num_key_value_heads*head_dim",
            "num_key_value_heads*head_dim",
        ],
        "*gate_up_proj": 2,
    },
    "attributes": {"*self_attn": ["num_key_value_heads"]},
    "regions": ["*layers.*.self_attn", "*layers.*.mlp"],
}
"""Phi-3 in plain data. The attention also reads config.num_attention_heads, which a job file cannot
fix up: the built-in plan does; a plain-data plan gives the attention its own config below."""


def _write_job(tmp: Path, name: str, training: dict[str, object], *, register: str = "") -> Path:
    (tmp / "model.py").write_text(
        textwrap.dedent(f"""
        import copy
        import torch
        import merak_tp
        from tests.tp._hf_families import build_family, VOCAB

        {register}

        def build_model():
            return build_family({name!r})

        class Tokens(torch.utils.data.Dataset):
            def __len__(self):
                return 8

            def __getitem__(self, i):
                g = torch.Generator().manual_seed(i)
                ids = torch.randint(3, VOCAB, (9,), generator=g)
                return {{"input_ids": ids[:-1], "labels": ids[1:]}}

        def build_data():
            return Tokens()
    """)
    )
    job = tmp / "job.yaml"
    job.write_text(
        yaml.safe_dump(
            {
                "model": {"factory": "model.py:build_model"},
                "data": {"factory": "model.py:build_data"},
                "training": {
                    "output_dir": str(tmp / "out"),
                    "dtype": "float64",
                    "per_device_train_batch_size": 2,
                    **training,
                },
            }
        )
    )
    return job


def test_a_plan_registered_by_the_factory_module_can_be_named(tmp_path: Path) -> None:
    from merak_core.job import JobConfig

    register = textwrap.dedent("""
        merak_tp.register_plan(merak_tp.get_plan("hf_gpt_neox").with_options(name="my_neox"), overwrite=True)
    """).replace("\n", "\n        ")
    job = JobConfig.from_yaml(
        _write_job(tmp_path, "gpt_neox", {"tp": 2, "tp_plan": "my_neox"}, register=register)
    )
    assert job.training.tp_plan == "my_neox"
    with pytest.raises(ValueError, match=r"training.tp_plan='my_noex'.*closest: \['my_neox'\]"):
        JobConfig.from_yaml(
            _write_job(tmp_path, "gpt_neox", {"tp": 2, "tp_plan": "my_noex"}, register=register)
        )


def test_job_file_plan_with_sections_attributes_and_regions() -> None:
    from merak_core.config import TrainingArguments

    args = TrainingArguments(output_dir="/tmp/unused", tp=2, tp_plan=PHI3_PLAN)
    assert args.tp_plan == PHI3_PLAN
    with pytest.raises(ValueError, match=r"unknown keys \['region'\]"):
        TrainingArguments(output_dir="/tmp/unused", tp=2, tp_plan={**PHI3_PLAN, "region": []})
    with pytest.raises(ValueError, match="sections for '\\*o_proj', which is not a 'column' pattern"):
        TrainingArguments(output_dir="/tmp/unused", tp=2, tp_plan={**PHI3_PLAN, "sections": {"*o_proj": 2}})
    # The job-file Phi-3 plan shards exactly (against the model with per-module configs, as the
    # attention's query split needs the per-rank head count).
    run_on_ranks(2, F.family_body, "phi3", 2, 2, False, {**PHI3_PLAN, "base": "hf_phi3", "attributes": {}})


def test_merak_plans_lists_every_family(capsys: pytest.CaptureFixture[str]) -> None:
    from merak_core.cli import main

    assert main(["plans"]) == 0
    out = capsys.readouterr().out
    for family in F.FAMILIES:
        assert f" {family}" in out, family


def test_merak_check_passes_an_exact_plan_and_flags_a_wrong_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from merak_core.cli import main

    good = _write_job(tmp_path, "phi3", {"tp": 2})
    assert main(["check", str(good)]) == 0, capsys.readouterr().out
    out = capsys.readouterr().out
    assert "model.layers.0.mlp.gate_up_proj" in out and "0 above the tolerance" in out
    # gate/up fused but split as one block: the silent-wrong plan of a Phi-3 MLP.
    wrong = {
        "base": "hf_phi3",
        "sections": {
            "*layers.*.self_attn.qkv_proj": [
                "num_attention_heads*head_dim",
                "num_key_value_heads*head_dim",
                "num_key_value_heads*head_dim",
            ]
        },
    }
    bad = _write_job(
        tmp_path / "bad" if (tmp_path / "bad").mkdir() is None else tmp_path,
        "phi3",
        {"tp": 2, "tp_plan": wrong},
    )
    assert main(["check", str(bad)]) == 1
    out = capsys.readouterr().out
    flagged = [line for line in out.splitlines() if line.endswith(" NO")]
    assert any("gate_up_proj" in line for line in flagged), out


def _trainer_with_check(tp_plan: object) -> str:
    import tempfile

    from merak_core import Trainer
    from merak_core.config import TrainingArguments
    from tests.e2e.test_tp_families import Tokens, lm_loss

    args = TrainingArguments(
        output_dir=tempfile.mkdtemp(prefix="merak-tpcheck-"),
        tp=2,
        dtype="float64",
        per_device_train_batch_size=2,
        max_steps=1,
        tp_check=True,
        tp_plan=tp_plan,
    )
    try:
        Trainer(F.build_family("phi3"), args, Tokens(8), loss_fn=lm_loss)
    except ValueError as err:
        return str(err)
    return "ok"


def test_trainer_tp_check_refuses_a_wrong_plan_before_training() -> None:
    assert run_on_ranks(2, _trainer_with_check, None) == ["ok", "ok"]
    wrong = {
        "base": "hf_phi3",
        "sections": {
            "*layers.*.self_attn.qkv_proj": [
                "num_attention_heads*head_dim",
                "num_key_value_heads*head_dim",
                "num_key_value_heads*head_dim",
            ]
        },
    }
    errors = run_on_ranks(2, _trainer_with_check, wrong)
    for err in errors:
        assert "does not shard the model exactly (training.tp_check)" in err, err
        assert any("gate_up_proj" in line and line.endswith(" NO") for line in err.splitlines()), err


def test_sequence_parallel_on_a_plan_without_it_is_refused_in_the_launching_process(tmp_path: Path) -> None:
    """``training.sequence_parallel: true`` with OPT (its layers flatten batch and sequence): the check before
    torchrun names the plan, the family, the reason and the key; Llama's plan passes."""
    from merak_core.checks import PreflightError, preflight
    from merak_core.job import JobConfig

    job = JobConfig.from_yaml(_write_job(tmp_path, "opt", {"tp": 2, "sequence_parallel": True}))
    with pytest.raises(
        PreflightError,
        match="the TP plan 'hf_opt' of OPTForCausalLM .* does not support sequence "
        "parallelism: OPTDecoderLayer flattens .*training.sequence_parallel: "
        "false",
    ):
        preflight(job, tp=2)
    (tmp_path / "llama").mkdir()
    ok = preflight(
        JobConfig.from_yaml(_write_job(tmp_path / "llama", "llama", {"tp": 2, "sequence_parallel": True})),
        tp=2,
    )
    assert "sequence parallelism supported by the TP plan" in ok.checks
