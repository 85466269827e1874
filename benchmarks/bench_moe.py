"""Benchmark: expert parallelism (ep=2, ep=4) against TP-split experts at the same world size, one run.

A mixture-of-experts model built here (no download): token embedding, ``--layers`` blocks of
RMS norm + an MoE block of 8 SwiGLU experts (top-2 softmax routing, normalised weights, following
merak_core's MoE block protocol), a head. Four gloo ranks; three Trainers live on every rank, each on
its own layout, with the same global batch and the same initial weights:

- ``tp2``: dp=2 x tp=2, every expert's linears split over TP (column / row, an all-reduce per expert
  output), the way Merak ran MoE models before ``training.ep``;
- ``ep2``: dp=4, ep=2 (4 experts per rank, two EP groups);
- ``ep4``: dp=4, ep=4 (2 experts per rank).

Rounds step the three Trainers in an order that rotates between rounds (load on a shared machine hits
each alike); a step's time is the slowest rank's. Reported: median step time, the parameter bytes a rank
holds, and for the EP layouts the bytes each rank sent to other ranks through the dispatch all-to-alls
per step (measured by counting the rows each exchange sends off-rank), against the uniform-routing
prediction of the cluster planner (merak_core.planner.expert_cost: ``4 * layers * microbatches * tokens *
top_k * (ep - 1) / ep * hidden * bytes``, two all-to-alls forward, two backward, from the meta-traced model).

Run (4 processes, forked, FileStore rendezvous)::

    OMP_NUM_THREADS=1 python benchmarks/bench_moe.py [--quick] [--rounds N]
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _ranks import init_rank, machine_line, rotated, run_ranks  # noqa: E402

MODES = {"tp2": dict(dp=2, tp=2, ep=1), "ep2": dict(dp=4, tp=1, ep=2), "ep4": dict(dp=4, tp=1, ep=4)}
WORLD = 4


class Expert(nn.Module):
    def __init__(self, hidden: int, inner: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)

    def forward(self, x_nh: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x_nh)) * self.up_proj(x_nh))


class MoE(nn.Module):
    """Top-k softmax routing over SwiGLU experts; ``run_experts`` is the dropless weighted sum."""

    def __init__(self, hidden: int, inner: int, num_experts: int, top_k: int) -> None:
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        self.router = nn.Linear(hidden, num_experts, bias=False)
        self.experts = nn.ModuleList(Expert(hidden, inner) for _ in range(num_experts))

    def run_experts(
        self, x_nh: torch.Tensor, weights_nk: torch.Tensor, experts_nk: torch.Tensor
    ) -> torch.Tensor:
        out_nh = torch.zeros_like(x_nh)
        for e, expert in enumerate(self.experts):
            tokens, slots = (experts_nk == e).nonzero(as_tuple=True)
            y_nh = expert(x_nh.index_select(0, tokens)) * weights_nk[tokens, slots].unsqueeze(-1)
            out_nh = out_nh.index_add(0, tokens, y_nh)
        return out_nh

    def forward(self, x_bth: torch.Tensor) -> torch.Tensor:
        b, t, h = x_bth.shape
        x_nh = x_bth.reshape(b * t, h)
        weights_nk, experts_nk = F.softmax(self.router(x_nh), dim=-1).topk(self.top_k, dim=-1)
        weights_nk = weights_nk / weights_nk.sum(-1, keepdim=True)
        return self.run_experts(x_nh, weights_nk, experts_nk).reshape(b, t, h)


class Block(nn.Module):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(cfg["hidden"])
        self.moe = MoE(cfg["hidden"], cfg["inner"], cfg["experts"], cfg["top_k"])

    def forward(self, x_bth: torch.Tensor) -> torch.Tensor:
        return x_bth + self.moe(self.norm(x_bth))


class BenchMoE(nn.Module):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        self.embed = nn.Embedding(cfg["vocab"], cfg["hidden"])
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg["layers"]))
        self.head = nn.Linear(cfg["hidden"], cfg["vocab"], bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _tp_plan() -> dict[str, Any]:
    """The job-file form of a TP plan splitting every expert's linears (column, column, row)."""
    return {
        "layers": {
            "layers.*.moe.experts.*.gate_proj": "column",
            "layers.*.moe.experts.*.up_proj": "column",
            "layers.*.moe.experts.*.down_proj": "row",
        }
    }


class Tokens(Dataset):
    def __init__(self, n: int, vocab: int, seq: int) -> None:
        self.ids = torch.randint(0, vocab, (n, seq + 1), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i, :-1], "labels": self.ids[i, 1:]}


def _trainer(cfg: dict[str, Any], mode: str, data: Any) -> Any:
    from merak_core import ParallelLayout, Trainer, TrainingArguments

    degrees = MODES[mode]
    layout = ParallelLayout.build(dp=degrees["dp"], tp=degrees["tp"], ep=degrees["ep"])
    args = TrainingArguments(
        output_dir=tempfile.mkdtemp(prefix="merak-benchmoe-"),
        dp=degrees["dp"],
        tp=degrees["tp"],
        ep=degrees["ep"],
        per_device_train_batch_size=cfg["global_batch"] // degrees["dp"],
        learning_rate=1e-4,
        lr_scheduler_type="constant",
        max_grad_norm=1.0,
        max_steps=1000,
        tp_plan=_tp_plan() if degrees["tp"] > 1 else None,
        seed=0,
        logging_steps=1000,
    )
    torch.manual_seed(0)
    return Trainer(BenchMoE(cfg), args, data, layout=layout)


class _SentBytes:
    """Counts the bytes the dispatch's all-to-alls send to other ranks (wraps merak_tp.all_to_all._exchange)."""

    def __init__(self) -> None:
        import merak_tp.all_to_all as a2a

        self.total = 0
        self._module = a2a
        self._inner = a2a._exchange
        a2a._exchange = self._exchange  # type: ignore[assignment]

    def _exchange(
        self, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any
    ) -> torch.Tensor:
        me = dist.get_rank(group)
        row_bytes = x[0].numel() * x.element_size() if x.size(0) else 0
        self.total += sum(n for j, n in enumerate(in_splits) if j != me) * row_bytes
        return self._inner(x, out_splits, in_splits, group)


def _worker(rank: int, world: int, store_path: str, cfg: dict[str, Any], queue: Any) -> None:
    init_rank(rank, world, store_path, timeout_s=3600)
    steps = cfg["warmup"] + cfg["rounds"]
    data = Tokens(cfg["global_batch"] * steps, cfg["vocab"], cfg["seq"])
    trainers = {mode: _trainer(cfg, mode, data) for mode in MODES}
    loaders = {mode: iter(t.train_loader) for mode, t in trainers.items()}
    sent = _SentBytes()
    rounds: list[dict[str, float]] = []
    sent_per_step: dict[str, list[int]] = {mode: [] for mode in MODES}
    for step in range(steps):
        row: dict[str, float] = {}
        for mode in rotated(list(MODES), step):
            batch = next(loaders[mode])
            dist.barrier()
            before = sent.total
            start = time.perf_counter()
            trainers[mode].training_step(batch.inputs, batch.labels)
            took = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(took, op=dist.ReduceOp.MAX)
            row[mode] = float(took)
            sent_per_step[mode].append(sent.total - before)
        if step >= cfg["warmup"]:
            rounds.append(row)
    params = {
        m: sum(p.numel() * p.element_size() for p in t.model.module.parameters()) for m, t in trainers.items()
    }
    gathered: list[Any] = [None] * world
    dist.all_gather_object(
        gathered, {"params": params, "sent": {m: statistics.mean(v) for m, v in sent_per_step.items()}}
    )
    if rank == 0:
        queue.put({"rounds": rounds, "ranks": gathered})
    del trainers, loaders
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def _predicted_sent(cfg: dict[str, Any], ep: int) -> float:
    """The cluster planner's all-to-all bytes per step and rank for this model (merak_core.planner.expert_cost:
    the meta-traced model's MoE blocks, four all-to-alls per block and microbatch)."""
    import merak_graph as mg
    from merak_core.planner.cluster import load_cluster
    from merak_core.planner.cluster_cost import model_costs, trace_for_cluster
    from merak_core.planner.expert_cost import model_step_all_to_all_bytes

    with mg.empty_init():
        model = BenchMoE(cfg)
    ids = torch.zeros(1, cfg["seq"], dtype=torch.long)
    costs = model_costs(trace_for_cluster(model, (ids,), load_cluster("h100-sxm-8x")), model)
    per_rank = cfg["global_batch"] // WORLD  # dp = world at ep > 1, one microbatch
    return model_step_all_to_all_bytes(costs, ep, micro_batch_size=per_rank, num_microbatches=1)


def report(cfg: dict[str, Any], out: dict[str, Any]) -> None:
    print(machine_line())
    print(
        f"model: {cfg['layers']} MoE layers, {cfg['experts']} experts (hidden {cfg['hidden']}, inner {cfg['inner']}, "
        f"top-{cfg['top_k']}), vocab {cfg['vocab']}, seq {cfg['seq']}, global batch {cfg['global_batch']}, "
        f"{WORLD} ranks, {cfg['rounds']} rounds after {cfg['warmup']} warm-up\n"
    )
    print(
        "| mode | layout | median step ms | params MiB per rank (max) | all-to-all sent MiB/step/rank (mean) | predicted |"
    )
    print("|---|---|---|---|---|---|")
    for mode, degrees in MODES.items():
        median = statistics.median(r[mode] for r in out["rounds"]) * 1e3
        params = max(r["params"][mode] for r in out["ranks"]) / 2**20
        sent = statistics.mean(r["sent"][mode] for r in out["ranks"]) / 2**20
        pred = _predicted_sent(cfg, degrees["ep"]) / 2**20 if degrees["ep"] > 1 else 0.0
        layout = f"dp{degrees['dp']} tp{degrees['tp']} ep{degrees['ep']}"
        print(f"| {mode} | {layout} | {median:.1f} | {params:.2f} | {sent:.3f} | {pred:.3f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a tiny model and 3 rounds (a smoke run)")
    parser.add_argument("--rounds", type=int, default=None)
    ns = parser.parse_args()
    cfg: dict[str, Any] = dict(
        layers=2, experts=8, top_k=2, hidden=256, inner=512, vocab=1024, seq=128, global_batch=16
    )
    cfg.update(rounds=10, warmup=2)
    if ns.quick:
        cfg.update(hidden=32, inner=64, vocab=128, seq=16, global_batch=8, rounds=3, warmup=1)
    if ns.rounds is not None:
        cfg["rounds"] = ns.rounds
    report(cfg, run_ranks(_worker, WORLD, cfg, timeout_s=3600))


if __name__ == "__main__":
    main()
