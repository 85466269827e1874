"""Context parallel training (training.cp) against one process in float64.

One Trainer step (SGD, lr 1, no clipping or decay, so each parameter's change is its gradient) of
the reference Llama (grouped-query attention, rotary) and tiny transformers Llama, Qwen2 and Qwen3 models
(GQA, attention routed through transformers' registry), at cp=2 in both modes and at cp=2 x tp=2, against the
same model trained by one process on the whole sequences: the loss and every parameter's gradient.
Each sample ignores 4 labels (so a DP shard's token mean is the batch's), at places that give the
cp ranks different token counts, so the token-count weighting across cp ranks matters.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from tests.support.compare import replayable_arguments
from tests.support.dist import run_on_ranks
from tests.support.models import DecoderConfig, Llama

SEQ, VOCAB, BATCH = 16, 96, 4
IGNORED = ((0, 1, 2, 3), (12, 13, 14, 15), (6, 7, 8, 9), (0, 1, 2, 5))
"""The label positions (-100) of each sample."""


EVAL_IGNORED = ((0, 1, 2, 3, 4, 5, 6, 7, 8, 9), (), (3,), (12, 13, 14, 15), (1, 2, 3, 4, 5, 6))
"""The evaluation samples' ignored labels: samples and cp ranks count different numbers of tokens."""


class Tokens(Dataset):
    """``count`` random sequences; sample i ignores the labels at ``ignored[i % len(ignored)]``."""

    def __init__(
        self, count: int = BATCH, seed: int = 3, ignored: tuple[tuple[int, ...], ...] = IGNORED
    ) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, VOCAB, (count, SEQ + 1), generator=g)
        self.ignored = ignored

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        labels = self.ids[i, 1:].clone()
        labels[list(self.ignored[i % len(self.ignored)])] = -100
        return {"input_ids": self.ids[i, :-1], "labels": labels}


def _model(kind: str, vocab: int = VOCAB) -> torch.nn.Module:
    """``kind``: reference (reference4: 4 layers), transformers (Llama; transformers4: 4 layers), qwen2, qwen3."""
    torch.manual_seed(0)
    layers = 4 if kind in ("transformers4", "reference4") else 2
    if kind.startswith("reference"):
        return Llama(DecoderConfig(num_layers=layers, num_heads=4, num_kv_heads=2)).double()
    import transformers

    sizes = dict(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        use_cache=False,
    )
    if kind == "qwen2":  # q/k/v biases
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**sizes)).double()
    if kind == "qwen3":  # per-head RMS norms of the queries and keys, no sliding window
        return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**sizes, head_dim=8)).double()
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**sizes)).double()


def _args(**overrides: Any) -> Any:
    sizes = dict(
        per_device_train_batch_size=BATCH,
        learning_rate=1.0,
        max_steps=1,
        dtype="float64",
    )
    return replayable_arguments("merak-cp-", **{**sizes, **overrides})


def _sgd(groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
    return torch.optim.SGD(groups, lr=1.0)


def _train(
    kind: str, overrides: dict[str, Any], shard_ranks: int = 0
) -> tuple[float, dict[str, torch.Tensor] | None]:
    """``shard_ranks``: the ranks ZeRO-2/3 must shard over (0: not sharded)."""
    import torch.distributed as dist

    from merak_core import Trainer

    trainer = Trainer(_model(kind), _args(**overrides), Tokens(), optimizer_factory=_sgd)
    sharded = trainer.engine.sharded
    assert (sharded.dp_size if sharded is not None else 0) == shard_ranks
    history = trainer.train()
    state = trainer.full_state_dict()
    return history[0]["loss"], state if dist.get_rank() == 0 else None


def _reference(kind: str) -> tuple[float, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    model = _model(kind)
    data = Tokens()
    ids = torch.stack([data[i]["input_ids"] for i in range(BATCH)])
    labels = torch.stack([data[i]["labels"] for i in range(BATCH)])
    out = model(ids)
    logits = getattr(out, "logits", out)
    loss = F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100)
    loss.backward()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return float(loss), params, grads


def _check(kind: str, results: list[tuple[float, Any]]) -> None:
    loss, before, grads = _reference(kind)
    state = results[0][1]
    assert state is not None
    for got_loss, _ in results:
        assert got_loss == pytest.approx(loss, rel=1e-12)
    assert set(grads) <= set(state)
    for name, grad in grads.items():
        torch.testing.assert_close(before[name] - state[name], grad, rtol=1e-9, atol=1e-11, msg=name)


@pytest.mark.parametrize("kind", ["reference", "transformers", "qwen2", "qwen3"])
@pytest.mark.parametrize("mode", ["ring", "ulysses"])
def test_cp2_equals_one_process(kind: str, mode: str) -> None:
    _check(kind, run_on_ranks(2, _train, kind, {"cp": 2, "cp_mode": mode}))


@pytest.mark.parametrize(
    ("kind", "sequence_parallel"),
    [
        ("reference", False),
        ("transformers", False),
        ("transformers", True),
        ("qwen2", False),
        ("qwen3", False),
    ],
)
def test_cp2_tp2_ring_equals_one_process(kind: str, sequence_parallel: bool) -> None:
    overrides = {"cp": 2, "tp": 2, "cp_mode": "ring", "sequence_parallel": sequence_parallel}
    _check(kind, run_on_ranks(4, _train, kind, overrides))


@pytest.mark.parametrize(
    ("kind", "mode", "recompute"),
    [
        ("transformers", "ring", "none"),
        ("transformers", "ulysses", "none"),
        ("transformers", "ring", "full"),
        # the reference Llama: its hook traced as leaf calls (context_parallel [Note: cp hook at pp > 1])
        ("reference", "ring", "none"),
        ("reference", "ulysses", "full"),
        ("qwen2", "ring", "none"),
        ("qwen3", "ulysses", "none"),
    ],
)
def test_cp2_pp2_equals_one_process(kind: str, mode: str, recompute: str) -> None:
    overrides = {
        "cp": 2,
        "pp": 2,
        "cp_mode": mode,
        "recompute": recompute,
        "per_device_train_batch_size": 2,
        "gradient_accumulation_steps": 2,
    }
    _check(kind, run_on_ranks(4, _train, kind, overrides))


@pytest.mark.parametrize("kind", ["transformers4", "reference4"])
def test_cp2_pp2_virtual_stages_equals_one_process(kind: str) -> None:
    overrides = {
        "cp": 2,
        "pp": 2,
        "virtual_stages": 2,
        "schedule": "interleaved_1f1b",
        "per_device_train_batch_size": 2,
        "gradient_accumulation_steps": 2,
    }
    _check(kind, run_on_ranks(4, _train, kind, overrides))


@pytest.mark.parametrize("kind", ["reference", "transformers", "qwen2", "qwen3"])
def test_cp4_ring_equals_one_process(kind: str) -> None:
    _check(kind, run_on_ranks(4, _train, kind, {"cp": 4, "cp_mode": "ring"}))


@pytest.mark.parametrize("kind", ["reference", "transformers", "qwen2", "qwen3"])
def test_dp2_cp2_zero1_equals_one_process(kind: str) -> None:
    overrides = {"cp": 2, "dp": 2, "zero_stage": 1, "per_device_train_batch_size": BATCH // 2}
    _check(kind, run_on_ranks(4, _train, kind, overrides))


@pytest.mark.parametrize(("dp", "zero_stage"), [(1, 2), (1, 3), (2, 3)])
def test_cp2_zero_sharded_equals_one_process(dp: int, zero_stage: int) -> None:
    """ZeRO-2/3 (FSDP2) shards over the DP x CP ranks (layout.grad_sync_group)."""
    overrides = {"cp": 2, "dp": dp, "zero_stage": zero_stage, "per_device_train_batch_size": BATCH // dp}
    _check("reference", run_on_ranks(2 * dp, _train, "reference", overrides, 2 * dp))


def _train_lora(kind: str, overrides: dict[str, Any]) -> tuple[list[float], dict[str, torch.Tensor] | None]:
    """Two SGD steps of LoRA adapters (the first step trains B alone: B starts at zero)."""
    import torch.distributed as dist

    from merak_core import Trainer
    from merak_core.lora import LoraConfig

    lora = LoraConfig(r=4, alpha=8, target_modules="all-linear")
    args = _args(max_steps=2, **overrides)
    trainer = Trainer(_model(kind), args, Tokens(), optimizer_factory=_sgd, lora=lora)
    losses = [h["loss"] for h in trainer.train()]
    state = trainer.full_state_dict()
    return losses, state if dist.get_rank() == 0 else None


@pytest.mark.parametrize(("mode", "zero_stage"), [("ring", 0), ("ulysses", 0), ("ring", 3)])
def test_cp2_lora_equals_one_process(mode: str, zero_stage: int) -> None:
    """LoRA at cp=2 against the same LoRA run by one process (itself PEFT's, tests/e2e/test_lora.py);
    under ZeRO-3 the adapters alone are sharded over the cp ranks."""
    ref_losses, ref_state = run_on_ranks(1, _train_lora, "transformers", {})[0]
    overrides = {"cp": 2, "cp_mode": mode, "zero_stage": zero_stage}
    results = run_on_ranks(2, _train_lora, "transformers", overrides)
    assert ref_state is not None and results[0][1] is not None
    adapters = [n for n in ref_state if "lora_" in n]
    assert adapters and all(float(ref_state[n].abs().max()) > 0 for n in adapters if "lora_B" in n)
    for losses, _ in results:
        assert losses == pytest.approx(ref_losses, rel=1e-12)
    assert sorted(results[0][1]) == sorted(ref_state)
    for name, value in ref_state.items():
        torch.testing.assert_close(results[0][1][name], value, rtol=1e-10, atol=1e-12, msg=name)


EVAL_SAMPLES = 5
"""Evaluation samples: the last batch is partial (padded, its padding masked) at every layout below."""


def _eval_data() -> Tokens:
    return Tokens(EVAL_SAMPLES, seed=4, ignored=EVAL_IGNORED)


def _evaluate(kind: str, overrides: dict[str, Any]) -> float:
    from merak_core import Trainer

    args = _args(per_device_eval_batch_size=2, **overrides)
    trainer = Trainer(_model(kind), args, Tokens(), _eval_data(), optimizer_factory=_sgd)
    return trainer.evaluate()["eval_loss"]


@pytest.mark.parametrize(
    ("kind", "overrides"),
    [
        ("reference", {"cp": 2, "cp_mode": "ring"}),
        ("reference", {"cp": 2, "dp": 2, "cp_mode": "ulysses", "per_device_train_batch_size": 2}),
        (
            "transformers",
            {"cp": 2, "pp": 2, "per_device_train_batch_size": 2, "gradient_accumulation_steps": 2},
        ),
        (
            "reference",
            {"cp": 2, "pp": 2, "per_device_train_batch_size": 2, "gradient_accumulation_steps": 2},
        ),
    ],
    ids=["cp2-ring", "dp2_cp2-ulysses", "cp2_pp2-ring", "reference-cp2_pp2-ring"],
)
def test_cp_eval_loss_equals_one_process(kind: str, overrides: dict[str, Any]) -> None:
    """eval_loss at cp > 1: the mean over every counted token of the set, as one process computes it."""
    model, data = _model(kind), _eval_data()
    ids = torch.stack([data[i]["input_ids"] for i in range(EVAL_SAMPLES)])
    labels = torch.stack([data[i]["labels"] for i in range(EVAL_SAMPLES)])
    with torch.no_grad():
        out = model(ids)
    logits = getattr(out, "logits", out)
    expected = float(F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100))
    world = 2 * overrides.get("dp", 1) * overrides.get("pp", 1)
    for got in run_on_ranks(world, _evaluate, kind, overrides):
        assert got == pytest.approx(expected, rel=1e-12)


TEXT_VOCAB = 300
"""The vocabulary of the text data's tokenizer (tests.support.text.make_tokenizer)."""


def _text_run(spec: dict[str, Any], batch: int) -> tuple[bool, float, float, dict[str, torch.Tensor] | None]:
    """(each rank read only its tokens, eval loss before the step, the step's loss, the state after it)."""
    import torch.distributed as dist

    from merak_core import Trainer
    from merak_core.data.text import TextDataSpec, build_text_datasets

    train, evaluation = build_text_datasets(TextDataSpec(**spec))
    args = _args(cp=2, per_device_train_batch_size=batch, per_device_eval_batch_size=2)
    trainer = Trainer(_model("transformers", TEXT_VOCAB), args, train, evaluation, optimizer_factory=_sgd)
    views = (trainer.train_dataset, trainer.eval_dataset)
    read_here = all(v.cp_positions is not None and v[0]["input_ids"].shape == (SEQ // 2,) for v in views)
    eval_loss = trainer.evaluate()["eval_loss"]
    loss = trainer.train()[0]["loss"]
    state = trainer.full_state_dict()
    return read_here, eval_loss, loss, state if dist.get_rank() == 0 else None


def test_cp2_text_data_read_per_rank_equals_one_process(tmp_path: Any) -> None:
    """Text data at cp=2: each rank reads only its tokens of every sample (train and eval), and the
    eval loss, the loss and every gradient equal one process's on the whole samples."""
    from merak_core.data.text import TextDataSpec, build_text_datasets
    from tests.support.text import make_tokenizer, sentences, write_jsonl

    texts = sentences(40, seed=3, words=12)
    rows = [{"q": t[: len(t) // 3], "a": t[len(t) // 3 :]} for t in texts]  # prompt labels masked
    spec: dict[str, Any] = dict(
        format="jsonl",
        path=str(write_jsonl(tmp_path / "sft.jsonl", rows)),
        tokenizer=str(make_tokenizer(tmp_path / "tok", vocab_size=TEXT_VOCAB)),
        seq_len=SEQ,
        packing=False,  # records padded: the cp ranks count different tokens
        prompt_field="q",
        response_field="a",
        eval_fraction=0.2,
        cache_dir=str(tmp_path / "cache"),
    )
    train, evaluation = build_text_datasets(TextDataSpec(**spec))  # the token cache, built once here
    assert evaluation is not None
    model = _model("transformers", TEXT_VOCAB)

    def loss_of(data: Any) -> torch.Tensor:
        ids = torch.stack([data[i]["input_ids"] for i in range(len(data))])
        labels = torch.stack([data[i]["labels"] for i in range(len(data))])
        logits = model(ids).logits
        return F.cross_entropy(logits.reshape(-1, TEXT_VOCAB), labels.reshape(-1), ignore_index=-100)

    with torch.no_grad():
        eval_expected = float(loss_of(evaluation))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    loss = loss_of(train)  # one step over the whole training set (its sample order does not matter)
    loss.backward()
    for read_here, eval_loss, got_loss, _ in (results := run_on_ranks(2, _text_run, spec, len(train))):
        assert read_here
        assert eval_loss == pytest.approx(eval_expected, rel=1e-12)
        assert got_loss == pytest.approx(float(loss.detach()), rel=1e-12)
    state = results[0][3]
    assert state is not None
    for name, p in model.named_parameters():
        assert p.grad is not None
        torch.testing.assert_close(before[name] - state[name], p.grad, rtol=1e-9, atol=1e-11, msg=name)


def _train_from(
    kind: str, overrides: dict[str, Any], resume: str | None
) -> tuple[dict[int, float], dict[str, torch.Tensor] | None]:
    import torch.distributed as dist

    from merak_core import Trainer

    trainer = Trainer(_model(kind), _args(**overrides), Tokens(), optimizer_factory=_sgd)
    if resume is not None:
        trainer.resume(resume)
    losses = {int(h["step"]): h["loss"] for h in trainer.train()}
    state = trainer.full_state_dict()
    return losses, state if dist.get_rank() == 0 else None


def test_resume_a_cp2_checkpoint_at_cp1(tmp_path: Any) -> None:
    saved = {
        "output_dir": str(tmp_path / "cp2"),
        "max_steps": 2,
        "save_steps": 1,
        "lr_scheduler_type": "linear",
    }
    run_on_ranks(2, _train_from, "reference", {**saved, "cp": 2}, None)
    resumed, resumed_state = run_on_ranks(1, _train_from, "reference", saved, "step_1")[0]
    whole = {"output_dir": str(tmp_path / "whole"), "max_steps": 2, "lr_scheduler_type": "linear"}
    losses, state = run_on_ranks(1, _train_from, "reference", whole, None)[0]
    assert list(resumed) == [2]
    assert resumed[2] == pytest.approx(losses[2], rel=1e-12)
    assert resumed_state is not None and state is not None
    for name, value in state.items():
        torch.testing.assert_close(resumed_state[name], value, rtol=1e-10, atol=1e-12, msg=name)
