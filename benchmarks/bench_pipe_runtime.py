"""Benchmarks of the merak-pipe runtime, each a ratio measured in one run on this machine.

Sections (``--section``; default all):

- ``torch``: step time of ``merak_pipe.PipelineRunner`` against torch.distributed.pipelining
  (``PipelineStage`` + ``Schedule1F1B`` / ``ScheduleGPipe``) on identical stage modules and
  microbatches: an 8-layer GPT-style model of width 128, 2 and 4 stages (target: ours <= 0.9x).
  A third variant, merak_pipe with ``early_receives=0`` (every receive posted where lowering puts
  it, as torch does), shows in the same run what posting receives early gains.
  The *floor* column is the schedule's makespan with free communication, simulated from each
  stage's forward/backward timed alone in the same run: no runtime of that schedule can go below
  it, so ``floor/torch`` bounds the ratio any runtime could reach here.
- ``shifted``: Merak's shifted-critical-path schedule against 1F1B, both with full
  recomputation, 8 microbatches, 2 and 4 stages (target: >= 5% faster at 2 stages).
- ``sim``: measured step time against the simulator's prediction from the per-action costs
  measured in the same runs, for every built-in schedule (target: error <= 10%).
- ``actions``: the runtime's fixed cost per action: the step time of every registered schedule
  on tiny stages (one 16-wide linear layer each, so compute is negligible), profile off, divided
  by the busiest rank's number of actions (compute and send/recv of the lowered schedule); then,
  from steps run inside ``runner.profiling()``, the host time per span of each kind (and the part
  of it neither waiting nor inside torch operators: the runtime's Python). The profiled steps
  measure the profiler too ([Note: profile cost] in ``merak_pipe/action_profile.py``); the
  fixed cost per action comes from the unprofiled steps.

Each configuration starts fresh gloo processes (one per stage), warms up, then alternates the
compared variants step by step (a barrier before every step) so that machine noise hits both
alike; a step's time is the slowest rank's, and the table shows medians.

Run: ``OMP_NUM_THREADS=1 PYTHONPATH=packages/merak-pipe/src:. python benchmarks/bench_pipe_runtime.py [--quick]``
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.support.models import GPT, DecoderConfig, lm_loss  # noqa: E402

WIDTH, LAYERS, HEADS, VOCAB = 128, 8, 4, 512


# --------------------------------------------------------------------------- model


class _Embed(nn.Module):
    def __init__(self, model: GPT) -> None:
        super().__init__()
        self.wte, self.wpe = model.wte, model.wpe

    def forward(self, ids_bt: torch.Tensor) -> torch.Tensor:
        return self.wte(ids_bt) + self.wpe(torch.arange(ids_bt.size(1)))


class _Head(nn.Module):
    def __init__(self, model: GPT) -> None:
        super().__init__()
        self.ln_f, self.lm_head = model.ln_f, model.lm_head

    def forward(self, x_bth: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(x_bth))


def stage_module(stage: int, num_stages: int, seq: int) -> nn.Sequential:
    """Stage ``stage`` of an 8-layer GPT (width 128): layers split evenly, embedding/head at the ends."""
    torch.manual_seed(0)
    cfg = DecoderConfig(
        vocab_size=VOCAB,
        hidden_size=WIDTH,
        num_layers=LAYERS,
        num_heads=HEADS,
        num_kv_heads=HEADS,
        intermediate_size=4 * WIDTH,
        max_seq_len=max(seq, 64),
    )
    model = GPT(cfg)
    model.lm_head.weight = nn.Parameter(model.wte.weight.detach().clone())  # untied: stages are independent
    per = LAYERS // num_stages
    units: list[nn.Module] = list(model.blocks[stage * per : (stage + 1) * per])
    if stage == 0:
        units.insert(0, _Embed(model))
    if stage == num_stages - 1:
        units.append(_Head(model))
    return nn.Sequential(*units)


def batch(batch_size: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, VOCAB, (batch_size, seq), generator=g), torch.randint(
        0, VOCAB, (batch_size, seq), generator=g
    )


# --------------------------------------------------------------------------- process harness


def _worker(
    rank: int, world: int, store_dir: str, fn: Callable[..., Any], args: tuple[Any, ...], queue: Any
) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    store = dist.FileStore(os.path.join(store_dir, "store"), world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=120))
    try:
        result = fn(*args)
        queue.put((rank, result))
    finally:
        dist.destroy_process_group()


def run_world(world: int, fn: Callable[..., Any], *args: Any) -> list[Any]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as store_dir:
        procs = [
            ctx.Process(target=_worker, args=(r, world, store_dir, fn, args, queue)) for r in range(world)
        ]
        for p in procs:
            p.start()
        results: dict[int, Any] = {}
        for _ in range(world):
            rank, result = queue.get(timeout=1800)
            results[rank] = result
        for p in procs:
            p.join()
    return [results[r] for r in range(world)]


def _timed(step: Callable[[], None]) -> float:
    dist.barrier()
    start = time.perf_counter()
    step()
    elapsed = torch.tensor([time.perf_counter() - start])
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed)


def _alternate(variants: dict[str, Callable[[], None]], warmup: int, rounds: int) -> dict[str, float]:
    """Median step time of each variant, and the median of per-round paired ratios to the first.

    Variants run back to back within a round (in alternating order), so both see the same load
    of the shared machine; the paired ratio is the robust number, the medians are context.
    """
    for _ in range(warmup):
        for step in variants.values():
            step()
    names = list(variants)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            times[name].append(_timed(variants[name]))
    out = {name: statistics.median(ts) for name, ts in times.items()}
    base = names[0]
    for name in names[1:]:
        out[f"{name}/{base}"] = statistics.median(
            t / b for t, b in zip(times[name], times[base], strict=True)
        )
    return out


# --------------------------------------------------------------------------- sections


def _ours(
    schedule_name: str,
    module: nn.Module,
    world: int,
    microbatches: int,
    recompute: Any = None,
    record_timing: bool = False,
    early_receives: int | None = None,
) -> Any:
    from merak_pipe.runner import PipelineRunner
    from merak_pipe.schedules import build_schedule
    from merak_pipe.stage import PipelineStage

    num_stages = 2 * world if schedule_name == "interleaved-1f1b" else world
    schedule = build_schedule(
        schedule_name,
        num_stages=num_stages,
        num_microbatches=microbatches,
        num_ranks=world,
        recompute=recompute,
    )
    stage = PipelineStage(module, stage_index=dist.get_rank(), num_stages=world)
    if num_stages != world:
        raise ValueError("use _ours_multi for several stages per rank")
    early = {} if early_receives is None else {"early_receives": early_receives}
    return PipelineRunner([stage], schedule, loss_fn=lm_loss, record_timing=record_timing, **early)


def torch_section(
    world: int, microbatches: int, batch_size: int, seq: int, warmup: int, rounds: int, lookahead: int = 0
) -> dict[str, float]:
    from torch.distributed.pipelining import PipelineStage as TorchStage
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

    rank = dist.get_rank()
    module = stage_module(rank, world, seq)
    ids, labels = batch(batch_size, seq)
    first, last = rank == 0, rank == world - 1
    out: dict[str, float] = {}
    for name, torch_cls in (("1f1b", Schedule1F1B), ("gpipe", ScheduleGPipe)):
        ours = _ours(name, module, world, microbatches)
        late = _ours(name, module, world, microbatches, early_receives=0)
        deep = _ours(name, module, world, microbatches, early_receives=lookahead) if lookahead else None
        theirs = torch_cls(
            TorchStage(module, rank, world, torch.device("cpu")), microbatches, loss_fn=lm_loss
        )

        def run_ours(ours: Any = ours) -> None:
            module.zero_grad(set_to_none=True)
            ours.step(ids if first else None, labels if last else None)

        def run_late(late: Any = late) -> None:
            module.zero_grad(set_to_none=True)
            late.step(ids if first else None, labels if last else None)

        def run_torch(theirs: Any = theirs) -> None:
            module.zero_grad(set_to_none=True)
            if first:
                theirs.step(ids, return_outputs=False)
            elif last:
                theirs.step(target=labels, return_outputs=False)
            else:
                theirs.step(return_outputs=False)

        variants = {"torch": run_torch, "ours": run_ours, "late": run_late}
        if deep is not None:

            def run_deep(deep: Any = deep) -> None:
                module.zero_grad(set_to_none=True)
                deep.step(ids if first else None, labels if last else None)

            variants["deep"] = run_deep
        medians = _alternate(variants, warmup, rounds)
        out[f"{name}/deep"] = medians.get("deep/torch", float("nan"))
        out[f"{name}/ours"] = medians["ours"]
        out[f"{name}/torch"] = medians["torch"]
        out[f"{name}/ratio"] = medians["ours/torch"]
        out[f"{name}/late"] = medians["late/torch"]
        out[f"{name}/floor"] = _floor(name, module, world, microbatches, ids, labels, seq, rounds)
    return out


def _floor(
    schedule_name: str,
    module: nn.Module,
    world: int,
    microbatches: int,
    ids: torch.Tensor,
    labels: torch.Tensor,
    seq: int,
    rounds: int,
) -> float:
    """The schedule's makespan with free communication: the best any runtime could do here.

    Every rank times its own stage's forward and backward on the step's microbatches with no
    communication (all ranks at once, so the cores are shared as in the real step); the medians
    go into the simulator with zero point-to-point latency.
    """
    from merak_pipe.schedules import build_schedule
    from merak_pipe.sim import CostModel, simulate

    rank = dist.get_rank()
    mb = ids.size(0) // microbatches
    fwd, bwd = [], []
    dist.barrier()
    for r in range(rounds):
        for m in range(microbatches):
            if rank == 0:
                x: torch.Tensor = ids[m * mb : (m + 1) * mb]
            else:
                x = torch.randn(
                    mb, seq, WIDTH, generator=torch.Generator().manual_seed(r * 64 + m)
                ).requires_grad_()
            start = time.perf_counter()
            out = module(x)
            if rank == world - 1:
                out = lm_loss(out, labels[m * mb : (m + 1) * mb]) / microbatches
            mid = time.perf_counter()
            out.backward(None if out.dim() == 0 else torch.ones_like(out))
            fwd.append(mid - start)
            bwd.append(time.perf_counter() - mid)
    module.zero_grad(set_to_none=True)
    costs: list[Any] = [None] * world
    dist.all_gather_object(costs, (statistics.median(fwd), statistics.median(bwd)))
    schedule = build_schedule(schedule_name, num_stages=world, num_microbatches=microbatches, num_ranks=world)
    model = CostModel(forward=[c[0] for c in costs], backward=[c[1] for c in costs], p2p_latency=0.0)
    return simulate(schedule, model).makespan


def shifted_section(
    world: int, microbatches: int, batch_size: int, seq: int, warmup: int, rounds: int
) -> dict[str, float]:
    rank = dist.get_rank()
    module = stage_module(rank, world, seq)
    ids, labels = batch(batch_size, seq)
    first, last = rank == 0, rank == world - 1
    variants = {}
    for name in ("1f1b", "shifted-critical-path"):
        runner = _ours(name, module, world, microbatches, recompute="full")

        def run(runner: Any = runner) -> None:
            module.zero_grad(set_to_none=True)
            runner.step(ids if first else None, labels if last else None)

        variants[name] = run
    return _alternate(variants, warmup, rounds)


def sim_section(
    world: int,
    microbatches: int,
    batch_size: int,
    seq: int,
    warmup: int,
    rounds: int,
    schedule_name: str,
    recompute: Any,
) -> dict[str, float] | None:
    from merak_pipe.runner import PipelineRunner
    from merak_pipe.schedules import build_schedule
    from merak_pipe.sim import simulate
    from merak_pipe.stage import PipelineStage
    from merak_pipe.timing import gather_timings, measured_costs, measured_step_time

    rank = dist.get_rank()
    num_stages = 2 * world if schedule_name == "interleaved-1f1b" else world
    schedule = build_schedule(
        schedule_name,
        num_stages=num_stages,
        num_microbatches=microbatches,
        num_ranks=world,
        recompute=recompute,
    )
    stages = [
        PipelineStage(stage_module(s, num_stages, seq), stage_index=s, num_stages=num_stages)
        for s in schedule.stages_of(rank)
    ]
    runner = PipelineRunner(stages, schedule, loss_fn=lm_loss, record_timing=True)
    ids, labels = batch(batch_size, seq)
    measured, predicted = [], []
    for i in range(warmup + rounds):
        for stage in stages:
            stage.module.zero_grad(set_to_none=True)
        dist.barrier()
        runner.step(ids if runner.holds_first_stage else None, labels if runner.holds_last_stage else None)
        everyone = gather_timings(runner.timings)
        if i >= warmup and rank == 0:
            # Each step is predicted from its own measured costs, so a slow moment of the shared
            # machine weighs on the measurement and the prediction alike.
            measured.append(measured_step_time(everyone))
            predicted.append(simulate(schedule, measured_costs(everyone, schedule)).makespan)
    if rank != 0:
        return None
    errors = [p / m - 1 for p, m in zip(predicted, measured, strict=True)]
    return {
        "measured": statistics.median(measured),
        "predicted": statistics.median(predicted),
        "error": statistics.median(errors),
        "worst": max(errors, key=abs),
    }


# --------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="fewer rounds (a smoke run)")
    parser.add_argument("--section", choices=["torch", "shifted", "sim", "actions", "all"], default="all")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument(
        "--rounds", type=int, default=None, help="measured steps per variant (default 20, 5 quick)"
    )
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 4], help="stage counts (torch, shifted)")
    parser.add_argument(
        "--lookahead",
        type=int,
        default=0,
        help="torch section: also run the runner with early_receives=N (a fourth variant, same rounds)",
    )
    args = parser.parse_args()
    warmup, rounds = (2, 5) if args.quick else (3, 20)
    rounds = args.rounds or rounds
    seq = args.seq
    print(
        f"torch {torch.__version__}, {os.cpu_count()} CPUs, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}, "
        f"GPT {LAYERS} layers width {WIDTH}, seq {seq}, float32, gloo; medians of {rounds} steps after {warmup} warm-up"
    )

    if args.section in ("torch", "all"):
        print("\n## merak_pipe vs torch.distributed.pipelining (step time, s)")
        print(
            "| stages | microbatches | schedule | merak_pipe (median) | torch (median) | ours/torch (median of paired steps) "
            "| ours without early receives / torch | floor: free communication | floor/torch |"
            + (f" ours with early_receives={args.lookahead} / torch |" if args.lookahead else "")
        )
        print("|---|---|---|---|---|---|---|---|---|" + ("---|" if args.lookahead else ""))
        for world in args.stages:
            m, b = 8, 16
            res = run_world(world, torch_section, world, m, b, seq, warmup, rounds, args.lookahead)[0]
            for name in ("1f1b", "gpipe"):
                ours, theirs = res[f"{name}/ours"], res[f"{name}/torch"]
                floor = res[f"{name}/floor"]
                print(
                    f"| {world} | {m} | {name} | {ours:.4f} | {theirs:.4f} | {res[f'{name}/ratio']:.3f} "
                    f"| {res[f'{name}/late']:.3f} | {floor:.4f} | {floor / theirs:.3f} |"
                    + (f" {res[f'{name}/deep']:.3f} |" if args.lookahead else ""),
                    flush=True,
                )

    if args.section in ("shifted", "all"):
        print("\n## shifted-critical-path vs 1F1B, full recompute (step time, s)")
        print(
            "| stages | microbatches | 1f1b (median) | shifted-critical-path (median) | speed-up (median of paired steps) |"
        )
        print("|---|---|---|---|---|")
        for world in args.stages:
            m, b = 8, 16
            res = run_world(world, shifted_section, world, m, b, seq, warmup, rounds)[0]
            base, ours = res["1f1b"], res["shifted-critical-path"]
            speedup = 1 / res["shifted-critical-path/1f1b"] - 1
            print(f"| {world} | {m} | {base:.4f} | {ours:.4f} | {100 * speedup:+.1f}% |", flush=True)

    if args.section in ("sim", "all"):
        print("\n## measured step time vs simulator prediction from measured per-action costs (s)")
        print("| schedule | ranks | stages | recompute | measured | predicted | median error | worst step |")
        print("|---|---|---|---|---|---|---|---|")
        world, m, b = 2, 8, 16
        for name, recompute in (
            ("gpipe", None),
            ("1f1b", None),
            ("1f1b", "full"),
            ("interleaved-1f1b", None),
            ("shifted-critical-path", "full"),
            ("zb-h1", None),
        ):
            res = run_world(world, sim_section, world, m, b, seq, warmup, rounds, name, recompute)[0]
            stages = 2 * world if name == "interleaved-1f1b" else world
            print(
                f"| {name} | {world} | {stages} | {recompute or 'none'} | {res['measured']:.4f} | "
                f"{res['predicted']:.4f} | {100 * res['error']:+.1f}% | {100 * res['worst']:+.1f}% |",
                flush=True,
            )

    if args.section in ("actions", "all"):
        from _pipe_actions import print_actions

        print_actions(run_world, args.stages, warmup, rounds)


if __name__ == "__main__":
    main()
