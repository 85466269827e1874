"""A plan that would be silently wrong is refused before anything changes, with the fix in the message."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import merak_tp
from merak_tp._tp_module import _shard
from tests.support.dist import run_on_ranks
from tests.support.models import GPT, DecoderConfig
from tests.tp._bodies import tp_group


class ScaledEmbedding(nn.Embedding):
    """An embedding whose forward multiplies the rows (like Gemma's)."""

    def __init__(self, num: int, dim: int) -> None:
        super().__init__(num, dim)
        self.embed_scale = torch.tensor(dim**0.5)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(ids) * self.embed_scale.to(self.weight.dtype)


class ClampedLinear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x).clamp(-1, 1)


class KeepsForward(nn.Linear):
    """A subclass that keeps nn.Linear's forward: replaced like an nn.Linear."""


class Tiny(nn.Module):
    def __init__(self, emb: nn.Module, fc1: nn.Module) -> None:
        super().__init__()
        self.emb, self.fc1, self.fc2 = emb, fc1, nn.Linear(16, 8)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.fc1(self.emb(ids)))


def _plan(**kw: object) -> merak_tp.TPPlan:
    return merak_tp.TPPlan(name="tiny", layers={"emb": "vocab", "fc1": "column", "fc2": "row"}, **kw)  # type: ignore[arg-type]


def test_embedding_with_own_forward_is_refused_or_keeps_its_scale() -> None:
    torch.manual_seed(0)
    model = Tiny(ScaledEmbedding(12, 8), nn.Linear(8, 16)).double()
    with pytest.raises(
        ValueError,
        match=r"emb: .*ScaledEmbedding subclasses nn.Embedding but overrides forward.*"
        r"module_kinds=\{'ScaledEmbedding': 'embedding'.*'scaled_embedding'",
    ):
        merak_tp.parallelize(copy.deepcopy(model), _plan(), group=None)
    ids = torch.randint(0, 12, (2, 5))
    sharded = merak_tp.parallelize(
        copy.deepcopy(model), _plan(module_kinds={"ScaledEmbedding": "scaled_embedding"}), group=None
    )
    assert isinstance(sharded.emb, merak_tp.VocabParallelEmbedding)
    torch.testing.assert_close(sharded(ids), model(ids), rtol=0, atol=0)


def test_linear_with_own_forward_is_refused_and_a_stock_subclass_is_not() -> None:
    model = Tiny(nn.Embedding(12, 8), ClampedLinear(8, 16))
    with pytest.raises(
        ValueError,
        match=r"fc1: .*ClampedLinear subclasses nn.Linear but overrides forward.*"
        r"module_kinds=\{'ClampedLinear': 'linear'\}.*replicated",
    ):
        merak_tp.parallelize(model, _plan(), group=None)
    assert isinstance(model.fc1, ClampedLinear), "the model changed before the error"
    ok = merak_tp.parallelize(Tiny(nn.Embedding(12, 8), KeepsForward(8, 16)), _plan(), group=None)
    assert isinstance(ok.fc1, merak_tp.ColumnParallelLinear)


def test_every_pattern_must_match_and_the_error_names_the_closest_modules() -> None:
    plan = merak_tp.TPPlan(
        name="typo", layers={"blocks.*.attn.q_proj": "column", "blocks.*.attn.outt": "row"}
    )
    model = GPT(DecoderConfig(num_layers=1))
    with pytest.raises(
        ValueError,
        match=r"layers pattern 'blocks.\*.attn.outt' matched no module of GPT "
        r"\(closest module names: \[.*'blocks.0.attn.o_proj'",
    ):
        merak_tp.parallelize(model, plan, group=None)
    bad_attr = merak_tp.TPPlan(
        name="attr", layers={"blocks.*.attn.q_proj": "column"}, attributes={"blocks.*.attn": ("num_head",)}
    )
    with pytest.raises(ValueError, match=r"attribute 'num_head' of blocks.0.attn .* is None"):
        merak_tp.parallelize(model, bad_attr, group=None)
    optional = merak_tp.TPPlan(
        name="opt", layers={"blocks.*.attn.q_proj": "column", "head": "lm_head"}, optional=("head",)
    )
    merak_tp.parallelize(model, optional, group=None)


def test_unknown_family_names_the_job_file_key_and_the_plans() -> None:
    class Mine(nn.Module):
        pass

    with pytest.raises(ValueError, match=r"no built-in TP plan for Mine.*training\.tp_plan.*'hf_llama'"):
        merak_tp.plan_for_model(Mine())
    with pytest.raises(ValueError, match=r"unknown TP plan 'hf_lama' \(closest: \['hf_llama'"):
        merak_tp.get_plan("hf_lama")


def test_unequal_sections_split_each_section() -> None:
    w = torch.arange(12.0)
    assert _shard(w, 0, 2, 0, (8, 2, 2)).tolist() == [0, 1, 2, 3, 8, 10]
    assert _shard(w, 0, 2, 1, (8, 2, 2)).tolist() == [4, 5, 6, 7, 9, 11]
    with pytest.raises(ValueError, match="add up to the size 12"):
        _shard(w, 0, 2, 0, (8, 2))


def _sections_body(tp: int) -> bool:
    group = tp_group(tp)
    torch.manual_seed(0)
    fused = nn.Linear(6, 4 * tp + 2 * tp + 2 * tp).double()
    sizes = (4 * tp, 2 * tp, 2 * tp)
    layer = merak_tp.ColumnParallelLinear.from_linear(fused, group=group, sections=sizes)
    x = torch.randn(3, 6, dtype=torch.float64, requires_grad=True)
    y = layer(x)
    ref = fused(x)
    rank = torch.distributed.get_rank(group)
    expected = torch.cat([part.chunk(tp, -1)[rank] for part in ref.split(list(sizes), -1)], -1)
    torch.testing.assert_close(y, expected)
    full = merak_tp.gather_tensor(layer.weight, group=group)
    torch.testing.assert_close(full, fused.weight.detach(), rtol=0, atol=0)
    return True


@pytest.mark.parametrize("tp", [2, 4])
def test_unequal_sections_at_tp(tp: int) -> None:
    assert all(run_on_ranks(tp, _sections_body, tp))


def test_config_expression_sections() -> None:
    from merak_tp.plans import resolve_sections

    model = nn.Module()
    model.config = type("C", (), {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8})()
    spec = "num_attention_heads*head_dim, num_key_value_heads*head_dim, num_key_value_heads*head_dim"
    assert resolve_sections(spec, model, "qkv") == (32, 16, 16)
    with pytest.raises(ValueError, match="model.config.heads is None"):
        resolve_sections("heads*head_dim", model, "qkv")
