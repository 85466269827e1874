"""Benchmark: context parallelism (training.cp), ring and Ulysses against cp=1, and the longest sequence that fits.

Two tables, one run, the reference Llama of the tests (``tests/support/models.py``: GQA, rotary, causal,
routed through merak_tp's cp hook), float32, forked gloo ranks:

1. **Step time at the same global tokens.** One step (forward and backward of ``--batch`` sequences
   of ``--seq`` tokens, the token loss averaged as one process would) at cp=1 (one rank holds every
   token, the others wait) and at cp = 2 and 4 in ``ring`` and ``ulysses`` mode (each rank of one cp
   group holds ``seq / cp`` tokens; at cp=2 the other two ranks wait). The modes' steps alternate,
   the order rotating every round, each after a barrier; a step's time is the slowest rank's. Reported: the median step and the median of
   the per-round ratios against the same round's cp=1 step (paired rounds).
2. **The longest sequence that fits ``--memory-per-device``.** For cp = 1, 2, 4 and each sequence length
   of a doubling grid: the planner's predicted peak of one rank (a profile measured at cp=1 on that
   length, :func:`merak_core.planner.predict` of the cp choice: weights, gradients, AdamW's states and the
   saved activations of :func:`merak_core.planner.context_cost.cp_local_profile`) and the measured
   peak of the worst rank (the saved-tensor meter's activation peak over the step, plus the parameter,
   gradient and optimizer bytes held after an AdamW step). The planner keeps a layout when its
   prediction fits the usable memory (``1 - MEMORY_MARGIN`` of it); the measured column is the longest
   sequence whose measured peak fits the whole memory.

Run::

    OMP_NUM_THREADS=1 python benchmarks/bench_context_parallel.py [--quick] [--seq 1024] [--rounds 5]
        [--memory-per-device BYTES]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _ranks import init_rank, rotated, run_ranks

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

WORLD = 4
MODES = ("cp1", "ring2", "ulysses2", "ring4", "ulysses4")


def _model(cfg: dict[str, Any], seq: int) -> Any:
    from tests.support.models import DecoderConfig, Llama

    torch.manual_seed(0)
    return Llama(
        DecoderConfig(
            vocab_size=cfg["vocab"],
            hidden_size=cfg["hidden"],
            intermediate_size=2 * cfg["hidden"],
            num_layers=cfg["layers"],
            num_heads=8,
            num_kv_heads=4,
            max_seq_len=seq,
        )
    )


def _ids(cfg: dict[str, Any], seq: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, cfg["vocab"], (cfg["batch"], seq + 1), generator=g)


def _groups() -> dict[int, Any]:
    """This rank's cp group per degree (every rank creates every group, in the same order)."""
    rank = dist.get_rank()
    out: dict[int, Any] = {4: dist.group.WORLD}
    for members in ([0, 1], [2, 3]):
        group = dist.new_group(members)
        if rank in members:
            out[2] = group
    return out


def _context(mode: str, groups: dict[int, Any]) -> Any:
    from merak_tp.context import ContextParallel

    if mode == "cp1":
        return None
    name, cp = mode[:-1], int(mode[-1])
    return ContextParallel(groups[cp], name)


def _step(model: Any, ids: torch.Tensor, ctx: Any, vocab: int, meter: Any = None) -> None:
    """Forward and backward of this rank's tokens; the loss is the cp group's token mean (as one process)."""
    from contextlib import nullcontext

    from merak_tp.context import context_parallel, shard_positions

    seq = ids.shape[1] - 1
    pos = (
        torch.arange(seq) if ctx is None else shard_positions(seq, ctx.size, ctx.rank, balanced=ctx.balanced)
    )
    inputs, labels = ids[:, :-1][:, pos], ids[:, 1:][:, pos]
    with meter.measuring() if meter is not None else nullcontext(), context_parallel(ctx):
        logits = model(inputs)
        loss = (
            F.cross_entropy(logits.reshape(-1, vocab), labels.reshape(-1), reduction="sum")
            / ids[:, 1:].numel()
        )
        loss.backward()


def _time_worker(rank: int, world: int, store_path: str, cfg: dict[str, Any], queue: Any) -> None:
    init_rank(rank, world, store_path, timeout_s=3600)  # idle ranks wait for the cp=1 rank
    groups = _groups()
    model, ids = _model(cfg, cfg["seq"]), _ids(cfg, cfg["seq"])
    rows = []
    for r in range(cfg["warmup"] + cfg["rounds"]):
        row = {}
        for mode in rotated(MODES, r):
            ctx = _context(mode, groups)
            dist.barrier()
            start = time.perf_counter()
            if rank < (1 if ctx is None else ctx.size):  # one cp group: the same global tokens in every mode
                _step(model, ids, ctx, cfg["vocab"])
            took = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(took, op=dist.ReduceOp.MAX)
            model.zero_grad(set_to_none=True)
            row[mode] = float(took)
        if r >= cfg["warmup"]:
            rows.append(row)
    if rank == 0:
        queue.put(rows)
    dist.barrier()


def _memory_worker(rank: int, world: int, store_path: str, cfg: dict[str, Any], queue: Any) -> None:
    from merak_core.planner.memory_meter import SavedActivationMeter, measure_held_bytes

    init_rank(rank, world, store_path, timeout_s=3600)  # idle ranks wait for the cp=1 rank
    groups = _groups()
    out: dict[tuple[str, int], float] = {}
    for seq in cfg["seqs"]:
        for mode in MODES:
            model, ids = _model(cfg, seq), _ids(cfg, seq)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            meter = SavedActivationMeter({0: model})
            ctx = _context(mode, groups)
            if rank < (1 if ctx is None else ctx.size):
                _step(model, ids, ctx, cfg["vocab"], meter)
                opt.step()
                held = sum(measure_held_bytes({0: model}, opt)[0])
                mine = float(meter.peak[0] + held)
            else:
                mine = 0.0
            peak = torch.tensor([mine], dtype=torch.float64)
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)
            out[mode, seq] = float(peak)
    if rank == 0:
        queue.put(out)
    dist.barrier()


def _predicted(cfg: dict[str, Any]) -> dict[tuple[str, int], float]:
    """The planner's predicted peak of one rank per (mode, seq), from a cp=1 profile at that length."""
    from merak_core.config.layout_choice import LayoutChoice
    from merak_core.planner import predict, profile_model

    out = {}
    for seq in cfg["seqs"]:
        prof = profile_model(_model(cfg, seq), _ids(cfg, seq)[:, :-1], repeats=1)
        for mode in MODES:
            name, cp = ("ring", 1) if mode == "cp1" else (mode[:-1], int(mode[-1]))
            choice = LayoutChoice(
                dp=1,
                tp=1,
                pp=1,
                schedule="1f1b",
                num_microbatches=1,
                micro_batch_size=cfg["batch"],
                cp=cp,
                cp_mode=name,
            )
            out[mode, seq] = max(predict(prof, choice).device_peak_bytes)
    return out


def _bytes(text: str) -> float:
    units = {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30}
    for unit, factor in units.items():
        if text.endswith(unit):
            return float(text[: -len(unit)]) * factor
    return float(text)


def _time_table(rows: list[dict[str, float]], cfg: dict[str, Any]) -> str:
    lines = [
        f"step time, batch {cfg['batch']} x seq {cfg['seq']} (the same global tokens in every mode), "
        f"{len(rows)} paired rounds",
        f"{'mode':<10} {'median ms':>10} {'vs cp=1 (median of paired ratios)':>34}",
    ]
    for mode in MODES:
        med = statistics.median(r[mode] for r in rows)
        ratio = statistics.median(r[mode] / r["cp1"] for r in rows)
        lines.append(f"{mode:<10} {med * 1e3:>10.2f} {ratio:>33.3f}x")
    return "\n".join(lines)


def _memory_table(
    measured: dict[tuple[str, int], float], predicted: dict[tuple[str, int], float], cfg: dict[str, Any]
) -> str:
    from merak_core.planner.memory import usable_memory

    memory, mib = cfg["memory"], 2**20
    lines = [
        f"peak per rank (MiB), predicted | measured; memory_per_device {memory / mib:.1f} MiB "
        f"(the planner keeps a prediction <= {usable_memory(memory) / mib:.1f} MiB)",
        f"{'mode':<10} "
        + " ".join(f"{'seq ' + str(s):>15}" for s in cfg["seqs"])
        + f" {'longest pred':>13} {'longest meas':>13}",
    ]
    for mode in [m for m in MODES if (m, cfg["seqs"][0]) in measured]:
        cells = [f"{predicted[mode, s] / mib:>7.2f}|{measured[mode, s] / mib:<7.2f}" for s in cfg["seqs"]]
        fit_p = max((s for s in cfg["seqs"] if predicted[mode, s] <= usable_memory(memory)), default=0)
        fit_m = max((s for s in cfg["seqs"] if measured[mode, s] <= memory), default=0)
        lines.append(f"{mode:<10} " + " ".join(cells) + f" {fit_p:>13} {fit_m:>13}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, 3 rounds unless --rounds")
    parser.add_argument("--seq", type=int, default=1024, help="tokens per sequence of the timed step")
    parser.add_argument("--rounds", type=int, default=None, help="paired rounds (default 5)")
    parser.add_argument(
        "--memory-per-device",
        default=None,
        help="bytes, or with KiB/MiB/GiB (default 48MiB, 12MiB with --quick)",
    )
    args = parser.parse_args(argv)
    cfg: dict[str, Any] = dict(
        vocab=256,
        hidden=64,
        layers=2,
        batch=2,
        seq=args.seq,
        rounds=args.rounds or 5,
        warmup=1,
        memory=_bytes(args.memory_per_device or ("12MiB" if args.quick else "48MiB")),
        seqs=[256, 512, 1024, 2048, 4096],
    )
    if args.quick:
        cfg.update(seq=256, rounds=args.rounds or 3, seqs=[128, 256, 512, 1024])
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    start = time.perf_counter()
    rows = run_ranks(_time_worker, WORLD, cfg, timeout_s=7200)
    print(_time_table(rows, cfg))
    measured = run_ranks(_memory_worker, WORLD, cfg, timeout_s=7200)
    print(_memory_table(measured, _predicted(cfg), cfg))
    print(f"(took {time.perf_counter() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
