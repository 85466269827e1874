"""TP regions under torch.compile (sequence parallelism, sub-pipelined TP) equal eager, step by step.

A small Llama (3 blocks, float64) at tp = 2 is trained 3 SGD steps eagerly and with each block compiled
(backend ``aot_eager``, as ``training.compile: regional`` does: the TP layers eager, the region's compute
traced); the loss and every gradient of every step must match. Under SP block 0 is the sequence-scatter
boundary: it is compiled too, its scatter untraced (checked: its second norm runs traced). A later compiled
block reuses the code compiled for the first, which is where traced region bookkeeping went wrong ([Note:
region bookkeeping is not traced] in merak_tp._untraced: its region's input gradient was summed twice,
gradients off by about 1e-2).

The same model also runs once under torch.export's flags, as merak-graph runs a pipelined model's leaf
modules before exporting it: the untraced region code must run there (torch.export refuses a
non-recursive ``torch.compiler.disable``; the LoRA tests at tp2 pp2 with SP failed on it in CI).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.support.dist import run_on_ranks

_STEPS = 3


def _run(
    compiled: bool, sp: bool, chunks: int
) -> tuple[list[float], list[dict[str, torch.Tensor]], int, list[bool]]:
    """(loss per step, this rank's gradients per step, graphs torch.compile made, whether block 0's second
    norm ran traced, per call) for one model."""
    from torch._dynamo.utils import counters

    import merak_tp
    from merak_tp import TP_LEAF_MODULES, SequenceGather, SequenceScatter, TPRegion
    from tests.support.models import REFERENCE_MODELS, DecoderConfig, Llama

    torch._dynamo.reset()  # a fresh cache: graphs of an earlier body in this worker are not reused
    counters.clear()
    torch.manual_seed(0)
    model = Llama(DecoderConfig(num_layers=3, num_heads=4, num_kv_heads=2)).double()
    tracker = merak_tp.RNGTracker("cpu")
    tracker.add("tp", merak_tp.tp_seed(7, None), derived=True)
    merak_tp.parallelize(model, group=None, sequence_parallel=sp, overlap_chunks=chunks, rng_tracker=tracker)
    if compiled:  # as merak_core.parallel.compile does for compile: regional
        layers = tuple(
            c for c in TP_LEAF_MODULES if not issubclass(c, (TPRegion, SequenceScatter, SequenceGather))
        )
        for sub in model.modules():
            if isinstance(sub, layers):
                sub.forward = torch.compiler.disable(sub.forward)  # type: ignore[method-assign]
        for block in model.layers:
            block.compile(backend="aot_eager")
    traced: list[bool] = []  # block 0 (under SP the sequence scatter) compiled past its eager scatter
    model.layers[0].post_attention_layernorm.register_forward_hook(
        lambda *_: traced.append(torch.compiler.is_compiling())
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses, grads = [], []
    for step in range(_STEPS):
        ids = torch.randint(0, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(step))
        loss = REFERENCE_MODELS["llama"].loss(model(ids), ids)
        loss.backward()
        losses.append(float(loss))
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
    return losses, grads, int(counters["stats"]["unique_graphs"]), traced


def _exported_loss(sp: bool, chunks: int) -> float:
    """The first step's loss of the eager model run with torch.export's flags set, as merak-graph's
    pre-run of a traced (pipelined) model runs it: the untraced region code must run there as itself
    (torch.export refuses a non-recursive ``torch.compiler.disable``)."""
    from torch._export.utils import _compiling_state_context  # the flags torch.export sets while tracing

    import merak_tp
    from tests.support.models import REFERENCE_MODELS, DecoderConfig, Llama

    torch.manual_seed(0)
    model = Llama(DecoderConfig(num_layers=3, num_heads=4, num_kv_heads=2)).double()
    merak_tp.parallelize(model, group=None, sequence_parallel=sp, overlap_chunks=chunks)
    ids = torch.randint(0, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), _compiling_state_context():
        assert torch.compiler.is_exporting()
        return float(REFERENCE_MODELS["llama"].loss(model(ids), ids))


def _body(sp: bool, chunks: int) -> dict[str, Any]:
    exporting = _exported_loss(sp, chunks)
    eager = _run(False, sp, chunks)
    compiled = _run(True, sp, chunks)
    return {"eager": eager, "compiled": compiled, "exporting": exporting}


@pytest.mark.parametrize(("sp", "chunks"), [(True, 1), (False, 2)], ids=["sequence_parallel", "overlap2"])
def test_compiled_tp_regions_equal_eager(sp: bool, chunks: int) -> None:
    for rank, out in enumerate(run_on_ranks(2, _body, sp, chunks, timeout_s=600)):
        ref_losses, ref_grads, eager_graphs, _ = out["eager"]
        losses, grads, graphs, traced = out["compiled"]
        assert eager_graphs == 0 and graphs > 0, f"rank {rank}: nothing was compiled ({graphs} graphs)"
        assert traced and all(traced), f"rank {rank}: block 0 ran eagerly ({traced})"
        assert losses[0] != losses[-1]
        assert losses == pytest.approx(ref_losses, rel=1e-12)
        assert out["exporting"] == pytest.approx(ref_losses[0], rel=1e-12)
        for step, (got, ref) in enumerate(zip(grads, ref_grads, strict=True)):
            for name, g in ref.items():
                err = float((got[name] - g).abs().max())
                assert err <= 1e-12 * (1 + float(g.abs().max())), (
                    f"rank {rank} step {step} {name}: compiled gradient off eager by {err:.2e}"
                )
