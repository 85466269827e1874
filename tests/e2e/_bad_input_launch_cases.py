"""Mistakes of a job file that ``merak train`` refuses before torchrun starts (rows of the bad-input table).

Each case writes a job file whose factories live in this module (``tests.e2e._bad_input_launch_cases:<fn>``)
and runs ``merak train JOB --dry-run`` in the test process under the no-collective guard (the TP
check's fake process group allowed). :func:`_train_dry_run` raises :class:`CliExit` with the exit
status and the one error line; a failure printed over several lines, or an error that tells the
user to set a ``training.<key>`` that ``TrainingArguments`` does not have, fails the row instead.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import re
import sys
import unittest.mock
from pathlib import Path
from typing import Any

import torch
import yaml
from torch.utils.data import Dataset

from tests.e2e._bad_input_support import CaseContext, CliExit
from tests.support.hf_models import tiny_decoder_fields, tiny_gpt2_config

HERE = "tests.e2e._bad_input_launch_cases"

# ----------------------------------------------------------------------------- factories of the jobs


def hf_llama(
    heads: int = 4, kv_heads: int = 4, hidden: int = 16, vocab: int = 16, use_cache: bool = True
) -> Any:
    """A tiny transformers Llama (its head counts live in its config only)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        **tiny_decoder_fields(
            vocab,
            hidden_size=hidden,
            intermediate_size=16,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            max_position_embeddings=32,
            use_cache=use_cache,
        )
    )
    return LlamaForCausalLM(config)


def hf_gpt2(positions: int = 16, vocab: int = 16) -> Any:
    """A tiny transformers GPT-2: a learned position table of ``positions`` rows."""
    from transformers import GPT2LMHeadModel

    torch.manual_seed(0)
    dropout = {"resid_pdrop": 0.1, "embd_pdrop": 0.1, "attn_pdrop": 0.1}  # GPT2Config's defaults
    config = tiny_gpt2_config(
        vocab, n_embd=8, n_head=2, n_positions=positions, bos_token_id=0, eos_token_id=0, **dropout
    )
    return GPT2LMHeadModel(config)


class Tokens(Dataset):
    """``size`` sequences of ``seq_len`` token ids with next-token labels (``ignore_all``: every label -100)."""

    def __init__(self, size: int, seq_len: int, vocab: int, ignore_all: bool) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (size, seq_len + 1), generator=g)
        self.ignore_all = ignore_all

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        labels = self.ids[i, 1:].clone()
        if self.ignore_all:
            labels[:] = -100
        return {"input_ids": self.ids[i, :-1].clone(), "labels": labels}


def tokens(size: int = 32, seq_len: int = 6, vocab: int = 16, ignore_all: bool = False) -> Any:
    return Tokens(size, seq_len, vocab, ignore_all), Tokens(8, seq_len, vocab, False)


def accuracy_as_float(logits: torch.Tensor, labels: torch.Tensor) -> Any:
    """A metrics function that reduces to a Python float (``.item()`` of a batch): it raises."""
    return {"accuracy": (logits.argmax(-1) == labels).float().mean(dim=1).item()}


def accuracy_not_a_tensor(logits: torch.Tensor, labels: torch.Tensor) -> Any:
    """A metrics function that returns Python numbers instead of per-example tensors."""
    return {"accuracy": float((logits.argmax(-1) == labels).float().mean())}


def accuracy(logits: torch.Tensor, labels: torch.Tensor) -> Any:
    """A correct metrics function: per-example token accuracy."""
    return {"accuracy": (logits.argmax(-1) == labels).float().mean(dim=-1)}


ATTENTION_PLAN = {
    "model.layers.*.self_attn.q_proj": "column",
    "model.layers.*.self_attn.k_proj": "column",
    "model.layers.*.self_attn.v_proj": "column",
    "model.layers.*.self_attn.o_proj": "row",
}
"""A hand-written TP plan that shards Llama's attention (it names no head count to fix)."""

# ----------------------------------------------------------------------------- running merak train


def write_job(ctx: CaseContext, *, model: dict, data: dict | None = None, **sections: Any) -> Path:
    """A job file in ``ctx.tmp``: ``model``/``data`` sections, ``training`` merged over small defaults."""
    training = {
        "output_dir": str(ctx.tmp / "out"),
        "dp": 1,
        "per_device_train_batch_size": 2,
        "max_steps": 2,
        **sections.pop("training", {}),
    }
    raw = {"model": model, "data": data or {"factory": f"{HERE}:tokens"}, **sections, "training": training}
    path = ctx.tmp / "job.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _check_keys(line: str) -> None:
    """Every ``training.<key>`` an error names is a TrainingArguments field (the fix must exist)."""
    from merak_core import TrainingArguments

    fields = {f.name for f in dataclasses.fields(TrainingArguments)}
    unknown = sorted(set(re.findall(r"training\.([a-z_]+)", line)) - fields)
    assert not unknown, f"the error names training keys that do not exist: {unknown}: {line}"


def train_dry_run(ctx: CaseContext, job: Path, *argv: str) -> None:
    """``merak train JOB ARGV --dry-run`` here; a refusal becomes :class:`CliExit` ("exit N: LINE")."""
    run_cli(ctx, "train", str(job), *argv, "--dry-run")


def run_cli(ctx: CaseContext, *argv: str) -> None:
    """``merak ARGV`` here; a refusal becomes :class:`CliExit` ("exit N: LINE")."""
    from merak_core.cli import main

    err = io.StringIO()
    with (
        ctx.guard(allow=("init_process_group",)),  # the TP check's fake group
        contextlib.redirect_stderr(err),
        contextlib.redirect_stdout(io.StringIO()),
    ):
        try:
            status = main(["--log-level", "WARNING", *argv])
        except SystemExit as exc:
            status = exc.code if isinstance(exc.code, int) else 2
    lines = [line for line in err.getvalue().splitlines() if line.strip()]
    if status:
        assert len(lines) == 1, f"not one line (exit {status}):\n{err.getvalue()}"
        _check_keys(lines[0])
        raise CliExit(f"exit {status}: {lines[0]}")


# ----------------------------------------------------------------------------- the cases: sizes


def launch_microbatches_fewer_than_pp(ctx: CaseContext) -> None:
    job = write_job(
        ctx,
        model={"factory": f"{HERE}:hf_llama"},
        training={"pp": 2, "gradient_accumulation_steps": 1},
    )
    train_dry_run(ctx, job)


def launch_heads_not_divisible_by_tp(ctx: CaseContext) -> None:
    job = write_job(
        ctx,
        model={"factory": f"{HERE}:hf_llama", "kwargs": {"heads": 3, "kv_heads": 3, "hidden": 12}},
        training={"tp": 2, "tp_plan": ATTENTION_PLAN},
    )
    train_dry_run(ctx, job)


def launch_kv_heads_not_divisible_by_tp(ctx: CaseContext) -> None:
    job = write_job(
        ctx,
        model={"factory": f"{HERE}:hf_llama", "kwargs": {"heads": 4, "kv_heads": 1}},
        training={"tp": 2, "tp_plan": ATTENTION_PLAN},
    )
    train_dry_run(ctx, job)


def launch_dataset_smaller_than_global_batch(ctx: CaseContext) -> None:
    job = write_job(
        ctx,
        model={"factory": f"{HERE}:hf_llama"},
        data={"factory": f"{HERE}:tokens", "kwargs": {"size": 10}},
        training={"per_device_train_batch_size": 4, "gradient_accumulation_steps": 4},
    )
    train_dry_run(ctx, job)


def launch_seq_len_beyond_positions(ctx: CaseContext) -> None:
    job = write_job(
        ctx,
        model={"factory": f"{HERE}:hf_gpt2", "kwargs": {"positions": 4}},
        data={"factory": f"{HERE}:tokens", "kwargs": {"seq_len": 6}},
    )
    train_dry_run(ctx, job)


def launch_every_label_ignored(ctx: CaseContext) -> None:
    job = write_job(
        ctx,
        model={"factory": f"{HERE}:hf_llama"},
        data={"factory": f"{HERE}:tokens", "kwargs": {"ignore_all": True}},
    )
    train_dry_run(ctx, job)


# ----------------------------------------------------------------------------- the cases: metrics


def launch_metrics_raises(ctx: CaseContext) -> None:
    job = write_job(ctx, model={"factory": f"{HERE}:hf_llama"}, metrics=f"{HERE}:accuracy_as_float")
    train_dry_run(ctx, job)


def launch_metrics_returns_numbers(ctx: CaseContext) -> None:
    job = write_job(ctx, model={"factory": f"{HERE}:hf_llama"}, metrics=f"{HERE}:accuracy_not_a_tensor")
    train_dry_run(ctx, job)


# ----------------------------------------------------------------------------- the cases: broken files


def _factory_file(ctx: CaseContext, body: bytes) -> dict:
    (ctx.tmp / "model_file.py").write_bytes(body)
    return {"factory": "model_file.py:build_model"}


def launch_factory_syntax_error(ctx: CaseContext) -> None:
    model = _factory_file(ctx, b"import torch\n\ndef build_model(:\n    return torch.nn.Linear(4, 2)\n")
    train_dry_run(ctx, write_job(ctx, model=model))


def launch_factory_import_error(ctx: CaseContext) -> None:
    model = _factory_file(
        ctx, b"import torch\nimport not_a_module_xyz\n\ndef build_model():\n    return None\n"
    )
    train_dry_run(ctx, write_job(ctx, model=model))


def launch_job_file_not_utf8(ctx: CaseContext) -> None:
    job = write_job(ctx, model={"factory": f"{HERE}:hf_llama"})
    lines = job.read_bytes().splitlines(keepends=True)
    lines.insert(2, b"# caf\xe9 au lait\n")  # Latin-1, as an editor on another system may save it
    job.write_bytes(b"".join(lines))
    train_dry_run(ctx, job)


def launch_text_data_not_utf8(ctx: CaseContext) -> None:
    from tests.support.text import make_tokenizer, sentences

    texts = [f'{{"text": "{t}"}}\n'.encode() for t in sentences(8)]
    texts[4] = b'{"text": "na\xefve caf\xe9"}\n'  # line 5: Latin-1 bytes
    (ctx.tmp / "train.jsonl").write_bytes(b"".join(texts))
    data = {
        "format": "jsonl",
        "path": "train.jsonl",
        "tokenizer": str(make_tokenizer(ctx.tmp / "tokenizer")),
        "seq_len": 4,
        "cache_dir": str(ctx.tmp / "cache"),
    }
    train_dry_run(ctx, write_job(ctx, model={"factory": f"{HERE}:hf_llama"}, data=data))


# ----------------------------------------------------------------------------- the cases: merak plan


def plan_memory_per_device_unreadable(ctx: CaseContext) -> None:
    # The model factory fails when called: the refusal must come before the model is built and profiled.
    # (Without --memory-per-device, merak plan takes layout: auto's default: tests/core/test_plan_memory.py.)
    job = write_job(ctx, model={"factory": "tests.e2e._bad_input_jobs:build_failing"})
    run_cli(ctx, "plan", str(job), "--world-size", "2", "--memory-per-device", "lots")


def launch_auto_without_a_global_batch(ctx: CaseContext) -> None:
    # layout: auto keeps the global batch the written degrees give; dp null with tp=3 on 4 ranks gives none.
    job = write_job(
        ctx, model={"factory": f"{HERE}:hf_gpt2"}, training={"layout": "auto", "dp": None, "tp": 3}
    )
    train_dry_run(ctx, job, "--nproc-per-node", "4")


def launch_report_to_mlflow_not_installed(ctx: CaseContext) -> None:
    with unittest.mock.patch.dict(sys.modules, {"mlflow": None}):  # as if not installed
        job = write_job(
            ctx, model={"factory": f"{HERE}:hf_gpt2"}, training={"report_to": ["tensorboard", "mlflow"]}
        )
        train_dry_run(ctx, job)


def plan_cluster_for_a_dtype_without_a_peak(ctx: CaseContext) -> None:
    # A cluster file gives bf16 and fp32 peaks; a float64 job was priced at the bf16 one (its parameters were
    # not float32). Refused before the model is built (the factory fails if called).
    job = write_job(
        ctx, model={"factory": "tests.e2e._bad_input_jobs:build_failing"}, training={"dtype": "float64"}
    )
    run_cli(ctx, "plan", str(job), "--cluster", "h100-sxm-8x", "--nodes", "1")


# ----------------------------------------------------------------------------- the cases: forward


MODELS = "tests.e2e._bad_input_model_cases"


def launch_batch_key_matches_no_parameter(ctx: CaseContext) -> None:
    job = write_job(
        ctx,
        model={"factory": f"{MODELS}:Masked"},
        data={"factory": f"{MODELS}:features", "kwargs": {"keys": ["x", "maks"]}},
    )
    train_dry_run(ctx, job)


def launch_dict_output_without_logits(ctx: CaseContext) -> None:
    job = write_job(ctx, model={"factory": f"{MODELS}:Scored"}, data={"factory": f"{MODELS}:features"})
    train_dry_run(ctx, job)


def launch_pp_model_returning_a_kv_cache(ctx: CaseContext) -> None:
    job = write_job(
        ctx, model={"factory": f"{HERE}:hf_llama"}, training={"pp": 2, "gradient_accumulation_steps": 2}
    )
    train_dry_run(ctx, job)


def launch_pp_untraceable_model(ctx: CaseContext) -> None:
    job = write_job(
        ctx,
        model={"factory": f"{MODELS}:Gated"},
        data={"factory": f"{MODELS}:features"},
        training={"pp": 2, "gradient_accumulation_steps": 2},
    )
    train_dry_run(ctx, job)


def launch_pretrained_folder_with_merged_legacy_tensors(ctx: CaseContext) -> None:
    # transformers writes a Mixtral's experts one by one and fuses them on load; model.pretrained does not
    # merge tensors yet: refused before torchrun, naming the save that writes the model's own names.
    from tests.tp._hf_families import build_family

    folder = ctx.tmp / "mixtral"
    build_family("mixtral").save_pretrained(str(folder))
    train_dry_run(ctx, write_job(ctx, model={"pretrained": str(folder)}))
