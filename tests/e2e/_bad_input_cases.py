"""The user mistakes of the bad-input table, one module-level function each.

Each function takes a :class:`~tests.e2e._bad_input_support.CaseContext`, does the set-up a
user would do (outside the guard), then makes the mistake inside ``ctx.guard()`` (no
collective may run there, see [Note: before any collective]). Functions run either in the
test process (no process group exists) or on pooled gloo ranks, as the table says.
"""

from __future__ import annotations

import contextlib
import io
import os
import textwrap
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from tests.e2e._bad_input_support import CaseContext, CliExit
from tests.support.models import GPT, DecoderConfig, Llama

# ----------------------------------------------------------------------------- small pieces


class _Tokens(Dataset):
    """``size`` samples of 8 token ids; ``labels=False`` leaves the labels out."""

    def __init__(self, size: int, *, labels: bool = True, vocab: int = 96) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (size, 9), generator=g)
        self.labels = labels

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        out = {"input_ids": self.ids[i, :-1]}
        if self.labels:
            out["labels"] = self.ids[i, 1:]
        return out


def _gpt(**cfg: Any) -> nn.Module:
    torch.manual_seed(0)
    return GPT(DecoderConfig(num_layers=2, **cfg)).double()


def _args(ctx: CaseContext, **overrides: Any) -> Any:
    from merak_core import TrainingArguments

    values: dict[str, Any] = dict(
        output_dir=str(ctx.tmp / "out"),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=2,
        dtype="float64",
    )
    values.update(overrides)
    return TrainingArguments(**values)


class _Branchy(nn.Module):
    """Control flow on a tensor value: neither fx nor export can trace it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        if h.sum() > 0:  # data-dependent branch
            return h * 2
        return h


class _Wrapper(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Linear(4, 4)
        self.gate = _Branchy()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gate(self.pre(x))


def _mlp(depth: int = 4) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(depth)]).double()


def _write_job(
    ctx: CaseContext,
    training: str = "dp: 1\n  tp: 1\n  pp: 1",
    *,
    model: str = "model.py:build_model",
    extra: str = "",
) -> Path:
    (ctx.tmp / "model.py").write_text(
        textwrap.dedent("""
        import torch

        def build_model():
            return torch.nn.Linear(4, 2)

        def build_data():
            return [(torch.zeros(4), 0)] * 8
    """)
    )
    job = ctx.tmp / "job.yaml"
    job.write_text(
        f"model:\n  factory: {model}\ndata:\n  factory: model.py:build_data\n{extra}"
        f"training:\n  {training}\n  output_dir: {ctx.tmp / 'out'}\n"
    )
    return job


class _Pairs(Dataset):
    def __init__(self, size: int = 16) -> None:
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(size, 4, generator=g, dtype=torch.float64)
        self.y = torch.randint(0, 3, (size,), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


# ----------------------------------------------------------------------------- layout / degrees


def init_degrees_vs_env_world(ctx: CaseContext) -> None:
    from merak_core import init

    os.environ.update(WORLD_SIZE="4", RANK="0", LOCAL_RANK="0")
    try:
        with ctx.guard():
            init(dp=3, tp=1, pp=2, device="cpu")
    finally:
        for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
            os.environ.pop(key, None)


def init_degrees_vs_process_group(ctx: CaseContext) -> None:
    from merak_core import init

    with ctx.guard():
        init(dp=2, tp=2, pp=1, device="cpu")  # 4 ranks asked for, the group has 2


def init_tp_zero(ctx: CaseContext) -> None:
    from merak_core import init

    with ctx.guard():
        init(tp=0, device="cpu")


def init_pp_negative(ctx: CaseContext) -> None:
    from merak_core import init

    with ctx.guard():
        init(pp=-2, device="cpu")


def init_dp_zero(ctx: CaseContext) -> None:
    from merak_core import init

    with ctx.guard():
        init(dp=0, device="cpu")


def init_tp_not_dividing_world(ctx: CaseContext) -> None:
    from merak_core.parallel.rank_grid import resolve_degrees

    with ctx.guard():
        resolve_degrees(8, None, tp=3, pp=1)


def args_pp_zero(ctx: CaseContext) -> None:
    with ctx.guard():
        _args(ctx, pp=0)


def args_dp_zero(ctx: CaseContext) -> None:
    with ctx.guard():
        _args(ctx, dp=0)


def trainer_degrees_vs_world(ctx: CaseContext) -> None:
    from merak_core import Trainer

    args = _args(ctx, dp=2, tp=1, pp=2)  # 4 ranks, the job has 2
    with ctx.guard():
        Trainer(_gpt(), args, _Tokens(16))


def trainer_args_vs_layout_dp(ctx: CaseContext) -> None:
    from merak_core import Trainer, init

    layout = init(dp=2, device="cpu")
    args = _args(ctx, dp=1)
    with ctx.guard():
        Trainer(_gpt(), args, _Tokens(16), layout=layout)


def trainer_args_vs_layout_pp(ctx: CaseContext) -> None:
    from merak_core import Trainer, init

    layout = init(dp=2, device="cpu")
    args = _args(ctx, pp=2)
    with ctx.guard():
        Trainer(_gpt(), args, _Tokens(16), layout=layout)


def _merak(ctx: CaseContext, argv: list[str]) -> None:
    """Run the ``merak`` CLI in this process; a failure becomes :class:`CliExit` (status + stderr)."""
    from merak_core.cli import main

    err = io.StringIO()
    with ctx.guard(), contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            status = main(argv)
        except SystemExit as exc:
            raise CliExit(f"exit {exc.code}") from None
    if status:
        raise CliExit(f"exit {status}: {err.getvalue().strip()}")


def cli_dry_run_world(ctx: CaseContext) -> None:
    job = _write_job(ctx, "dp: 2\n  tp: 2\n  pp: 2")
    _merak(ctx, ["train", str(job), "--nproc-per-node=4", "--dry-run"])


def cli_dry_run_dp_inferred_not_dividing(ctx: CaseContext) -> None:
    job = _write_job(ctx, "tp: 2\n  pp: 3")
    _merak(ctx, ["train", str(job), "--nproc-per-node=4", "--dry-run"])


def cli_dry_run_dp_inferred_without_nproc(ctx: CaseContext) -> None:
    job = _write_job(ctx, "tp: 2\n  pp: 2")
    _merak(ctx, ["train", str(job), "--dry-run"])


def cli_missing_job_file(ctx: CaseContext) -> None:
    _merak(ctx, ["train", str(ctx.tmp / "jbo.yaml"), "--dry-run"])


def cli_override_unknown_key(ctx: CaseContext) -> None:
    job = _write_job(ctx)
    _merak(ctx, ["train", str(job), "training.learning_rat=1e-3", "--dry-run"])


# ----------------------------------------------------------------------------- tensor parallel


def tp_heads_not_divisible(ctx: CaseContext) -> None:
    import merak_tp

    model = _gpt(hidden_size=24, num_heads=3, num_kv_heads=3)
    with ctx.guard():
        merak_tp.parallelize(model, group=None)


def tp_kv_heads_not_divisible(ctx: CaseContext) -> None:
    import merak_tp

    torch.manual_seed(0)
    model = Llama(DecoderConfig(num_layers=2, num_heads=4, num_kv_heads=1)).double()
    with ctx.guard():
        merak_tp.parallelize(model, group=None)


def tp_vocab_not_divisible(ctx: CaseContext) -> None:
    import merak_tp

    model = _gpt(vocab_size=95)
    with ctx.guard():
        merak_tp.parallelize(model, group=None)


def tp_unknown_plan_name(ctx: CaseContext) -> None:
    import merak_tp

    model = _gpt()
    with ctx.guard():
        merak_tp.parallelize(model, "gtp", group=None)


def tp_unknown_style(ctx: CaseContext) -> None:
    import merak_tp

    with ctx.guard():
        merak_tp.TPPlan(name="mine", layers={"blocks.*.mlp.fc_in": "colum", "blocks.*.mlp.fc_out": "row"})


def tp_plan_matches_nothing(ctx: CaseContext) -> None:
    import merak_tp

    plan = merak_tp.TPPlan(name="mine", layers={"layers.*.fc1": "column", "layers.*.fc2": "row"})
    model = _gpt()
    with ctx.guard():
        merak_tp.parallelize(model, plan, group=None)


def tp_style_on_wrong_module(ctx: CaseContext) -> None:
    import merak_tp

    plan = merak_tp.TPPlan(name="mine", layers={"ln_f": "column"})
    model = _gpt()
    with ctx.guard():
        merak_tp.parallelize(model, plan, group=None)


def args_unknown_tp_plan_name(ctx: CaseContext) -> None:
    from merak_core.job import JobConfig

    _args(
        ctx, tp_plan="gtp"
    )  # a name is looked up once the job's modules (which may register it) are imported
    job = _write_job(ctx, training="tp_plan: gtp")
    with ctx.guard():
        JobConfig.from_yaml(job)


def args_unknown_tp_style(ctx: CaseContext) -> None:
    with ctx.guard():
        _args(ctx, tp_plan={"blocks.*.mlp.fc_in": "colum"})


def args_overlap_chunks_zero(ctx: CaseContext) -> None:
    with ctx.guard():
        _args(ctx, overlap_chunks=0)


def tp_overlap_chunks_zero(ctx: CaseContext) -> None:
    import merak_tp

    model = _gpt()
    with ctx.guard():
        merak_tp.parallelize(model, group=None, overlap_chunks=0)


# ----------------------------------------------------------------------------- schedules, recompute, memory


def schedule_unknown_name(ctx: CaseContext) -> None:
    from merak_pipe import build_schedule

    with ctx.guard():
        build_schedule("1F1B", num_stages=2, num_microbatches=4)


def args_unknown_schedule(ctx: CaseContext) -> None:
    with ctx.guard():
        _args(ctx, schedule="pipedream")


def schedule_zero_microbatches(ctx: CaseContext) -> None:
    from merak_pipe import build_schedule

    with ctx.guard():
        build_schedule("1f1b", num_stages=2, num_microbatches=0)


def args_unknown_recompute(ctx: CaseContext) -> None:
    with ctx.guard():
        _args(ctx, recompute="selective")


def args_recompute_fraction_out_of_range(ctx: CaseContext) -> None:
    with ctx.guard():
        _args(ctx, recompute="uniform:1.5")


def schedule_unknown_recompute(ctx: CaseContext) -> None:
    from merak_pipe import build_schedule

    with ctx.guard():
        build_schedule("1f1b", num_stages=2, num_microbatches=4, recompute="stage_aware")


def args_stage_aware_without_budget(ctx: CaseContext) -> None:
    with ctx.guard():
        _args(ctx, pp=2, recompute="stage_aware")


def args_bad_memory_budget(ctx: CaseContext) -> None:
    with ctx.guard():
        _args(ctx, memory_budget="12 gigs")


def stage_aware_budget_too_small(ctx: CaseContext) -> None:
    from merak_pipe import build_schedule, stage_aware_plan

    schedule = build_schedule("1f1b", num_stages=2, num_microbatches=4)
    with ctx.guard():
        stage_aware_plan(
            layer_activation_bytes=[[100.0] * 4, [100.0] * 4],
            memory_budget=1000.0,
            static_bytes=990.0,
            schedule=schedule,
        )


def partition_memory_limit_too_small(ctx: CaseContext) -> None:
    import merak_graph

    model = _mlp()
    with ctx.guard():
        merak_graph.partition(
            model, 2, example_inputs=(torch.zeros(2, 8, dtype=torch.float64),), memory_limit=100.0
        )


# ----------------------------------------------------------------------------- tracing / partitioning


def trace_untraceable_model(ctx: CaseContext) -> None:
    import merak_graph

    model = _Wrapper()
    with ctx.guard():
        merak_graph.trace(model, example_inputs=(torch.zeros(2, 4),))


def partition_fewer_shards_than_stages(ctx: CaseContext) -> None:
    import merak_graph

    model = _mlp(depth=1)
    with ctx.guard():
        merak_graph.partition(model, 8, example_inputs=(torch.zeros(2, 8, dtype=torch.float64),))


def partition_inputs_wrong_keys(ctx: CaseContext) -> None:
    import merak_graph

    model = _gpt()
    with ctx.guard():
        merak_graph.partition(model, 2, example_inputs={"input_ids": torch.zeros(2, 8, dtype=torch.long)})


def partition_too_many_inputs(ctx: CaseContext) -> None:
    import merak_graph

    model = _gpt()
    ids = torch.zeros(2, 8, dtype=torch.long)
    with ctx.guard():
        merak_graph.partition(model, 2, example_inputs=(ids, ids))


def partitioned_run_wrong_inputs(ctx: CaseContext) -> None:
    import merak_graph

    model = _mlp()
    x = torch.zeros(2, 8, dtype=torch.float64)
    part = merak_graph.partition(model, 2, example_inputs=(x,))
    with ctx.guard():
        part.run(x, x)


# ----------------------------------------------------------------------------- pipeline runtime


def _two_stage_runner(num_stages_of_stage: int = 2, num_stages_of_schedule: int = 2) -> Any:
    import torch.distributed as dist

    from merak_pipe import PipelineRunner, PipelineStage, build_schedule

    rank = dist.get_rank()
    torch.manual_seed(rank)
    stage = PipelineStage(
        nn.Sequential(nn.Linear(4, 4)).double(), stage_index=rank, num_stages=num_stages_of_stage
    )
    schedule = build_schedule("1f1b", num_stages=num_stages_of_schedule, num_microbatches=4)
    return PipelineRunner([stage], schedule, loss_fn=lambda out, y: ((out - y) ** 2).mean())


def runner_batch_not_divisible(ctx: CaseContext) -> None:
    runner = _two_stage_runner()
    x = torch.zeros(6, 4, dtype=torch.float64)
    with ctx.guard():
        runner.step(x if runner.holds_first_stage else None, x if runner.holds_last_stage else None)


def runner_batch_smaller_than_microbatches(ctx: CaseContext) -> None:
    runner = _two_stage_runner()
    x = torch.zeros(2, 4, dtype=torch.float64)
    with ctx.guard():
        runner.step(x if runner.holds_first_stage else None, x if runner.holds_last_stage else None)


def runner_stage_count_vs_schedule(ctx: CaseContext) -> None:
    with ctx.guard():
        _two_stage_runner(num_stages_of_stage=3, num_stages_of_schedule=2)


def runner_schedule_ranks_vs_group(ctx: CaseContext) -> None:
    import torch.distributed as dist

    from merak_pipe import PipelineRunner, PipelineStage, build_schedule

    stage = PipelineStage(nn.Linear(4, 4), stage_index=dist.get_rank(), num_stages=4)
    schedule = build_schedule("gpipe", num_stages=4, num_microbatches=4)
    with ctx.guard():
        PipelineRunner([stage], schedule, loss_fn=lambda out, y: out.sum())


def stage_index_out_of_range(ctx: CaseContext) -> None:
    from merak_pipe import PipelineStage

    with ctx.guard():
        PipelineStage(nn.Linear(4, 4), stage_index=2, num_stages=2)


# ----------------------------------------------------------------------------- the Trainer (on ranks)


def trainer_two_stages_per_rank_schedule_without_virtual_stages(ctx: CaseContext) -> None:
    # ZB-V places two stages on every pipeline rank; the default virtual_stages=1 cannot run it.
    # (interleaved_1f1b takes any v, v=1 included, since the Trainer has virtual stages.)
    from merak_core import Trainer, init

    layout = init(pp=2, device="cpu")
    args = _args(ctx, pp=2, schedule="zb_v")
    with ctx.guard():
        Trainer(_gpt(), args, _Tokens(16), layout=layout)


def trainer_fewer_microbatches_than_stages(ctx: CaseContext) -> None:
    from merak_core import Trainer, init

    layout = init(pp=2, device="cpu")
    args = _args(ctx, pp=2, gradient_accumulation_steps=1)
    with ctx.guard():
        Trainer(_gpt(), args, _Tokens(16), layout=layout)


def trainer_dataset_smaller_than_global_batch(ctx: CaseContext) -> None:
    from merak_core import Trainer, init

    layout = init(dp=2, device="cpu")
    args = _args(ctx, dp=2)  # 2 x 2 microbatches x 2 replicas = 8 samples per step
    with ctx.guard():
        Trainer(_gpt(), args, _Tokens(5), layout=layout)


def trainer_batch_without_labels(ctx: CaseContext) -> None:
    from merak_core import Trainer, init

    layout = init(dp=2, device="cpu")
    args = _args(ctx, dp=2)
    with ctx.guard():
        Trainer(_gpt(), args, _Tokens(16, labels=False), layout=layout)


def trainer_unknown_tp_plan(ctx: CaseContext) -> None:
    from merak_core import Trainer, init

    layout = init(tp=2, device="cpu")
    args = _args(ctx, tp=2, tp_plan="gtp")
    with ctx.guard():
        Trainer(_gpt(), args, _Tokens(16), layout=layout)


def trainer_memory_budget_nothing_fits(ctx: CaseContext) -> None:
    from merak_core import Trainer, init

    layout = init(pp=2, device="cpu")
    args = _args(ctx, pp=2, recompute="stage_aware", memory_budget="1KiB")
    torch.manual_seed(0)
    model = Llama(DecoderConfig(num_layers=2)).double()  # untied: no shared-parameter groups to create
    with ctx.guard():
        Trainer(model, args, _Tokens(16), layout=layout)


# ----------------------------------------------------------------------------- more rows


def schedule_option_of_other_schedule(ctx: CaseContext) -> None:
    from merak_pipe import build_schedule

    with ctx.guard():
        build_schedule("1f1b", num_stages=2, num_microbatches=4, virtual_stages=2)


def args_from_yaml_missing_file(ctx: CaseContext) -> None:
    from merak_core import TrainingArguments

    with ctx.guard():
        TrainingArguments.from_yaml(ctx.tmp / "trian.yaml")


def init_cuda_unavailable(ctx: CaseContext) -> None:
    from merak_core import init

    with ctx.guard():
        init(device="cuda")


def cli_multi_node_without_endpoint(ctx: CaseContext) -> None:
    job = _write_job(ctx, "dp: 2\n  tp: 1\n  pp: 1")
    _merak(ctx, ["train", str(job), "--nnodes=2", "--nproc-per-node=1", "--dry-run"])


class _Features(Dataset):
    """``{"input": x, "labels": y}`` samples for ``nn.Sequential`` classifiers (``forward(input)``)."""

    def __init__(
        self, size: int = 16, *, label_dtype: torch.dtype = torch.long, label_width: int = 0
    ) -> None:
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(size, 4, generator=g, dtype=torch.float64)
        shape = (size, label_width) if label_width else (size,)
        self.y = torch.randint(0, 3, shape, generator=g).to(label_dtype)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input": self.x[i], "labels": self.y[i]}


def _classifier() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))


def trainer_tp_without_plan(ctx: CaseContext) -> None:
    from merak_core import Trainer, init

    layout = init(tp=2, device="cpu")
    args = _args(ctx, tp=2)
    with ctx.guard():
        Trainer(_classifier(), args, _Features(), layout=layout)


def trainer_pp_model_too_small(ctx: CaseContext) -> None:
    from merak_core import Trainer, init

    layout = init(pp=2, device="cpu")
    args = _args(ctx, pp=2)
    torch.manual_seed(0)
    with ctx.guard():
        Trainer(nn.Sequential(nn.Linear(4, 3)), args, _Features(), layout=layout)


def trainer_pp_float_labels_for_cross_entropy(ctx: CaseContext) -> None:
    from merak_core import Trainer, init

    layout = init(pp=2, device="cpu")
    args = _args(ctx, pp=2)
    # Unchecked, the last stage fails alone in the first step and stage 0 waits for gradients until the timeout.
    with ctx.guard():
        Trainer(_classifier(), args, _Features(label_dtype=torch.float64), layout=layout).train()


def trainer_pp_labels_of_another_shape(ctx: CaseContext) -> None:
    from merak_core import Trainer, init

    layout = init(pp=2, device="cpu")
    args = _args(ctx, pp=2)
    with ctx.guard():
        Trainer(_classifier(), args, _Features(label_width=2), layout=layout).train()


# ----------------------------------------------------------------------------- not a mistake (see the test)


def tuple_dataset_pp_first_loss(tmp: str) -> float | None:
    """Train one step with pp=2 on an ``(inputs, labels)`` tuple dataset; the logged loss (rank 0)."""
    import torch.distributed as dist

    from merak_core import Trainer, init

    layout = init(pp=2, device="cpu")
    args = _args(CaseContext(Path(tmp)), pp=2, max_steps=1, logging_steps=1)
    history = Trainer(_classifier(), args, _Pairs(), layout=layout).train()
    return history[0]["loss"] if dist.get_rank() == 0 else None


def tuple_dataset_reference_loss() -> float:
    """The same step in one process: mean of the default loss over the two microbatches of the first batch."""
    from merak_core import TrainingArguments
    from merak_core.data.loader import StageAwareDataLoader
    from merak_core.trainer import default_loss

    args = TrainingArguments(per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=1)
    loader = StageAwareDataLoader(_Pairs(), batch_size=4, seed=args.seed, shuffle=True)
    batch = next(iter(loader))
    model = _classifier().double()
    losses = [
        default_loss(model(x), y) for x, y in zip(batch.inputs.chunk(2), batch.labels.chunk(2), strict=True)
    ]
    return float(sum(losses) / 2)


def tp_vocab_parallel_id_out_of_range(ctx: CaseContext) -> None:
    """Masked, id 96 of a 96-row table would embed as zeros on both TP ranks and train silently."""
    import merak_tp

    model = merak_tp.parallelize(_gpt(), group=None)
    with ctx.guard():
        model(torch.tensor([[1, 2, 96, 3]]))
