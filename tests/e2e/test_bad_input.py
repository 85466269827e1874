"""Bad input never gets far: one table of user mistakes, each raising one clear error early.

Every row names a mistake a user makes with Merak's public API (``init``, ``TrainingArguments``,
job files and the ``merak`` CLI, ``merak_tp.parallelize``, ``merak_graph.trace/partition``,
``merak_pipe.build_schedule`` / ``PipelineStage`` / ``PipelineRunner``, the ``Trainer``), the
exception type it must raise and a regular expression that the message must match: the
regex names the bad value *and* the fix. The faulty call runs under a guard that turns any
collective or p2p call into a failure (see [Note: before any collective] in
``_bad_input_support.py``), so a row passes only if the error comes before any process-group
work. Rows marked ``ranks`` run on a pool of gloo ranks (every rank must raise the same
error; ``timeout_s`` turns a hang into a failure); the others run in this process, where no
process group exists at all.

A row marked ``xfail(strict=True)`` does not raise a clear error today; the reason names a
patch in ``/tmp/badinput_patches/`` that fixes it (apply it with ``git apply`` and drop the mark).

Checkpoint rows also check that no file under ``checkpoints/`` changed (bytes and modification
times) and that a failed resume left the trainer's parameters as they were.
"""

from __future__ import annotations

import importlib.util
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from merak_core.checkpoint import CheckpointError
from merak_graph import InputMismatchError, PartitionError, TraceError
from tests.e2e import _bad_input_cases as cases
from tests.e2e import _bad_input_ckpt_cases as ckpt_cases
from tests.e2e import _bad_input_config_cases as config_cases
from tests.e2e import _bad_input_launch_cases as launch_cases
from tests.e2e import _bad_input_lora_cases as lora_cases
from tests.e2e import _bad_input_model_cases as model_cases
from tests.e2e._bad_input_support import CaseContext, CliExit, reraise_agreed, run_case_on_rank
from tests.support.dist import run_on_ranks

RANK_TIMEOUT_S = 60.0
PATCHES = "/tmp/badinput_patches"  # where fixes for new xfail rows are kept while they are reviewed


@dataclass(frozen=True)
class Row:
    """One mistake: the case function, where it runs, the expected error."""

    fn: Callable[[CaseContext], None]
    exc: type[BaseException]
    match: str
    ranks: int = 0
    """0: in this process (no process group); otherwise the number of gloo ranks."""


def _row(
    fn: Callable[[CaseContext], None],
    exc: type[BaseException],
    match: str,
    *,
    ranks: int = 0,
    patch: str | None = None,
    marks: tuple[pytest.MarkDecorator, ...] = (),
) -> object:
    if patch is not None:
        marks = (*marks, pytest.mark.xfail(strict=True, reason=f"needs {PATCHES}/{patch}"))
    return pytest.param(Row(fn, exc, match, ranks), id=fn.__name__, marks=marks)


def _all(*words: str) -> str:
    """A regex that matches when every (escaped) word occurs, in any order."""
    return "".join(f"(?=[\\s\\S]*{re.escape(w)})" for w in words)


ROWS = [
    # ------------------------------------------------------------------ degrees and layout
    _row(
        cases.init_degrees_vs_env_world,
        ValueError,
        _all("WORLD_SIZE=4", "3*1*2=6", "pass dp=None to infer it"),
    ),
    _row(
        cases.init_degrees_vs_process_group,
        ValueError,
        _all("WORLD_SIZE=2", "2*2*1=4", "change the degrees"),
        ranks=2,
    ),
    _row(cases.init_tp_zero, ValueError, _all("tp must be a positive integer, got 0", "pass e.g. tp=1")),
    _row(cases.init_pp_negative, ValueError, _all("pp must be a positive integer, got -2", "pass e.g. pp=1")),
    _row(cases.init_dp_zero, ValueError, _all("dp must be a positive integer or None (inferred)", "got 0")),
    _row(
        cases.init_tp_not_dividing_world,
        ValueError,
        _all("tp*pp=3*1=3 does not divide WORLD_SIZE=8", "choose tp and pp whose product divides 8"),
    ),
    _row(cases.args_pp_zero, ValueError, _all("pp=0", "an integer >= 1", "set pp")),
    _row(cases.args_dp_zero, ValueError, _all("dp=0", "an integer >= 1 or null", "set dp")),
    _row(
        cases.trainer_degrees_vs_world,
        ValueError,
        _all("WORLD_SIZE=2", "2*1*2=4", "change the degrees"),
        ranks=2,
    ),
    _row(
        cases.trainer_args_vs_layout_dp,
        ValueError,
        _all("TrainingArguments.dp=1", "layout has dp=2", "same degrees"),
        ranks=2,
    ),
    _row(
        cases.trainer_args_vs_layout_pp,
        ValueError,
        _all("TrainingArguments.pp=2", "layout has pp=1", "build both from the same degrees"),
        ranks=2,
    ),
    _row(
        cases.cli_dry_run_world,
        CliExit,
        _all("--nproc-per-node=4", "= 4 processes", "dp*tp*pp = 8", "make them equal"),
    ),
    _row(
        cases.cli_dry_run_dp_inferred_not_dividing,
        CliExit,
        _all("tp*pp=2*3=6 does not divide WORLD_SIZE=4", "choose tp and pp"),
    ),
    _row(
        cases.cli_dry_run_dp_inferred_without_nproc,
        CliExit,
        _all("training.dp is not set", "pass --nproc-per-node"),
    ),
    _row(cases.cli_missing_job_file, CliExit, _all("exit 2", "jbo.yaml", "does not exist")),
    _row(
        cases.cli_multi_node_without_endpoint, CliExit, _all("--nnodes > 1 needs --rdzv-endpoint HOST:PORT")
    ),
    _row(
        cases.init_cuda_unavailable,
        ValueError,
        _all("device='cuda'", "CUDA is not available", "device='cpu'"),
        marks=(pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here"),),
    ),
    _row(
        cases.cli_override_unknown_key,
        CliExit,
        _all("exit 2", "'learning_rat'", "did you mean 'learning_rate'"),
    ),
    # ------------------------------------------------------------------ tensor parallelism
    _row(
        cases.tp_heads_not_divisible,
        ValueError,
        _all("blocks.0.attn.num_heads=3", "tensor-parallel size 2", "TP degree that divides 3"),
        ranks=2,
    ),
    _row(
        cases.tp_kv_heads_not_divisible,
        ValueError,
        _all("layers.0.self_attn.num_kv_heads=1", "tensor-parallel size 2", "TP degree that divides 1"),
        ranks=2,
    ),
    _row(
        cases.tp_vocab_not_divisible,
        ValueError,
        _all("num_embeddings=95", "tensor-parallel size 2", "TP degree that divides 95"),
        ranks=2,
    ),
    _row(
        cases.tp_unknown_plan_name,
        ValueError,
        _all("unknown TP plan 'gtp'", "registered plans", "'gpt'"),
        ranks=2,
    ),
    _row(cases.tp_unknown_style, ValueError, _all("'colum'", "expected one of", "'column'")),
    _row(
        cases.tp_vocab_parallel_id_out_of_range,
        ValueError,
        _all(
            "token id 96 is outside the vocabulary of 96 (ids 0..95)",
            "vocab-parallel embedding",
            "fix the tokenizer or the data",
        ),
        ranks=2,
    ),
    _row(
        cases.tp_plan_matches_nothing,
        ValueError,
        _all("matched no module of GPT", "layers.*.fc1", "model.named_modules()"),
        ranks=2,
    ),
    _row(
        cases.tp_style_on_wrong_module,
        ValueError,
        _all("ln_f", "style 'column' needs an nn.Linear", "got LayerNorm"),
        ranks=2,
    ),
    _row(
        cases.trainer_unknown_tp_plan, ValueError, _all("unknown TP plan 'gtp'", "registered plans"), ranks=2
    ),
    _row(cases.args_unknown_tp_plan_name, ValueError, _all("tp_plan='gtp'", "'gpt'")),
    _row(cases.args_unknown_tp_style, ValueError, _all("tp_plan=", "'colum'", "styles from", "'column'")),
    _row(
        cases.args_overlap_chunks_zero,
        ValueError,
        _all("overlap_chunks=0", "an integer >= 1", "set overlap_chunks"),
    ),
    _row(
        cases.tp_overlap_chunks_zero,
        ValueError,
        _all("overlap_chunks=0", "an integer >= 1", "1 = no overlap"),
        ranks=2,
    ),
    # ------------------------------------------------------------------ schedules, recomputation, memory
    _row(
        cases.schedule_unknown_name,
        ValueError,
        _all("unknown schedule '1F1B'", "'1f1b'", "register_schedule"),
    ),
    _row(cases.args_unknown_schedule, ValueError, _all("schedule='pipedream'", "'1f1b'", "set schedule")),
    _row(cases.schedule_zero_microbatches, ValueError, _all("num_microbatches=0", "int >= 1")),
    _row(cases.args_unknown_recompute, ValueError, _all("recompute='selective'", "'stage_aware'", "'full'")),
    _row(
        cases.args_recompute_fraction_out_of_range,
        ValueError,
        _all("recompute='uniform:1.5'", "(0, 1]", "'uniform:0.5'"),
    ),
    _row(cases.schedule_unknown_recompute, ValueError, _all("recompute='stage_aware'", "RecomputePlan")),
    _row(cases.args_stage_aware_without_budget, ValueError, _all("recompute='stage_aware'", "memory_budget")),
    _row(cases.args_bad_memory_budget, ValueError, _all("'12 gigs'", "'12GiB'")),
    _row(
        cases.stage_aware_budget_too_small,
        ValueError,
        _all("stage 0 does not fit its memory budget", "budget is 1000", "larger budget"),
    ),
    _row(
        cases.trainer_memory_budget_nothing_fits,
        ValueError,
        _all("does not fit its memory budget", "budget is 1024", "larger budget"),
        ranks=2,
    ),
    _row(
        cases.partition_memory_limit_too_small,
        PartitionError,
        _all("memory_limit=100", "raise memory_limit", "add stages"),
    ),
    # ------------------------------------------------------------------ tracing and partitioning
    _row(
        cases.trace_untraceable_model,
        TraceError,
        _all(
            "could not trace _Wrapper",
            "in module 'gate' (_Branchy)",
            "_bad_input_cases.py:",
            "if h.sum() > 0",
            "leaf_modules=(_Branchy,)",
        ),
    ),
    _row(
        cases.partition_fewer_shards_than_stages,
        PartitionError,
        _all("shards", "num_stages=8", "use at most"),
    ),
    _row(
        cases.partition_inputs_wrong_keys,
        InputMismatchError,
        _all("keys ['input_ids']", "GPT.forward does not accept", "'input_ids_bt'"),
    ),
    _row(
        cases.partition_too_many_inputs,
        InputMismatchError,
        _all("2 example inputs", "GPT.forward takes 1 positional inputs", "'input_ids_bt'"),
    ),
    _row(cases.partitioned_run_wrong_inputs, InputMismatchError, _all("takes 1 inputs", "got 2")),
    # ------------------------------------------------------------------ pipeline runtime
    _row(
        cases.runner_batch_not_divisible,
        ValueError,
        _all("batch size 6", "not divisible into 4 microbatches", "multiple of 4"),
        ranks=2,
    ),
    _row(
        cases.runner_batch_smaller_than_microbatches,
        ValueError,
        _all("batch size 2", "fewer than the schedule's 4 microbatches", "fewer microbatches"),
        ranks=2,
    ),
    _row(
        cases.runner_stage_count_vs_schedule,
        ValueError,
        _all("num_stages=3", "has 2 stages", "use the same stage count"),
        ranks=2,
    ),
    _row(
        cases.runner_schedule_ranks_vs_group,
        ValueError,
        _all("runs on 4 pipeline ranks", "group has 2", "num_ranks=2"),
        ranks=2,
    ),
    _row(cases.stage_index_out_of_range, ValueError, _all("stage_index=2", "0..1", "0-based index")),
    _row(
        cases.schedule_option_of_other_schedule,
        TypeError,
        _all("schedule '1f1b' takes no option 'virtual_stages'", "'interleaved-1f1b'"),
    ),
    # ------------------------------------------------------------------ configuration files
    _row(
        config_cases.args_from_dict_unknown_key,
        ValueError,
        _all("unknown TrainingArguments key 'learning_rat'", "did you mean 'learning_rate'"),
    ),
    _row(
        config_cases.args_from_yaml_unknown_key,
        ValueError,
        _all("train.yaml", "'gradient_accumulation'", "did you mean 'gradient_accumulation_steps'"),
    ),
    _row(config_cases.args_override_without_equals, ValueError, _all("override 'max_steps'", "key=value")),
    _row(cases.args_from_yaml_missing_file, FileNotFoundError, _all("No such file", "trian.yaml")),
    _row(config_cases.args_override_bad_type, ValueError, _all("tp='two'", "wrong type", "expected int")),
    _row(
        config_cases.job_unknown_section,
        ValueError,
        _all("unknown section 'trainig'", "did you mean 'training'"),
    ),
    _row(
        config_cases.job_override_without_equals,
        ValueError,
        _all("override 'training.max_steps'", "section.key=value"),
    ),
    _row(
        config_cases.job_override_bad_type, ValueError, _all("max_steps='many'", "wrong type", "expected int")
    ),
    _row(
        config_cases.job_factory_missing_file, ValueError, _all("model.factory", "modle.py", "does not exist")
    ),
    _row(
        config_cases.job_factory_missing_function,
        ValueError,
        _all("model.factory", "'buld_model'", "did you mean 'build_model'"),
    ),
    _row(
        config_cases.job_factory_not_a_spec,
        ValueError,
        _all("'model.build_model'", "'file.py:function' or 'package.module:function'"),
    ),
    _row(
        config_cases.job_data_labels_unknown_value,
        ValueError,
        _all("data.labels='hf' is invalid", "expected 'shifted'", "or 'unshifted'"),
    ),
    # ------------------------------------------------------------------ training fields
    _row(
        config_cases.args_negative_learning_rate,
        ValueError,
        _all("learning_rate=-0.0003", ">= 0.0", "set learning_rate"),
    ),
    _row(
        config_cases.args_nonfinite_skip_limit_negative,
        ValueError,
        _all("nonfinite_max_consecutive_skips=-1", "an integer >= 0 (0: no limit)", "set nonfinite_max"),
    ),
    _row(
        config_cases.args_bf16_with_float64,
        ValueError,
        _all("bf16=True with dtype='float64'", "set dtype='float32'"),
    ),
    _row(config_cases.args_zero_stage_4, ValueError, _all("zero_stage=4", "0 (off), 1", "3 (and parameters")),
    _row(config_cases.args_unknown_dtype, ValueError, _all("dtype='fp16'", "'float16'", "set dtype")),
    _row(
        config_cases.lr_decay_without_total_steps,
        ValueError,
        _all("lr_scheduler_type='cosine'", "max_steps=-1", "pass num_training_steps"),
    ),
    # ------------------------------------------------------------------ merak train, before torchrun (one line, exit 2)
    _row(
        launch_cases.launch_microbatches_fewer_than_pp,
        CliExit,
        _all(
            "exit 2",
            "training.gradient_accumulation_steps=1",
            "training.pp=2",
            "set training.gradient_accumulation_steps=2",
        ),
    ),
    _row(
        launch_cases.launch_heads_not_divisible_by_tp,
        CliExit,
        _all("exit 2", "training.tp=2", "num_attention_heads=3", "choose a TP degree that divides 3"),
    ),
    _row(
        launch_cases.launch_kv_heads_not_divisible_by_tp,
        CliExit,
        _all("exit 2", "training.tp=2", "num_key_value_heads=1", "choose a TP degree that divides 1"),
    ),
    _row(
        launch_cases.launch_dataset_smaller_than_global_batch,
        CliExit,
        _all(
            "exit 2",
            "10 samples",
            "global batch of 16",
            "training.per_device_train_batch_size=4",
            "training.gradient_accumulation_steps=4",
            "at most 10",
        ),
    ),
    _row(
        launch_cases.launch_seq_len_beyond_positions,
        CliExit,
        _all(
            "exit 2",
            "data.kwargs.seq_len=6",
            "4 positions",
            "transformer.wpe.num_embeddings",
            "set data.kwargs.seq_len to at most 4",
        ),
    ),
    _row(
        launch_cases.launch_every_label_ignored,
        CliExit,
        _all("exit 2", "every label of the first training batch is -100", "label masking"),
    ),
    _row(
        launch_cases.launch_metrics_raises,
        CliExit,
        _all(
            "exit 2",
            "metrics 'tests.e2e._bad_input_launch_cases:accuracy_as_float' fails",
            "cannot be converted to Scalar",
            "_bad_input_launch_cases.py:",
        ),
    ),
    _row(
        launch_cases.launch_metrics_returns_numbers,
        CliExit,
        _all(
            "exit 2", "accuracy_not_a_tensor", "non-tensor values {'accuracy': 'float'}", "per-example values"
        ),
    ),
    _row(
        launch_cases.launch_factory_syntax_error,
        CliExit,
        _all(
            "exit 2",
            "model.factory: importing",
            "model_file.py",
            "SyntaxError",
            "model_file.py:3",
            "fix the file",
        ),
    ),
    _row(
        launch_cases.launch_factory_import_error,
        CliExit,
        _all(
            "exit 2",
            "model.factory: importing",
            "No module named 'not_a_module_xyz'",
            "model_file.py:2",
            "install 'not_a_module_xyz'",
        ),
    ),
    _row(
        launch_cases.launch_job_file_not_utf8,
        CliExit,
        _all(
            "exit 2",
            "job file",
            "job.yaml' line 3, column 6",
            "byte 0xe9 is not UTF-8",
            "save the file as UTF-8",
        ),
    ),
    _row(
        launch_cases.launch_text_data_not_utf8,
        CliExit,
        _all(
            "exit 2",
            "data.path",
            "train.jsonl' line 5, column 13",
            "byte 0xef is not UTF-8",
            "save the file as UTF-8",
        ),
    ),
    _row(
        launch_cases.plan_memory_per_device_unreadable,
        CliExit,
        _all("exit 2", "merak plan: error: cannot read memory size 'lots'", "'12GiB'"),
    ),
    _row(
        launch_cases.launch_auto_without_a_global_batch,
        CliExit,
        _all(
            "exit 2",
            "layout='auto' keeps the job's global batch",
            "cp*tp*pp=3 does not divide the 4 ranks",
            "set training.dp",
        ),
    ),
    _row(
        launch_cases.launch_report_to_mlflow_not_installed,
        CliExit,
        _all("exit 2", "report_to names 'mlflow'", "pip install 'merak-core[mlflow]'"),
    ),
    _row(
        launch_cases.plan_cluster_for_a_dtype_without_a_peak,
        CliExit,
        _all("exit 2", "training.dtype='float64'", "peaks for bf16 and fp32 only", "training.dtype=float32"),
    ),
    _row(
        launch_cases.launch_pretrained_folder_with_merged_legacy_tensors,
        CliExit,
        _all(
            "exit 2",
            "lacks 4 of the model's parameters",
            "experts.gate_up_proj",
            "transformers converts the tensors of MixtralForCausalLM",
            "save_original_format=False",
        ),
    ),
    _row(
        launch_cases.launch_batch_key_matches_no_parameter,
        CliExit,
        _all(
            "exit 2",
            "first training batch",
            "'maks' matches no parameter of Masked.forward",
            "did you mean 'mask'",
        ),
    ),
    _row(
        launch_cases.launch_dict_output_without_logits,
        CliExit,
        _all(
            "exit 2",
            "Scored.forward returns a dict with keys ['scores'] and no 'logits'",
            "loss: file.py:function",
        ),
    ),
    _row(
        launch_cases.launch_pp_untraceable_model,
        CliExit,
        _all(
            "exit 2",
            "training.pp=2",
            "cannot be traced",
            "in module 'gate' (Gate)",
            "_bad_input_model_cases.py:",
            "trace_leaves: ['gate']",
            "(pp=1)",
        ),
    ),
    _row(
        launch_cases.launch_pp_model_returning_a_kv_cache,
        CliExit,
        _all("exit 2", "training.pp=2", "LlamaForCausalLM", "KV cache", "use_cache=False", "(pp=1)"),
    ),
    # ------------------------------------------------------------------ the Trainer
    _row(
        model_cases.trainer_pp_untraceable_model,
        ValueError,
        _all("pp=2", "cannot be traced", "in module 'gate' (Gate)", "trace_leaves: ['gate']", "(pp=1)"),
        ranks=2,
    ),
    _row(
        model_cases.trainer_batch_key_matches_no_parameter,
        ValueError,
        _all("'maks' matches no parameter of Masked.forward", "did you mean 'mask'", "rename or drop"),
        ranks=2,
    ),
    _row(
        cases.trainer_two_stages_per_rank_schedule_without_virtual_stages,
        ValueError,
        _all(
            "schedule 'zb_v' runs 2 stage(s) per pipeline rank but virtual_stages=1", "set virtual_stages=2"
        ),
        ranks=2,
    ),
    _row(
        cases.trainer_fewer_microbatches_than_stages,
        ValueError,
        _all("gradient_accumulation_steps=1", "fewer than pp=2 stages", "at least 2 microbatches"),
        ranks=2,
    ),
    _row(
        config_cases.trainer_unshifted_labels_on_class_ids,
        ValueError,
        _all(
            "labels: unshifted (data.labels)", "1-d torch.int64 tensor of shape [2]", "data.labels: shifted"
        ),
        ranks=2,
    ),
    _row(
        cases.trainer_dataset_smaller_than_global_batch,
        ValueError,
        _all(
            "5 samples",
            "global batch of 8",
            "smaller batch",
            "per_device_train_batch_size x gradient_accumulation_steps x dp",
        ),
        ranks=2,
    ),
    _row(
        cases.trainer_batch_without_labels,
        ValueError,
        _all("keys ['input_ids']", "no 'labels'", "add labels in the collate function"),
        ranks=2,
    ),
    _row(
        cases.trainer_tp_without_plan,
        ValueError,
        _all("no built-in TP plan for Sequential", "Write a TPPlan"),
        ranks=2,
    ),
    _row(
        cases.trainer_pp_model_too_small,
        PartitionError,
        _all("only 1 shards", "num_stages=2", "at most 1 stages"),
        ranks=2,
    ),
    _row(
        cases.trainer_pp_float_labels_for_cross_entropy,
        ValueError,
        _all("loss_fn cannot take the model's output", "torch.float64", "integer class ids"),
        ranks=2,
    ),
    _row(
        cases.trainer_pp_labels_of_another_shape,
        ValueError,
        _all("loss_fn cannot take the model's output", "shape [2, 2]", "Fix the labels"),
        ranks=2,
    ),
    # ------------------------------------------------------------------ checkpoints (see [Note: checkpoint rows])
    _row(
        ckpt_cases.ckpt_resume_partial_tmp_dir,
        CheckpointError,
        _all("step_2.tmp", "is partial", "load the previous step_<N> directory or 'latest'"),
        ranks=2,
    ),
    _row(
        ckpt_cases.ckpt_resume_missing_dcp_metadata,
        CheckpointError,
        _all("step_7", "is partial", ".metadata file is missing"),
        ranks=2,
    ),
    _row(
        ckpt_cases.ckpt_resume_corrupt_meta_file,
        CheckpointError,
        _all("step_8", "is corrupt", "cannot read merak_checkpoint.json"),
        ranks=2,
    ),
    _row(
        ckpt_cases.ckpt_resume_latest_without_checkpoint,
        CheckpointError,
        _all("no checkpoint to resume from", "checkpoints", "set save_steps"),
        ranks=2,
    ),
    _row(
        ckpt_cases.ckpt_resume_other_model,
        CheckpointError,
        _all(
            "step_1",
            "written for another model",
            "0.weight: checkpoint [8, 4] vs model [6, 4]",
            "Load a checkpoint of this model",
        ),
        ranks=2,
    ),
    _row(
        ckpt_cases.ckpt_resume_other_batch_size,
        CheckpointError,
        _all("saved with global_batch_size=4", "this loader has global_batch_size=8", "resume with the same"),
        ranks=2,
    ),
    _row(
        ckpt_cases.ckpt_resume_other_dataset,
        CheckpointError,
        _all(
            "saved over a training set of '16 samples, sha256",
            "this loader reads '24 samples, sha256",
            "the training set changed (its size or its samples)",
            "resume with the same data",
        ),
        ranks=2,
    ),
    _row(
        ckpt_cases.ckpt_new_run_into_old_output_dir,
        CheckpointError,
        _all("already holds checkpoints", "step_1", "trainer.resume('latest')", "new output_dir"),
        ranks=2,
    ),
    # ------------------------------------------------------------------ exports
    _row(
        ckpt_cases.ckpt_export_with_another_models_config,
        CliExit,
        _all(
            "exit 2",
            "does not hold the model",
            "(GPT2LMHeadModel)",
            "tensors are not in that model, e.g. ['0.bias', '0.weight', '2.bias']",
            "nothing was written",
            "Pass --pretrained the folder the checkpoint's run started from",
        ),
        ranks=2,
        marks=(
            pytest.mark.transformers,
            pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers"),
        ),
    ),
    _row(
        ckpt_cases.ckpt_export_onto_a_file,
        CliExit,
        _all("exit 2", "--to-hf", ".safetensors' is an existing file", "give a new or existing folder"),
        ranks=2,
    ),
    _row(
        ckpt_cases.cli_dry_run_export_hf_dir_is_a_file,
        CliExit,
        _all("exit 2", "training.export_hf_dir", "is an existing file", "an export writes a folder"),
    ),
    # ------------------------------------------------------------------ LoRA
    _row(
        lora_cases.lora_targets_match_nothing,
        CliExit,
        _all(
            "exit 2",
            "model.lora.target_modules=['qproj', 'o_proj']",
            "matches no module",
            "nearest: ['q_proj'",
            "list some of them",
        ),
    ),
    _row(
        lora_cases.lora_rank_not_positive,
        CliExit,
        _all("exit 2", "model.lora.r=0", "must be a positive integer", "e.g. r: 8"),
    ),
    _row(
        lora_cases.lora_target_not_a_linear,
        CliExit,
        _all("exit 2", "selects 'embed', a Embedding", "LoRA wraps linear layers only", "remove the entry"),
    ),
    _row(lora_cases.lora_unknown_key, CliExit, _all("exit 2", "unknown key model.lora.rank", "valid:")),
    _row(
        lora_cases.trainer_lora_targets_match_nothing,
        ValueError,
        _all("model.lora.target_modules=['q_proj']", "matches no module", "all-linear"),
    ),
]


@pytest.mark.parametrize("row", ROWS)
def test_bad_input_raises_one_clear_error_early(row: Row, tmp_path: Path) -> None:
    if row.ranks:
        outcomes = run_on_ranks(
            row.ranks,
            run_case_on_rank,
            row.fn.__module__,
            row.fn.__name__,
            str(tmp_path),
            timeout_s=RANK_TIMEOUT_S,
        )
        with pytest.raises(row.exc, match=row.match):
            reraise_agreed(outcomes)
    else:
        if dist.is_available() and dist.is_initialized():
            pytest.skip("this test process holds a default process group; the row needs none")
        env = {k: os.environ.get(k) for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR")}
        try:
            with pytest.raises(row.exc, match=row.match):
                row.fn(CaseContext(tmp_path))
        finally:
            for key, value in env.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
        assert not (dist.is_available() and dist.is_initialized()), "the row left a process group behind"


def test_table_is_broad() -> None:
    """At least 30 distinct mistakes, each case function used once."""
    names = [p.values[0].fn.__name__ for p in ROWS]  # type: ignore[attr-defined]
    assert len(names) == len(set(names)) >= 30


def test_tuple_dataset_is_not_bad_input_under_pp(tmp_path: Path) -> None:
    """Not a mistake: ``(inputs, labels)`` samples with pp=2 train, and the first loss equals one process's.

    Without the patch the single input tensor is taken as a sequence of inputs (one per sample)
    and tracing fails with a misleading "2 example inputs given" error.
    """
    losses = run_on_ranks(2, cases.tuple_dataset_pp_first_loss, str(tmp_path), timeout_s=RANK_TIMEOUT_S)
    assert losses[0] == pytest.approx(cases.tuple_dataset_reference_loss(), rel=1e-6)
