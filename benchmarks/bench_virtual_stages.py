"""Benchmark: interleaved-1F1B (virtual stages, v = 2) against 1F1B, measured in the Trainer, and the simulator.

Same model (the demo's GPT-style decoder, examples/addition/model.py), same initial weights, same
batches, same gloo ranks, same run. Per pipeline size pp in {2, 4} (dp = tp = 1), three Trainers on
every rank: ``schedule=1f1b`` (pp stages), ``schedule=interleaved_1f1b, virtual_stages=2``
(2 * pp stages, round-robin) and ``schedule=zb_v, virtual_stages=2`` (a V). Steps rotate between
them (and which goes first), each after a barrier, so a load change on a shared machine hits both alike; a step's time is the slowest rank's.
The ratios are medians over rounds of the per-round paired ratios against 1F1B.

Simulator (merak_pipe.simulate) columns, from each run's own per-action timings
(``merak_pipe.timing.measured_costs``, every rank gathered): ``sim`` is the schedule simulated on
the costs the same step measured (its error against the measured step); ``pred (halves)`` is the
interleaved (or ZB-V) schedule simulated on the 1F1B run's costs, each stage's forward/backward
split in two halves (ZB-V's I and W half a B each), over the 1F1B schedule simulated on the same
costs: what the simulator predicted before running them, until issue 31.

``pred+`` is the same prediction with what halving misses, measured in the same run, not guessed
([Note: prediction from 1F1B] below): the runtime's own cost per action (merak_core's
``measure_action_cost``, the number ``layout: auto`` measures; the simulator's
``CostModel.per_action``), the cost of a stage of half the layers against a whole one (its
forward and backward timed in one process on every rank, in thread CPU time, so the fixed cost per
call that halving does not halve is in it) and, for ZB-V, the split backward's ``I`` and ``W`` against a full ``B``
of that half stage; ``pred+ (1f1b's p)`` prices every schedule's actions at 1F1B's cost per
action, ``pred+ (its own p)`` at the schedule's own (the same probe run with it), ``pred+ cores``
adds the crowding of ranks on shared cores ([Note: shared cores in the prediction]). Each
``error`` is the predicted ratio against the measured one. The second
table shows where the rest of the error is: per kind, the schedule's own measured cost (its run's
``measured_costs``) over the cost predicted for it (median over stages and rounds), and the
simulator's error on the schedule's own costs.

Run (forked processes, FileStore rendezvous)::

    OMP_NUM_THREADS=1 python benchmarks/bench_virtual_stages.py [--quick] [--pp 2,4] [--rounds N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _data import Tokens
from _ranks import init_rank, rotated, run_ranks

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples" / "addition"))


def _trainer(cfg: dict[str, Any], pp: int, schedule: str, v: int) -> Any:
    from model import build_model  # type: ignore[import-not-found]

    from merak_core import Trainer
    from merak_core.config import TrainingArguments

    torch.manual_seed(0)
    model = build_model(
        depth=cfg["depth"], width=cfg["width"], heads=4, vocab_size=cfg["vocab"], context=cfg["seq"]
    )
    steps = cfg["rounds"] + cfg["warmup"]
    args = TrainingArguments(
        output_dir=tempfile.mkdtemp(prefix="merak-benchv-"),
        pp=pp,
        per_device_train_batch_size=cfg["micro_batch"],
        gradient_accumulation_steps=cfg["num_microbatches"],
        learning_rate=1e-3,
        lr_scheduler_type="constant",
        max_grad_norm=0.0,
        max_steps=steps,
        schedule=schedule,
        virtual_stages=v,
        seed=0,
        logging_steps=10**6,
    )
    data = Tokens(cfg["micro_batch"] * cfg["num_microbatches"] * steps, cfg["vocab"], cfg["seq"])
    return Trainer(model, args, data)


def _sim(trainer: Any, costs: Any) -> float:
    from merak_pipe import simulate

    return simulate(trainer.engine.schedule, costs).makespan


def _halved(costs: Any, pp: int, v: int) -> Any:
    """Per-stage costs of pp * v stages from pp measured stages: each split into v equal parts."""
    import dataclasses

    out = {}
    for name in ("forward", "backward"):
        values = getattr(costs, name)
        per = list(values) if isinstance(values, (list, tuple)) else [values] * pp
        out[name] = [per[s % pp] / v for s in range(pp * v)]
    return dataclasses.replace(
        costs, forward=out["forward"], backward=out["backward"], recompute=out["forward"]
    )


# [Note: prediction from 1F1B]
# The 1F1B run measures per stage F and B, each charged with the runtime's work around it
# ([Note: measured costs] in merak_pipe.timing): one action's own cost plus the sends and receives it
# issues, p per action and message. Take that out (``base = measured - p * (1 + messages)``), scale
# the rest by the measured half-stage ratio, map virtual stage t to the 1F1B stage that holds its
# layers (t // v), and let the simulator add p back per action and per message of the new
# placement (CostModel.per_action on a compute-only schedule). The first stage of ZB-V has no input
# gradient to compute: its I is the runtime's alone and its W a whole backward (the runner's
# fallback). The 1F1B denominator is simulated on the same base costs with the same p, which
# gives back its measured costs.


def _layers_stage(cfg: dict[str, Any], layers: int) -> Any:
    from model import Layer, TinyGPTConfig  # type: ignore[import-not-found]
    from torch import nn

    from merak_pipe.stage import PipelineStage

    config = TinyGPTConfig(
        width=cfg["width"], context=cfg["seq"], depth=layers, heads=4, vocab_size=cfg["vocab"]
    )
    module = nn.Sequential(*[Layer(config) for _ in range(layers)])
    return PipelineStage(module, stage_index=1, num_stages=3)  # a middle stage: input gradient needed


def _stage_terms(cfg: dict[str, Any], stages: dict[str, Any], reps: int = 3) -> dict[str, float]:
    """CPU seconds of F, B of a whole 1F1B stage's layers and F, B, I, W of half of them (medians of ``reps``).

    Thread CPU time (``time.thread_time``), not wall time: with more ranks than cores a wall-clock
    measurement of one call is as likely to include a descheduling as not, and only the ratios are used.
    """
    x = torch.randn(cfg["micro_batch"], cfg["seq"], cfg["width"])
    g = torch.randn_like(x)
    out: dict[str, list[float]] = {}
    clock = time.thread_time
    for rep in range(reps):
        for name in rotated(["full", "half", "split"], rep):
            stage = stages["half" if name == "split" else name]
            t0 = clock()
            stage.forward(0, (x.detach().requires_grad_(True),), {})
            t1 = clock()
            if name == "split":
                stage.backward_input(0, [g])
                t2 = clock()
                stage.backward_weight(0)
                out.setdefault("I", []).append(t2 - t1)
                out.setdefault("W", []).append(clock() - t2)
                continue
            stage.backward(0, [g])
            out.setdefault(f"F_{name}", []).append(t1 - t0)
            out.setdefault(f"B_{name}", []).append(clock() - t1)
    return {k: statistics.median(v) for k, v in out.items()}


def _probe(schedule: Any, microbatches: int) -> Any:
    """One step of ``schedule``'s pipeline on tiny stages (a 16 x 16 linear each) on this rank, as
    merak_core's ``measure_action_cost`` runs 1F1B: its step time over the busiest rank's lowered
    actions is the runtime's cost per action for that schedule."""
    from torch import nn

    from merak_pipe import PipelineRunner, PipelineStage

    rank, S = dist.get_rank(), schedule.num_stages
    with torch.random.fork_rng():
        torch.manual_seed(0)
        stages = [
            PipelineStage(nn.Linear(16, 16), stage_index=s, num_stages=S) for s in schedule.stages_of(rank)
        ]
        x, y = torch.randn(microbatches, 16), torch.randn(microbatches, 16)
    runner = PipelineRunner(stages, schedule, loss_fn=lambda out, target: ((out - target) ** 2).mean())
    return lambda: runner.step(
        x if runner.holds_first_stage else None, y if runner.holds_last_stage else None
    )


def _per_action(probe: Any, actions: int, rounds: int = 3) -> float:
    """Median over ``rounds`` steps of the probe (slowest rank) over its busiest rank's actions."""
    times = []
    for _ in range(rounds + 1):
        dist.barrier()
        start = time.perf_counter()
        probe()
        took = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        dist.all_reduce(took, op=dist.ReduceOp.MAX)
        times.append(float(took))
    return statistics.median(times[1:]) / actions


def _crossings(schedule: Any) -> list[int]:
    """Per stage: messages one of its F (or B) sends and receives across ranks."""
    rank, S = schedule.stage_to_rank, schedule.num_stages
    return [
        int(s > 0 and rank[s - 1] != rank[s]) + int(s < S - 1 and rank[s + 1] != rank[s]) for s in range(S)
    ]


def _base(costs: Any, schedule: Any, p: float) -> tuple[list[float], list[float]]:
    """The 1F1B run's F and B per stage without the runtime's own cost ([Note: prediction from 1F1B])."""
    cross = _crossings(schedule)
    fwd = [max(f - p * (1 + c), 0.0) for f, c in zip(costs.forward, cross, strict=True)]
    bwd = [max(b - p * (1 + c), 0.0) for b, c in zip(costs.backward, cross, strict=True)]
    return fwd, bwd


def _predicted_costs(
    costs: Any, one: Any, target: Any, terms: dict[str, float], p: float, p_target: float
) -> Any:
    """CostModel of ``target`` (v stages per rank) from the 1F1B run's ``costs`` plus the measured terms."""
    import dataclasses

    fwd1, bwd1 = _base(costs, one, p)
    v = target.num_stages // one.num_stages
    rf, rb = terms["F_half"] / terms["F_full"], terms["B_half"] / terms["B_full"]
    ri, rw = terms["I"] / terms["B_full"], terms["W"] / terms["B_full"]
    S = target.num_stages
    fwd = [fwd1[t // v] * rf for t in range(S)]
    bwd = [bwd1[t // v] * rb for t in range(S)]
    b_in = [0.0 if t == 0 else bwd1[t // v] * ri for t in range(S)]
    b_w = [bwd[t] if t == 0 else bwd1[t // v] * rw for t in range(S)]
    return dataclasses.replace(
        costs,
        forward=fwd,
        backward=[i + w for i, w in zip(b_in, b_w, strict=True)] if _is_split(target) else bwd,
        recompute=fwd,
        backward_input=b_in if _is_split(target) else None,
        backward_weight=b_w if _is_split(target) else None,
        per_action=p_target,
    )


def _is_split(schedule: Any) -> bool:
    from merak_pipe.ir import ActionKind

    return any(a.kind is ActionKind.BACKWARD_INPUT for acts in schedule.actions.values() for a in acts)


def _scaled(costs: Any, k: float) -> Any:
    """``costs`` with every duration (and the cost per action) times ``k``."""
    import dataclasses

    def times(value: Any) -> Any:
        return None if value is None else [x * k for x in value]

    return dataclasses.replace(
        costs,
        forward=times(costs.forward),
        backward=times(costs.backward),
        recompute=times(costs.recompute),
        backward_input=times(costs.backward_input),
        backward_weight=times(costs.backward_weight),
        per_action=costs.per_action * k,
    )


def _crowding(schedule: Any, costs: Any, cores: int) -> float:
    """Ranks computing at once over the cores (at least 1): how much slower each action runs when the
    pipeline's ranks share ``cores`` ([Note: shared cores in the prediction])."""
    from merak_pipe import simulate

    result = simulate(schedule, costs)
    return max(1.0, sum(result.busy) / result.makespan / cores)


# [Note: shared cores in the prediction]
# With more ranks than cores an action runs slower the more ranks compute at the same time, and a
# schedule with a smaller bubble keeps more of them computing: the 1F1B run's costs hold 1F1B's
# crowding, not the virtual-stage schedule's. ``pred+ cores`` divides the 1F1B costs by 1F1B's
# simulated crowding k1 (mean ranks busy / cores, at least 1) and multiplies the target's by its own,
# found by a few fixed-point rounds of simulate -> crowding -> rescale. At pp <= cores it is pred+.


def _with_cores(one: Any, base: Any, target: Any, predicted: Any, cores: int) -> float:
    """pred+ with each schedule's crowding of the shared cores (see the note above)."""
    from merak_pipe import simulate

    k1 = _crowding(one, base, cores)
    free = _scaled(predicted, 1 / k1)
    k = 1.0
    for _ in range(4):
        k = _crowding(target, _scaled(free, k), cores)
    return simulate(target, _scaled(free, k)).makespan / simulate(one, base).makespan


def _predict(
    costs: Any, modes: dict[str, Any], terms: dict[str, float], p: float, p_own: dict[str, float]
) -> dict[str, Any]:
    """Predicted ratio against 1F1B and predicted costs per mode, from the 1F1B run's measured costs:
    ``pred_plus`` with 1F1B's cost per action for every schedule, ``pred_own`` with each schedule's
    own (``p_own``, measured on tiny stages)."""
    import dataclasses

    from merak_pipe import simulate

    one = modes["1f1b"].engine.schedule
    fwd1, bwd1 = _base(costs, one, p)
    base = dataclasses.replace(costs, forward=fwd1, backward=bwd1, recompute=fwd1, per_action=p)
    denominator = simulate(one, base).makespan
    out: dict[str, Any] = {}
    for mode in ("interleaved", "zb_v"):
        target = modes[mode].engine.schedule
        predicted = _predicted_costs(costs, one, target, terms, p, p)
        out[f"{mode}_pred_plus"] = simulate(target, predicted).makespan / denominator
        own = _predicted_costs(costs, one, target, terms, p, p_own[mode])
        out[f"{mode}_pred_own"] = simulate(target, own).makespan / denominator
        out[f"{mode}_pred_cores"] = _with_cores(one, base, target, own, os.cpu_count() or 1)
        out[f"{mode}_pred_costs"] = own
    return out


def _kinds(costs: Any, predicted: Any, schedule: Any, p: float) -> dict[str, float]:
    """Per kind: median over stages of the measured charge over the predicted one (runtime's share included)."""
    cross = _crossings(schedule)
    ratios: dict[str, float] = {}
    for kind, name in (
        ("F", "forward"),
        ("B", "backward"),
        ("I", "backward_input"),
        ("W", "backward_weight"),
    ):
        got, want = getattr(costs, name), getattr(predicted, name)
        if got is None or want is None:
            continue
        extra = [p * (1 + c) if kind != "W" else p for c in cross]
        ratios[kind] = statistics.median(
            g / (w + e) for g, w, e in zip(got, want, extra, strict=True) if w + e > 0
        )
    return ratios


def _worker(rank: int, world: int, store_path: str, cfg: dict[str, Any], queue: Any) -> None:
    init_rank(rank, world, store_path, timeout_s=900)
    from merak_pipe.timing import gather_timings, measured_costs

    modes = {
        "1f1b": _trainer(cfg, world, "1f1b", 1),
        "interleaved": _trainer(cfg, world, "interleaved_1f1b", 2),
        "zb_v": _trainer(cfg, world, "zb_v", 2),
    }
    loaders = {m: iter(t.train_loader) for m, t in modes.items()}
    layers = cfg["depth"] // world
    stages = {"full": _layers_stage(cfg, layers), "half": _layers_stage(cfg, layers // 2)}
    from merak_core.planner.action_cost import busiest_actions, measure_action_cost

    virtual = ("interleaved", "zb_v")
    probes = {m: _probe(modes[m].engine.schedule, cfg["num_microbatches"]) for m in virtual}
    probe_actions = {m: busiest_actions(modes[m].engine.schedule) for m in virtual}

    rows: list[dict[str, float]] = []
    for step in range(cfg["warmup"] + cfg["rounds"]):
        row: dict[str, float] = {}
        measured: dict[str, Any] = {}
        for mode in rotated(list(modes), step):  # who goes first changes every round
            trainer = modes[mode]
            batch = next(loaders[mode])
            dist.barrier()
            start = time.perf_counter()
            trainer.training_step(batch.inputs, batch.labels, record_timing=True)
            took = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(took, op=dist.ReduceOp.MAX)
            timings = gather_timings(trainer.last_result.timings or [])
            costs = measured_costs(timings, trainer.engine.schedule)
            row[mode] = float(took)
            row[f"{mode}_pipe"] = max(t.end_s for t in timings) - min(t.start_s for t in timings)
            row[f"{mode}_sim"] = _sim(trainer, costs)
            measured[mode] = costs
        from merak_pipe import simulate

        row["pred_ratio"] = (
            simulate(modes["interleaved"].engine.schedule, _halved(measured["1f1b"], world, 2)).makespan
            / simulate(modes["1f1b"].engine.schedule, measured["1f1b"]).makespan
        )
        row["zb_v_pred_halves"] = (
            simulate(modes["zb_v"].engine.schedule, _halved(measured["1f1b"], world, 2)).makespan
            / simulate(modes["1f1b"].engine.schedule, measured["1f1b"]).makespan
        )
        # the measured terms of [Note: prediction from 1F1B], in the same round (every rank at once)
        p = measure_action_cost(microbatches=cfg["num_microbatches"], rounds=3, warmup=1)
        terms = _stage_terms(cfg, stages)
        merged = torch.tensor([terms[k] for k in sorted(terms)], dtype=torch.float64)
        dist.all_reduce(merged)
        terms = {k: float(v) / world for k, v in zip(sorted(terms), merged, strict=True)}
        row["per_action"] = p
        row.update({f"term_{k}": v for k, v in terms.items()})
        p_own = {m: _per_action(probes[m], probe_actions[m]) for m in virtual}
        predicted = _predict(measured["1f1b"], modes, terms, p, p_own)
        for mode in ("interleaved", "zb_v"):
            row[f"{mode}_pred_plus"] = predicted[f"{mode}_pred_plus"]
            row[f"{mode}_pred_own"] = predicted[f"{mode}_pred_own"]
            row[f"{mode}_pred_cores"] = predicted[f"{mode}_pred_cores"]
            row[f"{mode}_per_action"] = p_own[mode]
            for kind, ratio in _kinds(
                measured[mode], predicted[f"{mode}_pred_costs"], modes[mode].engine.schedule, p_own[mode]
            ).items():
                row[f"{mode}_kind_{kind}"] = ratio
        if step >= cfg["warmup"]:
            rows.append(row)
    if rank == 0:
        queue.put(rows)
    dist.barrier()
    dist.destroy_process_group()


def run(cfg: dict[str, Any], pp: int) -> list[dict[str, float]]:
    rows: list[dict[str, float]] = run_ranks(_worker, pp, cfg, timeout_s=3600)
    return rows


def _median(rows: list[dict[str, float]], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small model, few rounds")
    parser.add_argument("--pp", default="2,4", help="pipeline sizes (default 2,4)")
    parser.add_argument("--rounds", type=int, default=None, help="measured rounds (default 20; quick 4)")
    args = parser.parse_args(argv)
    cfg: dict[str, Any] = (
        dict(vocab=64, seq=16, width=64, depth=8, micro_batch=2, num_microbatches=8, warmup=1, rounds=4)
        if args.quick
        else dict(
            vocab=256, seq=64, width=128, depth=8, micro_batch=4, num_microbatches=8, warmup=3, rounds=20
        )
    )
    if args.rounds is not None:
        cfg["rounds"] = args.rounds
    print(
        f"torch {torch.__version__}, gloo, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; model: "
        f"{cfg['depth']} layers x width {cfg['width']}, seq {cfg['seq']}, {cfg['num_microbatches']} microbatches "
        f"of {cfg['micro_batch']}; median of {cfg['rounds']} paired rounds after {cfg['warmup']} warm-up"
    )
    print(
        "| pp | schedule | 1f1b ms | its ms | its / 1f1b (paired) | pred (halves) | pred+ (1f1b's p) | error "
        "| pred+ (its own p) | error | pred+ cores | error | sim error 1f1b / its own | p 1f1b / its own (us) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    terms_rows = []
    for pp in (int(x) for x in args.pp.split(",")):
        rows = run(cfg, pp)
        for m in ("interleaved", "zb_v"):
            ratio = statistics.median(r[m] / r["1f1b"] for r in rows)
            halves = _median(rows, "pred_ratio" if m == "interleaved" else "zb_v_pred_halves")
            plus, own = _median(rows, f"{m}_pred_plus"), _median(rows, f"{m}_pred_own")
            cores = _median(rows, f"{m}_pred_cores")
            err = [statistics.median(r[f"{k}_sim"] / r[f"{k}_pipe"] - 1 for r in rows) for k in ("1f1b", m)]
            print(
                f"| {pp} | {m} | {_median(rows, '1f1b') * 1e3:.1f} | {_median(rows, m) * 1e3:.1f} | {ratio:.3f} "
                f"| {halves:.3f} | {plus:.3f} | {100 * (plus / ratio - 1):+.1f}% | {own:.3f} "
                f"| {100 * (own / ratio - 1):+.1f}% | {cores:.3f} | {100 * (cores / ratio - 1):+.1f}% "
                f"| {100 * err[0]:+.1f}% / {100 * err[1]:+.1f}% "
                f"| {_median(rows, 'per_action') * 1e6:.0f} / {_median(rows, f'{m}_per_action') * 1e6:.0f} |",
                flush=True,
            )
        terms_rows.append((pp, rows))
    print()
    print(
        "| pp | schedule | measured / predicted F | B | I | W | half-stage F / whole F | half B / whole B "
        "| I / whole B | W / whole B |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for pp, rows in terms_rows:
        terms = [_median(rows, f"term_{k}") for k in ("F_half", "F_full", "B_half", "B_full", "I", "W")]
        for mode in ("interleaved", "zb_v"):
            kinds = [
                f"{_median(rows, f'{mode}_kind_{k}'):.3f}" if f"{mode}_kind_{k}" in rows[0] else "-"
                for k in "FBIW"
            ]
            print(
                f"| {pp} | {mode} | {' | '.join(kinds)} | {terms[0] / terms[1]:.3f} | {terms[2] / terms[3]:.3f} "
                f"| {terms[4] / terms[3]:.3f} | {terms[5] / terms[3]:.3f} |"
            )
    print(f"load average at the end: {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
