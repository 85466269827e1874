"""Rank bodies for the merak-tp multi-process tests (module level: the worker pool pickles them).

Every body builds the unsharded float64 reference in the same process, runs it,
then runs the tensor-parallel version and compares outputs, loss and every
gradient by name (shards gathered back with ``merak_tp.gather_tensor``).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import merak_tp
from merak_tp.shard_spec import get_shard_spec, has_shard_spec
from tests.support.compare import assert_grads_match, assert_tensors_close, named_grads
from tests.support.models import GPT, REFERENCE_MODELS, Bert, DecoderConfig, Llama

SMALL = DecoderConfig(num_layers=2, num_kv_heads=4)
BUILDERS = {
    "gpt": lambda: GPT(SMALL),
    "llama": lambda: Llama(DecoderConfig(num_layers=2, num_heads=8, num_kv_heads=4)),
    "bert": lambda: Bert(SMALL),
}


def tp_group(tp: int) -> Any:
    """The world when tp == world size; else consecutive subgroups of ``tp`` ranks (all ranks create all)."""
    world = dist.get_world_size()
    if tp == world:
        return dist.group.WORLD
    mine = None
    for start in range(0, world, tp):
        g = dist.new_group(list(range(start, start + tp)))
        if dist.get_rank() in range(start, start + tp):
            mine = g
    return mine


def _deferrable(region: nn.Module) -> bool | None:
    """Whether a TP region was found to run sub-pipelined (None: not checked yet)."""
    state = merak_tp.get_module_spec(region).region
    assert state is not None, f"{type(region).__name__} has no region state"
    return state.deferrable


def gathered_grads(model: nn.Module, group: Any) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        assert p.grad is not None, f"{name} has no gradient"
        out[name] = merak_tp.gather_tensor(p.grad, like=p, group=group)
    return out


def gathered_params(model: nn.Module, group: Any) -> dict[str, torch.Tensor]:
    return {n: merak_tp.gather_tensor(p, group=group) for n, p in model.named_parameters()}


# --------------------------------------------------------------------------- layers


def column_body(tp: int, chunks: int, gather_output: bool, bias: bool) -> bool:
    group = tp_group(tp)
    torch.manual_seed(0)
    ref = nn.Linear(12, 32, bias=bias).double()
    x = torch.randn(4, 3, 12, dtype=torch.float64)
    xr = x.clone().requires_grad_(True)
    y_ref = ref(xr)
    w_out = torch.randn_like(y_ref)
    (y_ref * w_out).sum().backward()
    layer = merak_tp.ColumnParallelLinear.from_linear(
        ref, group=group, gather_output=gather_output, overlap_chunks=chunks
    )
    xp = x.clone().requires_grad_(True)
    y = layer(xp)
    if gather_output:
        assert_tensors_close(y, y_ref.detach(), name="column output")
        (y * w_out).sum().backward()
    else:
        w_local = w_out.chunk(layer.tp_size, -1)[layer.tp_rank]
        assert_tensors_close(merak_tp.gather_from_tp_region(y.detach(), group), y_ref.detach(), name="out")
        (y * w_local).sum().backward()
    assert xp.grad is not None and xr.grad is not None
    assert_tensors_close(xp.grad, xr.grad, name="input grad")
    assert_grads_match(gathered_grads(layer, group), named_grads(ref))
    return True


def row_body(tp: int, chunks: int, input_is_parallel: bool, bias: bool) -> bool:
    group = tp_group(tp)
    torch.manual_seed(1)
    ref = nn.Linear(16, 6, bias=bias).double()
    x = torch.randn(4, 3, 16, dtype=torch.float64)
    xr = x.clone().requires_grad_(True)
    y_ref = ref(xr)
    w_out = torch.randn_like(y_ref)
    (y_ref * w_out).sum().backward()
    layer = merak_tp.RowParallelLinear.from_linear(
        ref, group=group, input_is_parallel=input_is_parallel, overlap_chunks=chunks
    )
    rank = dist.get_rank(group)
    xin = x if not input_is_parallel else x.chunk(tp, -1)[rank]
    xp = xin.clone().requires_grad_(True)
    y = layer(xp)
    assert_tensors_close(y, y_ref.detach(), name="row output")
    (y * w_out).sum().backward()
    assert xp.grad is not None and xr.grad is not None
    expect = xr.grad if not input_is_parallel else xr.grad.chunk(tp, -1)[rank]
    assert_tensors_close(xp.grad, expect, name="input grad")
    assert_grads_match(gathered_grads(layer, group), named_grads(ref))
    return True


def mlp_sp_body(tp: int, chunks: int) -> bool:
    """column(SP: gather seq) -> gelu -> row(SP: reduce-scatter seq), vs the unsharded MLP."""
    group = tp_group(tp)
    rank = dist.get_rank(group)
    torch.manual_seed(2)
    fc1, fc2 = nn.Linear(8, 16).double(), nn.Linear(16, 8).double()
    x = torch.randn(4, 8, 8, dtype=torch.float64)
    xr = x.clone().requires_grad_(True)
    y_ref = fc2(F.gelu(fc1(xr)))
    w_out = torch.randn_like(y_ref)
    (y_ref * w_out).sum().backward()
    c = merak_tp.ColumnParallelLinear.from_linear(
        fc1, group=group, sequence_parallel=True, overlap_chunks=chunks
    )
    r = merak_tp.RowParallelLinear.from_linear(
        fc2, group=group, sequence_parallel=True, overlap_chunks=chunks
    )
    x_local = x.chunk(tp, 1)[rank].clone().requires_grad_(True)
    y_local = r(F.gelu(c(x_local)))
    assert_tensors_close(y_local, y_ref.detach().chunk(tp, 1)[rank], name="SP output block")
    (y_local * w_out.chunk(tp, 1)[rank]).sum().backward()
    assert x_local.grad is not None and xr.grad is not None
    assert_tensors_close(x_local.grad, xr.grad.chunk(tp, 1)[rank], name="SP input grad block")
    grads = {"0." + n: merak_tp.gather_tensor(p.grad, like=p, group=group) for n, p in c.named_parameters()}
    grads.update(
        {"2." + n: merak_tp.gather_tensor(p.grad, like=p, group=group) for n, p in r.named_parameters()}
    )
    ref_grads = {"0." + n: p.grad for n, p in fc1.named_parameters()}
    ref_grads.update({"2." + n: p.grad for n, p in fc2.named_parameters()})
    assert_grads_match(grads, ref_grads)  # type: ignore[arg-type]
    return True


def embedding_body(tp: int, padding_idx: int | None) -> bool:
    group = tp_group(tp)
    torch.manual_seed(3)
    ref = nn.Embedding(16, 6, padding_idx=padding_idx).double()
    ids = torch.randint(0, 16, (3, 5))
    ids[0, 0] = 0
    y_ref = ref(ids)
    w_out = torch.randn_like(y_ref)
    (y_ref * w_out).sum().backward()
    layer = merak_tp.VocabParallelEmbedding.from_embedding(ref, group=group)
    y = layer(ids)
    assert_tensors_close(y, y_ref.detach(), name="embedding output")
    (y * w_out).sum().backward()
    assert_grads_match(gathered_grads(layer, group), named_grads(ref))
    return True


def loss_body(tp: int, smoothing: float, reduction: str) -> bool:
    group = tp_group(tp)
    rank = dist.get_rank(group)
    torch.manual_seed(4)
    logits = torch.randn(3, 5, 8 * tp, dtype=torch.float64) * 3
    labels = torch.randint(0, 8 * tp, (3, 5))
    labels[0, :2] = -100
    lr = logits.clone().requires_grad_(True)
    ref = F.cross_entropy(
        lr.reshape(-1, 8 * tp),
        labels.reshape(-1),
        ignore_index=-100,
        label_smoothing=smoothing,
        reduction=reduction,
    )
    local = logits.chunk(tp, -1)[rank].clone().requires_grad_(True)
    loss = merak_tp.vocab_parallel_cross_entropy(
        local, labels, group=group, label_smoothing=smoothing, reduction=reduction
    )
    if reduction == "none":
        ref = ref.reshape(3, 5)
    assert_tensors_close(loss, ref.detach(), name="loss")
    w = torch.randn_like(ref) if reduction == "none" else torch.tensor(1.7, dtype=torch.float64)
    (ref * w).sum().backward()
    (loss * w).sum().backward()
    assert local.grad is not None and lr.grad is not None
    assert_tensors_close(local.grad, lr.grad.chunk(tp, -1)[rank], name="logit grad")
    return True


# --------------------------------------------------------------------------- parallelize


def parallelize_body(
    name: str, tp: int, chunks: int, sp: bool, vocab_loss: bool, train: bool = True, batch: int = 4
) -> dict[str, bool | None]:
    group = tp_group(tp)
    torch.manual_seed(0)
    ref = BUILDERS[name]().double()
    model = copy.deepcopy(ref)
    spec = REFERENCE_MODELS[name]
    inputs = spec.make_inputs(batch, 8, 11)
    labels = spec.make_labels(batch, 8, 11)
    labels[0, :3] = -100
    ref.train(train)
    model.train(train)
    ref.zero_grad()
    out_ref = ref(*inputs)
    loss_ref = spec.loss(out_ref, labels)
    loss_ref.backward()

    merak_tp.parallelize(
        model, group=group, overlap_chunks=chunks, sequence_parallel=sp, vocab_parallel_loss=vocab_loss
    )
    if name == "gpt":
        assert model.lm_head.weight is model.wte.weight, "tied weights came apart"
    # A first step lets sub-pipelined regions check their shape ("probe"); the second runs chunked.
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        out = model(*inputs)
        if _ == 0:
            (out.float().sum() * 0).backward()
    if vocab_loss:
        loss = merak_tp.vocab_parallel_cross_entropy(out, labels, group=group)
        out_full = merak_tp.gather_from_tp_region(out.detach(), group)
    else:
        loss = spec.loss(out, labels)
        out_full = out
    assert_tensors_close(out_full, out_ref.detach(), name="model output")
    assert_tensors_close(loss, loss_ref.detach(), name="loss")
    loss.backward()
    assert_grads_match(gathered_grads(model, group), named_grads(ref))
    # Replicated parameters have identical gradients on every TP rank.
    for pname, p in model.named_parameters():
        if merak_tp.is_replicated(p):
            g = p.grad.clone()  # type: ignore[union-attr]
            dist.all_reduce(g, op=dist.ReduceOp.MAX, group=group)
            assert_tensors_close(p.grad, g, name=f"replicated grad {pname} across ranks")  # type: ignore[arg-type]
    return {n: _deferrable(m) for n, m in model.named_modules() if isinstance(m, merak_tp.TPRegion)}


def meta_body(tp: int) -> bool:
    """parallelize on a meta model keeps shapes/names/ties; loading real shards then matches."""
    group = tp_group(tp)
    with torch.device("meta"):
        model = GPT(SMALL)
    merak_tp.parallelize(model, group=group)
    assert model.lm_head.weight is model.wte.weight
    assert model.blocks[0].attn.q_proj.weight.is_meta
    assert model.blocks[0].attn.q_proj.weight.shape == (32 // tp, 32)
    assert model.blocks[0].attn.num_heads == 4 // tp
    torch.manual_seed(0)
    real = GPT(SMALL).double()
    real_tp = merak_tp.parallelize(copy.deepcopy(real), group=group)
    shard_names = {n for n, _ in model.named_parameters()}
    assert shard_names == {n for n, _ in real_tp.named_parameters()}
    for (n, p), (_, q) in zip(model.named_parameters(), real_tp.named_parameters(), strict=True):
        assert p.shape == q.shape, n
        assert has_shard_spec(p) and has_shard_spec(q) and get_shard_spec(p).dim == get_shard_spec(q).dim, n
    return True


def init_body(tp: int) -> bool:
    """Layers built from scratch with the same seed equal nn.Linear/nn.Embedding built with it."""
    group = tp_group(tp)
    torch.manual_seed(5)
    ref = nn.Linear(6, 8)
    torch.manual_seed(5)
    col = merak_tp.ColumnParallelLinear(6, 8, group=group)
    assert_tensors_close(merak_tp.gather_tensor(col.weight, group=group), ref.weight, name="col weight")
    assert_tensors_close(merak_tp.gather_tensor(col.bias, group=group), ref.bias, name="col bias")
    torch.manual_seed(6)
    ref2 = nn.Linear(8, 6)
    torch.manual_seed(6)
    row2 = merak_tp.RowParallelLinear(8, 6, group=group)
    assert_tensors_close(merak_tp.gather_tensor(row2.weight, group=group), ref2.weight, name="row weight")
    assert_tensors_close(row2.bias, ref2.bias, name="row bias")
    torch.manual_seed(7)
    ref3 = nn.Embedding(8, 3)
    torch.manual_seed(7)
    emb = merak_tp.VocabParallelEmbedding(8, 3, group=group)
    assert_tensors_close(merak_tp.gather_tensor(emb.weight, group=group), ref3.weight, name="embedding")
    return True


# --------------------------------------------------------------------------- overlap order


class MLPBlock(nn.Module):
    """column -> gelu -> row: the shape of block every region must handle."""

    def __init__(self, hidden: int = 8, inner: int = 16, scale_output: bool = False) -> None:
        super().__init__()
        self.fc1 = nn.Linear(hidden, inner)
        self.fc2 = nn.Linear(inner, hidden)
        self.scale_output = scale_output

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc2(F.gelu(self.fc1(x)))
        return y * 2.0 if self.scale_output else y


MLP_PLAN = merak_tp.TPPlan(name="test_mlp", layers={"fc1": "column", "fc2": "row"}, regions=("",))


def _in_flight(
    events: list[tuple[str, ...]],
    phase: str,
    launch_what: str,
    chunk: int,
    next_chunk: int,
    compute_what: str,
) -> bool:
    """Chunk ``chunk``'s collective is launched before, and waited after, ``next_chunk``'s compute."""
    idx = {e: i for i, e in reversed(list(enumerate(events)))}
    launch = idx[("launch", phase, launch_what, str(chunk))]
    wait = max(
        i for i, e in enumerate(events) if e[:3] == ("wait", phase, launch_what) and e[3] == str(chunk)
    )
    compute = idx[("compute", phase, compute_what, str(next_chunk))]
    return launch < compute < wait


def order_layer_body(tp: int, chunks: int) -> list[tuple[str, ...]]:
    group = tp_group(tp)
    torch.manual_seed(0)
    col = merak_tp.ColumnParallelLinear(8, 16, group=group, overlap_chunks=chunks).double()
    row = merak_tp.RowParallelLinear(16, 8, group=group, overlap_chunks=chunks).double()
    col.layer_name, row.layer_name = "col", "row"
    x = torch.randn(chunks * 2, 3, 8, dtype=torch.float64, requires_grad=True)
    with merak_tp.record_overlap_events() as events:
        y = row(F.gelu(col(x)))
        y.sum().backward()
    for j in range(chunks - 1):
        assert _in_flight(events, "fwd", "row", j, j + 1, "row"), events
        assert _in_flight(events, "bwd", "col", j, j + 1, "col"), events
    return events


def order_block_body(tp: int, chunks: int) -> list[tuple[str, ...]]:
    group = tp_group(tp)
    torch.manual_seed(0)
    block = MLPBlock().double()
    ref = copy.deepcopy(block)
    merak_tp.parallelize(block, MLP_PLAN, group=group, overlap_chunks=chunks)
    x = torch.randn(chunks * 2, 3, 8, dtype=torch.float64)
    block(x).sum().backward()  # the probe call
    assert _deferrable(block) is True
    block.zero_grad(set_to_none=True)
    xp = x.clone().requires_grad_(True)
    with merak_tp.record_overlap_events() as events:
        y = block(xp)
        w = torch.arange(y.numel(), dtype=y.dtype).reshape(y.shape).sin()
        (y * w).sum().backward()
    # Forward: chunk j's all-reduce (row layer) is in flight while chunk j+1's column layer computes.
    for j in range(chunks - 1):
        assert _in_flight(events, "fwd", "fc2", j, j + 1, "fc1"), events
    # Backward runs the chunks last to first: chunk j's input-gradient all-reduce (region entry) is
    # in flight while chunk j-1's row and column backward compute.
    for j in range(chunks - 1, 0, -1):
        assert _in_flight(events, "bwd", "", j, j - 1, "fc2"), events
        assert _in_flight(events, "bwd", "", j, j - 1, "fc1"), events
    # ... and the numbers are the unsharded block's.
    xr = x.clone().requires_grad_(True)
    (ref(xr) * w).sum().backward()
    assert_tensors_close(y, ref(x).detach(), name="block output")
    assert xp.grad is not None and xr.grad is not None
    assert_tensors_close(xp.grad, xr.grad, name="block input grad")
    assert_grads_match(gathered_grads(block, group), named_grads(ref))
    return events


def fallback_block_body(tp: int) -> bool:
    """A block whose output is not the row layer's output runs whole, and stays exact."""
    group = tp_group(tp)
    torch.manual_seed(0)
    block = MLPBlock(scale_output=True).double()
    ref = copy.deepcopy(block)
    merak_tp.parallelize(block, MLP_PLAN, group=group, overlap_chunks=2)
    x = torch.randn(4, 3, 8, dtype=torch.float64)
    for _ in range(2):
        block.zero_grad(set_to_none=True)
        y = block(x)
        y.sum().backward()
    assert _deferrable(block) is False
    ref(x).sum().backward()
    assert_tensors_close(y, ref(x).detach(), name="output")
    assert_grads_match(gathered_grads(block, group), named_grads(ref))
    return True


# --------------------------------------------------------------------------- fx, rng


class _LeafTracer(torch.fx.Tracer):
    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return isinstance(m, merak_tp.TP_LEAF_MODULES) or super().is_leaf_module(m, qualname)


def fx_body(tp: int, chunks: int, sp: bool) -> list[str]:
    """A parallelized model traces with TP layers/regions as leaves; the graph computes the same."""
    group = tp_group(tp)
    torch.manual_seed(0)
    ref = BUILDERS["gpt"]().double()
    model = merak_tp.parallelize(copy.deepcopy(ref), group=group, overlap_chunks=chunks, sequence_parallel=sp)
    graph = _LeafTracer().trace(model)
    gm = torch.fx.GraphModule(model, graph)
    (ids,) = REFERENCE_MODELS["gpt"].make_inputs(4, 8, 3)
    for _ in range(2):
        out = gm(ids)
    assert_tensors_close(out, ref(ids).detach(), name="traced output")
    return [n.target for n in graph.nodes if n.op == "call_module"]  # type: ignore[misc]


def rng_body(tp: int) -> bool:
    group = tp_group(tp)
    rank = dist.get_rank(group)
    torch.manual_seed(123)
    tracker = merak_tp.RNGTracker()
    tracker.add("tp", merak_tp.tp_seed(7, group))
    outer_expected = torch.rand(3)
    torch.manual_seed(123)
    with tracker.fork("tp"):
        a = torch.rand(4)
    outer = torch.rand(3)
    assert torch.equal(outer, outer_expected), "fork disturbed the default generator"
    with tracker.fork("tp"):
        b = torch.rand(4)
    assert not torch.equal(a, b), "the tracked state did not advance"
    fresh = merak_tp.RNGTracker()
    fresh.add("tp", merak_tp.tp_seed(7, group))
    with fresh.fork("tp"):
        assert torch.equal(torch.rand(4), a), "not reproducible from the seed"
    streams = [torch.empty_like(a) for _ in range(tp)]
    dist.all_gather(streams, a, group=group)
    assert len({tuple(s.tolist()) for s in streams}) == tp, "TP ranks share a random stream"
    # sharded dropout == the unsharded dropout's block, for the same generator seed
    x = torch.randn(2, 3, 4 * tp, dtype=torch.float64)
    g_full = torch.Generator().manual_seed(99)
    keep = torch.empty(x.shape).bernoulli_(0.7, generator=g_full)
    full = x * keep / 0.7
    g = torch.Generator().manual_seed(99)
    local = merak_tp.sharded_dropout(x.chunk(tp, -1)[rank], 0.3, group=group, dim=-1, generator=g)
    assert_tensors_close(local, full.chunk(tp, -1)[rank], name="sharded dropout")
    return True


def deepcopy_body(tp: int) -> bool:
    """A parallelized model (with regions) deep-copies: same outputs, ties and metadata kept."""
    group = tp_group(tp)
    torch.manual_seed(0)
    model = merak_tp.parallelize(BUILDERS["gpt"]().double(), group=group, overlap_chunks=2)
    (ids,) = REFERENCE_MODELS["gpt"].make_inputs(4, 8, 3)
    out = model(ids)
    twin = copy.deepcopy(model)
    assert twin.lm_head.weight is twin.wte.weight
    assert isinstance(twin.blocks[0].attn, merak_tp.TPRegion)
    assert twin.blocks[0].attn.q_proj.group is group
    for (n, p), (_, q) in zip(model.named_parameters(), twin.named_parameters(), strict=True):
        # Sharded parameters keep their specs; a replicated one may lose its spec (same meaning).
        assert get_shard_spec(p).dim == get_shard_spec(q).dim, n
    for _ in range(2):
        twin_out = twin(ids)
    assert_tensors_close(twin_out, out.detach(), name="deep copy output")
    twin_state = merak_tp.get_module_spec(twin.blocks[0].attn).region
    assert twin_state is not None and twin_state is not merak_tp.get_module_spec(model.blocks[0].attn).region
    assert twin.blocks[0].attn.q_proj._region is twin_state  # the copy's layers run in the copy's region
    return True


def dropout_body(tp: int, chunks: int) -> bool:
    """Dropout in a TP GPT: residual dropout equals the single-device model's; attention dropout
    (local heads, from the tracker's per-rank stream) is reproducible and keeps ranks consistent."""
    group = tp_group(tp)
    cfg = DecoderConfig(num_layers=2, num_kv_heads=4, dropout=0.2)
    torch.manual_seed(0)
    ref = GPT(cfg).double()
    (ids,) = REFERENCE_MODELS["gpt"].make_inputs(4, 8, 3)
    labels = REFERENCE_MODELS["gpt"].make_labels(4, 8, 3)

    def run(model: nn.Module, tracker: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        torch.manual_seed(100)  # the same on every TP rank: replicated dropout agrees across ranks
        loss = REFERENCE_MODELS["gpt"].loss(model(ids), labels)
        loss.backward()
        return loss.detach(), gathered_grads(model, group) if tracker is not None else named_grads(model)

    def tp_model(attn_p: float) -> tuple[nn.Module, Any]:
        tracker = merak_tp.RNGTracker()
        tracker.add("tp", merak_tp.tp_seed(7, group))
        model = copy.deepcopy(ref)
        for block in model.blocks:
            block.attn.dropout = attn_p
        merak_tp.parallelize(model, group=group, overlap_chunks=chunks, rng_tracker=tracker)
        return model, tracker

    # A: no attention dropout: the residual dropout masks are the single-device model's.
    for block in ref.blocks:
        block.attn.dropout = 0.0
    loss_ref, grads_ref = run(ref, None)
    model, tracker = tp_model(0.0)
    for _ in range(2):
        loss, grads = run(model, tracker)
    assert_tensors_close(loss, loss_ref, name="loss with residual dropout")
    assert_grads_match(grads, grads_ref)
    # B: attention dropout from the tracker: reproducible, consistent across ranks, own stream.
    losses = []
    for _ in range(2):
        model, tracker = tp_model(0.2)
        before = tracker.get_states()["tp"].clone()
        losses.append(run(model, tracker))
        assert not torch.equal(before, tracker.get_states()["tp"]), (
            "attention dropout did not use the tracker"
        )
    assert torch.equal(losses[0][0], losses[1][0]), "not reproducible"
    assert_grads_match(losses[0][1], losses[1][1], rtol=0, atol=0)
    assert not torch.allclose(losses[0][0], loss_ref), "attention dropout had no effect"
    everyone = [torch.empty_like(losses[0][0]) for _ in range(tp)]
    dist.all_gather(everyone, losses[0][0], group=group)
    assert all(torch.equal(e, losses[0][0]) for e in everyone), "TP ranks disagree on the loss"
    return True
