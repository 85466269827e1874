"""Benchmark: Merak's automated 3D training step vs a composition of torch's own parallel parts.

Same model (a GPT-style decoder), same initial weights, same batches, same gloo ranks, same run.
Each training step is one optimizer step over a global batch of
``dp * num_microbatches * micro_batch`` sequences. Modes:

- ``merak``: ``merak_core.Trainer(model, TrainingArguments(dp, tp, pp, schedule="1f1b"))``, one
  ``training_step`` per step: automatic partition into pp stages, TP by a user plan (the same linears
  as torch's plan below), merak-pipe's 1F1B runtime, bucketed DP gradient all-reduce overlapped with
  the last microbatch's backward, AdamW;
- ``torch``: the model split by hand into pp stages of equal layer counts (embeddings on the first,
  norm + head on the last), ``parallelize_module`` with ``ColwiseParallel`` (query/key/value/up) and
  ``RowwiseParallel`` (out/down) on the TP mesh axis, ``torch.distributed.pipelining.PipelineStage`` +
  ``Schedule1F1B``, then one coalesced all-reduce of every gradient over the DP group, AdamW;
- ``single``: (part b) one process, plain PyTorch, the same global batch as ``dp * num_microbatches``
  microbatches with gradient accumulation, AdamW (runs on rank 0 while the other ranks wait).

Both 3D modes also average the step's loss over the world (what a training loop logs).
Steps alternate between the modes (and which 3D mode goes first), each after a barrier, so load
changes on a shared machine hit them alike. Reported: median step time on rank 0 and the ratios
merak / torch (target <= 1.0) and merak (8 ranks) / single process. A sanity column gives the largest
difference between merak's and torch's per-step losses: both train the same weights on the same data.

Run (8 processes, forked, FileStore rendezvous)::

    OMP_NUM_THREADS=1 PYTHONPATH=packages/merak-pipe/src:packages/merak-graph/src:packages/merak-tp/src:\\
packages/merak-core/src python benchmarks/bench_core_3d.py [--quick] [--layout 2,2,2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _data import Tokens
from _ranks import init_rank, machine_line, rotated, run_ranks
from torch import nn

TP_PLAN = {
    "layers.*.attn.query": "column",
    "layers.*.attn.key": "column",
    "layers.*.attn.value": "column",
    "layers.*.attn.out": "row",
    "layers.*.up": "column",
    "layers.*.down": "row",
}


# --------------------------------------------------------------------------- the model


class Attention(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.head_dim = width // heads
        self.query = nn.Linear(width, width)
        self.key = nn.Linear(width, width)
        self.value = nn.Linear(width, width)
        self.out = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.query(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = self.key(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.value(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(width)
        self.attn = Attention(width, heads)
        self.norm2 = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class GPT(nn.Module):
    """GPT-style decoder with an untied head (so a hand split needs no cross-stage tie)."""

    def __init__(self, vocab: int, seq: int, width: int, depth: int, heads: int) -> None:
        super().__init__()
        self.tok_embed = nn.Embedding(vocab, width)
        self.pos_embed = nn.Embedding(seq, width)
        self.layers = nn.ModuleList(Block(width, heads) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(input_ids.size(1), device=input_ids.device)
        x = self.tok_embed(input_ids) + self.pos_embed(pos)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


class HandStage(nn.Module):
    """Layers ``[lo, hi)`` of a GPT, plus the embeddings on the first stage and norm + head on the last."""

    def __init__(self, full: GPT, lo: int, hi: int, *, first: bool, last: bool) -> None:
        super().__init__()
        self.first, self.last = first, last
        if first:
            self.tok_embed, self.pos_embed = full.tok_embed, full.pos_embed
        self.layers = nn.ModuleList(full.layers[lo:hi])
        if last:
            self.norm, self.head = full.norm, full.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            pos = torch.arange(x.size(1), device=x.device)
            x = self.tok_embed(x) + self.pos_embed(pos)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x)) if self.last else x


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1))


def build_model(cfg: dict[str, Any]) -> GPT:
    torch.manual_seed(0)
    return GPT(cfg["vocab"], cfg["seq"], cfg["width"], cfg["depth"], cfg["heads"])


def _adamw(params: list[nn.Parameter], lr: float) -> torch.optim.Optimizer:
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr,
        foreach=False,
    )


# --------------------------------------------------------------------------- torch's composition


class TorchComposition:
    """DTensor TP + torch.distributed.pipelining 1F1B + coalesced DP all-reduce, on Merak's layout groups."""

    def __init__(self, model: GPT, layout: Any, cfg: dict[str, Any]) -> None:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        self.layout = layout
        depth, pp, stage = cfg["depth"], layout.pp, layout.pp_rank
        bounds = [round(i * depth / pp) for i in range(pp + 1)]
        module = HandStage(model, bounds[stage], bounds[stage + 1], first=stage == 0, last=stage == pp - 1)
        if layout.tp > 1:
            plan: dict[str, Any] = {}
            for i in range(len(module.layers)):
                for name in ("attn.query", "attn.key", "attn.value", "up"):
                    plan[f"layers.{i}.{name}"] = ColwiseParallel()
                for name in ("attn.out", "down"):
                    plan[f"layers.{i}.{name}"] = RowwiseParallel()
            parallelize_module(module, layout.mesh["tp"], plan)
        self.module = module
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.optimizer = _adamw(self.params, cfg["lr"])
        pipe_stage = PipelineStage(module, stage, pp, torch.device("cpu"), group=layout.pp_group)
        self.schedule = Schedule1F1B(pipe_stage, cfg["num_microbatches"], loss_fn=lm_loss)

    def step(self, inputs: Any, labels: Any) -> float:
        layout = self.layout
        for p in self.params:
            p.grad = None
        losses: list[torch.Tensor] = []
        if layout.pp == 1:
            raise ValueError("the torch composition needs pp > 1 (it uses torch.distributed.pipelining)")
        if layout.is_first_stage:
            self.schedule.step(inputs["input_ids"])
        elif layout.is_last_stage:
            self.schedule.step(target=labels, losses=losses)
        else:
            self.schedule.step()
        if layout.dp > 1:
            locals_ = [_local(p.grad) for p in self.params]
            flat = torch.cat([g.reshape(-1) for g in locals_])
            dist.all_reduce(flat, group=layout.dp_group)
            flat /= layout.dp
            offset = 0
            for g in locals_:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()
        self.optimizer.step()
        value = torch.zeros(1, dtype=torch.float64)
        if losses and layout.tp_rank == 0:
            value += float(torch.stack([x.detach() for x in losses]).mean())
        dist.all_reduce(value)
        return float(value) / layout.dp


def _local(grad: Any) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return grad._local_tensor if isinstance(grad, DTensor) else grad


# --------------------------------------------------------------------------- one rank


def _worker(rank: int, world: int, store_path: str, cfg: dict[str, Any], queue: Any) -> None:
    init_rank(rank, world, store_path, timeout_s=600)
    from merak_core import ParallelLayout, Trainer
    from merak_core.config import TrainingArguments

    dp, tp, pp = cfg["layout"]
    layout = ParallelLayout.build(dp=dp, tp=tp, pp=pp)
    mbs, micro = cfg["micro_batch"], cfg["num_microbatches"]
    data = Tokens(dp * mbs * micro * (cfg["warmup"] + cfg["steps"]), cfg["vocab"], cfg["seq"])
    args = TrainingArguments(
        output_dir=tempfile.mkdtemp(prefix="merak-bench3d-"),
        dp=dp,
        tp=tp,
        pp=pp,
        per_device_train_batch_size=mbs,
        gradient_accumulation_steps=micro,
        learning_rate=cfg["lr"],
        lr_scheduler_type="constant",
        weight_decay=0.01,
        max_grad_norm=0.0,
        max_steps=cfg["warmup"] + cfg["steps"],
        schedule="1f1b",
        tp_plan=TP_PLAN if tp > 1 else None,
        seed=0,
        logging_steps=1000,
    )
    trainer = Trainer(build_model(cfg), args, data, loss_fn=lm_loss, layout=layout)
    theirs = TorchComposition(build_model(cfg), layout, cfg)
    single = build_model(cfg) if rank == 0 else None
    single_opt = _adamw(list(single.parameters()), cfg["lr"]) if single is not None else None
    g = torch.Generator().manual_seed(1)
    times: dict[str, list[float]] = {"merak": [], "torch": [], "single": []}
    loss_diff = 0.0
    batches = iter(trainer.train_loader)
    for step in range(cfg["warmup"] + cfg["steps"]):
        batch = next(batches)
        order = rotated(("merak", "torch"), step)
        losses = {}
        for mode in order:
            dist.barrier()
            start = time.perf_counter()
            if mode == "merak":
                losses[mode] = trainer.training_step(batch.inputs, batch.labels)
            else:
                losses[mode] = theirs.step(batch.inputs, batch.labels)
            if step >= cfg["warmup"]:
                times[mode].append(time.perf_counter() - start)
        loss_diff = max(loss_diff, abs(losses["merak"] - losses["torch"]))
        dist.barrier()
        if single is not None and single_opt is not None:  # rank 0 alone; the others wait at the barrier
            ids = torch.randint(0, cfg["vocab"], (dp * micro, mbs, cfg["seq"] + 1), generator=g)
            start = time.perf_counter()
            for p in single.parameters():
                p.grad = None
            for chunk in ids:
                (lm_loss(single(chunk[:, :-1]), chunk[:, 1:]) / len(ids)).backward()
            single_opt.step()
            if step >= cfg["warmup"]:
                times["single"].append(time.perf_counter() - start)
        dist.barrier()
    if rank == 0:
        numel = sum(p.numel() for p in build_model(cfg).parameters())
        queue.put(
            {
                "times": {m: statistics.median(t) for m, t in times.items()},
                "loss_diff": loss_diff,
                "numel": numel,
                "final_loss": losses["merak"],
            }
        )
    dist.barrier()
    dist.destroy_process_group()


def run(cfg: dict[str, Any]) -> dict[str, Any]:
    world = cfg["layout"][0] * cfg["layout"][1] * cfg["layout"][2]
    out: dict[str, Any] = run_ranks(_worker, world, cfg, timeout_s=3600)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small model, few steps")
    parser.add_argument("--layout", default="2,2,2", help="dp,tp,pp (default 2,2,2; pp must be > 1)")
    args = parser.parse_args(argv)
    layout = tuple(int(x) for x in args.layout.split(","))
    if len(layout) != 3 or layout[2] < 2:
        parser.error(f"--layout must be dp,tp,pp with pp >= 2, got {args.layout!r}")
    cfg: dict[str, Any] = (
        dict(
            vocab=256,
            seq=32,
            width=128,
            depth=4,
            heads=4,
            micro_batch=4,
            num_microbatches=4,
            lr=1e-3,
            warmup=2,
            steps=6,
        )
        if args.quick
        else dict(
            vocab=512,
            seq=64,
            width=256,
            depth=8,
            heads=8,
            micro_batch=4,
            num_microbatches=4,
            lr=1e-3,
            warmup=3,
            steps=20,
        )
    )
    cfg["layout"] = layout
    dp, tp, pp = layout
    print(machine_line())
    print(
        f"model: GPT {cfg['depth']} layers x width {cfg['width']}, {cfg['heads']} heads, vocab {cfg['vocab']}, "
        f"seq {cfg['seq']}; global batch {dp * cfg['num_microbatches'] * cfg['micro_batch']} sequences "
        f"= dp {dp} x {cfg['num_microbatches']} microbatches x {cfg['micro_batch']}; "
        f"median of {cfg['steps']} steps after {cfg['warmup']} warm-up"
    )
    res = run(cfg)
    t = res["times"]
    print()
    print(
        "| layout (dp x tp x pp) | params | merak ms/step | torch ms/step | merak / torch | single-process ms/step "
        "| merak / single | max |loss diff| merak vs torch |"
    )
    print("|---|---|---|---|---|---|---|---|")
    print(
        f"| {dp}x{tp}x{pp} | {res['numel'] / 1e6:.2f}M | {t['merak'] * 1e3:.1f} | {t['torch'] * 1e3:.1f} | "
        f"{t['merak'] / t['torch']:.2f} | {t['single'] * 1e3:.1f} | {t['merak'] / t['single']:.2f} | "
        f"{res['loss_diff']:.1e} |",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
