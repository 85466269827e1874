"""Benchmark: the step time of compiled stages (``training.compile``) against eager, on this machine.

One process, one thread by default: a GPT-shaped decoder (:class:`merak_core.planner.gpt_shapes.Decoder`,
float32, real weights; ``--layers/--hidden/--vocab/--seq`` set its size, the default is GPT-2 small,
124M parameters) runs as one pipeline stage (:class:`merak_pipe.PipelineStage`, the runner's stage
object) with the module the Trainer would give it (:func:`merak_core.parallel.compile.compile_stage`:
``eager``, ``true`` = the whole stage one region, ``regional`` = each block). A step is one forward
with the cross-entropy loss, its backward and an AdamW update. Every variant first runs its warm-up
steps (compilation happens there and is reported apart), then the variants take turns, one step each
per round (paired rounds: load on the machine hits them alike), and the table gives the median step
time and its ratio to the first variant's median (eager by default), the median over rounds of the
ratio to the first variant's step of the same round, and the ratio of the minima.

Run::

    OMP_NUM_THREADS=1 python benchmarks/bench_compile.py [--rounds 7] [--backend inductor] [--small]
        [--variants eager,true,regional,true:fused] [--optimizer foreach|fused|compiled]
        [--inductor-mode default|max-autotune-no-cudagraphs]

``--small``: 4 blocks of 256, vocabulary 8192 (7M parameters), for a loaded machine.
A variant is ``mode[:optimizer]`` (``eager``, ``true``, ``regional``; the optimizer defaults to
``--optimizer``): ``foreach`` is ``AdamW(foreach=True)``, ``fused`` is ``AdamW(fused=True)`` (torch's
fused CPU kernel), ``compiled`` is the foreach AdamW's ``step`` run through ``torch.compile`` (the
backend given; compiled in the warm-up). ``--inductor-mode`` sets the inductor options of that
``torch.compile`` mode for every compiled region of the run (``compile_stage`` takes no mode).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
import torch._inductor.config
import torch.nn.functional as F

from merak_core.parallel.compile import compile_stage
from merak_core.planner.gpt_shapes import Decoder, DecoderShape
from merak_pipe import PipelineStage

VARIANTS: dict[str, bool | str] = {"eager": False, "true": True, "regional": "regional"}
OPTIMIZERS = ("foreach", "fused", "compiled")
INDUCTOR_MODES = ("default", "max-autotune-no-cudagraphs")  # the CPU ones (the others add CUDA graphs)


def _loss(logits_bsv: torch.Tensor, labels_bs: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits_bsv.flatten(0, 1), labels_bs.flatten())


class _Runner:
    """One variant: its stage, optimizer and step."""

    def __init__(self, model: torch.nn.Module, mode: bool | str, backend: str, optimizer: str) -> None:
        self.model = copy.deepcopy(model)
        module = compile_stage(self.model, mode, backend=backend, checkpointed_units=0)
        self.stage = PipelineStage(module, stage_index=0, num_stages=1)
        fused = optimizer == "fused"
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4, foreach=not fused, fused=fused)
        self.update = self.optimizer.step
        if optimizer == "compiled":
            self.update = torch.compile(self.optimizer.step, backend=backend)

    def step(self, ids: torch.Tensor, labels: torch.Tensor) -> float:
        start = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        _, loss = self.stage.forward(0, (ids,), {}, loss_fn=_loss, labels=labels)
        self.stage.backward(0, None)
        self.update()
        assert loss is not None and torch.isfinite(loss)
        return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=50304)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--small", action="store_true", help="4 x 256, vocabulary 8192, sequence 128")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--variants", default="eager,true,regional", help="mode[:optimizer],...")
    parser.add_argument("--optimizer", default="foreach", choices=OPTIMIZERS)
    parser.add_argument("--inductor-mode", default="default", choices=INDUCTOR_MODES)
    a = parser.parse_args()
    for key, value in torch._inductor.list_mode_options(a.inductor_mode).items():
        setattr(torch._inductor.config, key, value)
    if a.small:
        a.layers, a.hidden, a.heads, a.vocab, a.seq = 4, 256, 4, 8192, 128
    shape = DecoderShape(
        num_layers=a.layers, hidden=a.hidden, num_heads=a.heads, vocab_size=a.vocab, seq_len=a.seq
    )
    torch.manual_seed(0)
    model = Decoder(shape)
    params = sum(p.numel() for p in model.parameters())
    ids = torch.randint(0, a.vocab, (a.batch, a.seq))
    labels = torch.randint(0, a.vocab, (a.batch, a.seq))
    names = a.variants.split(",")
    runners = {}
    for name in names:
        mode, _, optimizer = name.partition(":")
        if mode not in VARIANTS or (optimizer or a.optimizer) not in OPTIMIZERS:
            parser.error(
                f"variant {name!r}: expected mode[:optimizer], mode in {list(VARIANTS)}, optimizer in {OPTIMIZERS}"
            )
        runners[name] = _Runner(model, VARIANTS[mode], a.backend, optimizer or a.optimizer)
    warm = {}
    for name, runner in runners.items():
        start = time.perf_counter()
        for _ in range(a.warmup):
            runner.step(ids, labels)
        warm[name] = time.perf_counter() - start
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(a.rounds):
        order = names if r % 2 == 0 else names[::-1]
        for name in order:
            times[name].append(runners[name].step(ids, labels))
    base = statistics.median(times[names[0]])
    print(
        f"decoder {a.layers} x {a.hidden}, vocabulary {a.vocab}, {params / 1e6:.1f}M parameters, "
        f"batch {a.batch} x {a.seq} tokens, float32, {torch.get_num_threads()} thread(s), backend {a.backend}, "
        f"torch {torch.__version__}, {a.rounds} paired rounds after {a.warmup} warm-up steps, "
        f"optimizer {a.optimizer} unless named, inductor mode {a.inductor_mode}"
    )
    print(
        f"| compile | warm-up s (incl. compiling) | median step s | min step s | median vs {names[0]} "
        f"| median of paired ratios | min vs {names[0]}'s min |"
    )
    print("|---|---|---|---|---|---|---|")
    for name in names:
        med = statistics.median(times[name])
        paired = statistics.median(t / t0 for t, t0 in zip(times[name], times[names[0]], strict=True))
        low = min(times[name]) / min(times[names[0]])
        print(
            f"| {name} | {warm[name]:.1f} | {med:.3f} | {min(times[name]):.3f} | {med / base:.2f}x "
            f"| {paired:.2f}x | {low:.2f}x |"
        )


if __name__ == "__main__":
    main()
