"""Expert parallelism of transformers' own MoE blocks (Mixtral, Qwen3-MoE, DeepSeek-V3) against one process.

Tiny float32 models (4 experts, hidden 32, 2 layers, top-2) with their fused experts modules
(``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``) sharded over EP by
``merak_core.parallel.expert_hf``; the routing is each model's own code: Mixtral's top-k softmax,
Qwen3-MoE's with ``norm_topk_prob``, DeepSeek-V3's grouped sigmoid routing with a non-zero score
correction bias, scaled weights and a shared expert. Three SGD steps of each family at dp2·ep2,
dp2·ep2·pp2, dp4·ep4 and dp2·ep2·tp2 (DeepSeek-V3 also at tp2 and tp2·pp2; Mixtral at dp4·ep2 with ZeRO-1
and clipping) against the same model trained by one process on the whole batch: every loss and every
parameter after the steps (so every step's gradients, the later ones with the routing the first changed).
Also: DeepSeek-V3 with a bias that sends every token to experts 2 and 3 (all rows to EP rank 1, none
to rank 0's experts); the models' router aux loss (``output_router_logits``) over the global batch
(merak_core.parallel.router_aux); a checkpoint of an ep=2 run resumed at ep=1; the Hugging Face export of an ep=2
run loaded by ``from_pretrained``, its logits equal to the one-process model's.
"""

from __future__ import annotations

import tempfile
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from tests.support.compare import replayable_arguments
from tests.support.dist import run_on_ranks

pytest.importorskip("transformers")
pytestmark = pytest.mark.transformers

SEQ, VOCAB, BATCH, LR, STEPS = 8, 96, 4, 0.5, 3
RTOL, ATOL = 2e-5, 2e-6


class Tokens(Dataset):
    """``BATCH`` random sequences, every label counted (the DP ranks' losses are means over equal counts)."""

    def __init__(self, size: int = BATCH) -> None:
        g = torch.Generator().manual_seed(3)
        self.ids = torch.randint(0, VOCAB, (size, SEQ + 1), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i, :-1], "labels": self.ids[i, 1:].clone()}


_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    num_experts_per_tok=2,
    attention_dropout=0.0,
    use_cache=False,
    tie_word_embeddings=False,
    experts_implementation="eager",
)


def _config(family: str) -> tuple[Any, Any]:
    import transformers as tf

    if family == "mixtral":
        return tf.MixtralConfig(
            **_COMMON, num_local_experts=4, router_jitter_noise=0.0
        ), tf.MixtralForCausalLM
    if family == "qwen3_moe":
        cfg = tf.Qwen3MoeConfig(
            **_COMMON, head_dim=8, num_experts=4, moe_intermediate_size=16, norm_topk_prob=True
        )
        return cfg, tf.Qwen3MoeForCausalLM
    cfg = tf.DeepseekV3Config(
        **{**_COMMON, "num_key_value_heads": 4},
        n_routed_experts=4,
        n_shared_experts=1,
        moe_intermediate_size=16,
        n_group=2,
        topk_group=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        first_k_dense_replace=1 if family == "deepseek_v3_dense" else 0,
        kv_lora_rank=16,
        q_lora_rank=8 if family == "deepseek_v3_dense" else None,
        qk_rope_head_dim=4,
        qk_nope_head_dim=4,
        v_head_dim=8,
    )
    return cfg, tf.DeepseekV3ForCausalLM


def _model(family: str, bias: str = "spread", aux: float = 0.0) -> torch.nn.Module:
    cfg, cls = _config(family)
    if aux:  # the model's router aux loss (transformers' load_balancing_loss_func)
        cfg.output_router_logits, cfg.router_aux_loss_coef = True, aux
    torch.manual_seed(0)
    model = cls(cfg).float()
    if family.startswith("deepseek_v3"):
        # spread: a correction bias that moves the choice (not the weights); one_rank: experts 2 and 3 always.
        value = torch.linspace(-0.1, 0.1, 4) if bias == "spread" else torch.tensor([-5.0, -5.0, 5.0, 5.0])
        for layer in model.model.layers[cfg.first_k_dense_replace :]:
            layer.mlp.gate.e_score_correction_bias.copy_(value)
    return model


def _args(**overrides: Any) -> Any:
    sizes = dict(
        per_device_train_batch_size=BATCH // 2,
        learning_rate=LR,
        max_steps=STEPS,
        dtype="float32",
    )
    return replayable_arguments("merak-ep-hf-", **{**sizes, **overrides})


def _sgd(groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
    return torch.optim.SGD(groups, lr=LR)


def _train(
    family: str, overrides: dict[str, Any], bias: str = "spread", aux: float = 0.0
) -> tuple[list[float], Any]:
    import torch.distributed as dist

    from merak_core import Trainer

    trainer = Trainer(_model(family, bias, aux), _args(**overrides), Tokens(), optimizer_factory=_sgd)
    history = trainer.train()
    state = trainer.full_state_dict()
    held = [tuple(p.shape) for n, p in trainer.model.named_parameters() if n.endswith("experts.gate_up_proj")]
    assert held and all(shape[0] == 4 // overrides["ep"] for shape in held), held  # this rank's experts only
    return [h["loss"] for h in history if "loss" in h], state if dist.get_rank() == 0 else None


def _reference(
    family: str, bias: str = "spread", aux: float = 0.0, max_norm: float = 0.0
) -> tuple[list[float], dict[str, torch.Tensor], Any]:
    model = _model(family, bias, aux)
    ids = Tokens().ids
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        out = model(input_ids=ids[:, :-1])
        loss = F.cross_entropy(out.logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
        if aux:  # transformers' own aux loss of the global batch
            loss = loss + aux * out.aux_loss
        loss.backward()
        if max_norm:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        opt.step()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}, model


def _check(
    results: list[tuple[list[float], Any]],
    family: str,
    bias: str = "spread",
    aux: float = 0.0,
    max_norm: float = 0.0,
) -> None:
    losses, params, _ = _reference(family, bias, aux, max_norm)
    state = results[0][1]
    assert state is not None
    assert set(state) == set(params)
    for got_losses, _ in results:
        assert got_losses == pytest.approx(losses, rel=RTOL)
    for name, value in params.items():
        torch.testing.assert_close(state[name], value, rtol=RTOL, atol=ATOL, msg=name)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "deepseek_v3"])
def test_dp2_ep2_equals_one_process(family: str) -> None:
    _check(run_on_ranks(2, _train, family, {"ep": 2}), family)


def test_all_tokens_to_one_rank_is_exact() -> None:
    """DeepSeek-V3 with a correction bias choosing experts 2 and 3 for every token: EP rank 1 gets every row."""
    _check(run_on_ranks(2, _train, "deepseek_v3", {"ep": 2}, "one_rank"), "deepseek_v3", "one_rank")


@pytest.mark.parametrize(("family", "ep"), [("mixtral", 2), ("qwen3_moe", 2), ("mixtral", 1)])
def test_router_aux_loss_of_the_global_batch(family: str, ep: int) -> None:
    """output_router_logits=True: the loss adds coef x transformers' aux loss of the global batch (its per-expert
    fractions and mean probabilities over both ranks' tokens, not the mean of the ranks' own aux losses), at
    ep=2 and without EP (dp=2)."""
    _check(run_on_ranks(2, _train, family, {"ep": ep}, "spread", 0.5), family, aux=0.5)


def _train_accumulating(overrides: dict[str, Any]) -> tuple[list[float], Any]:
    from merak_core import Trainer

    model = _model("mixtral", aux=0.5)
    trainer = Trainer(model, _args(**overrides), Tokens(STEPS * BATCH), optimizer_factory=_sgd)
    losses = [h["loss"] for h in trainer.train() if "loss" in h]
    return losses, trainer.full_state_dict()


def test_router_aux_loss_per_global_microbatch() -> None:
    """With gradient accumulation the one-process run matched is the model on each global microbatch
    (microbatch m of both DP ranks together), its aux loss over those rows: STEPS steps of 2 microbatches."""
    from tests.e2e._trainer_support import reference_microbatches

    overrides = {"ep": 2, "per_device_train_batch_size": 1, "gradient_accumulation_steps": 2}
    got = run_on_ranks(2, _train_accumulating, overrides)
    model, data = _model("mixtral", aux=0.5), Tokens(STEPS * BATCH)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for chunks in reference_microbatches(
        len(data), _args(**overrides), 2
    ):  # rank 0's microbatches, then rank 1's
        opt.zero_grad()
        total = 0.0
        for m in range(2):
            ids = data.ids[chunks[m] + chunks[2 + m]]
            out = model(input_ids=ids[:, :-1])
            loss = F.cross_entropy(out.logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1)) + 0.5 * out.aux_loss
            (loss / 2).backward()
            total += loss.item() / 2
        opt.step()
        losses.append(total)
    for rank_losses, _ in got:
        assert rank_losses == pytest.approx(losses, rel=RTOL)
    state = got[0][1]
    for name, value in model.named_parameters():
        torch.testing.assert_close(state[name], value.detach(), rtol=RTOL, atol=ATOL, msg=name)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "deepseek_v3"])
def test_dp2_ep2_pp2_equals_one_process(family: str) -> None:
    """The fused experts inside pipeline stages (a trace leaf), two microbatches per step."""
    overrides = {"ep": 2, "pp": 2, "per_device_train_batch_size": 1, "gradient_accumulation_steps": 2}
    _check(run_on_ranks(4, _train, family, overrides), family)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "deepseek_v3"])
def test_dp4_ep4_equals_one_process(family: str) -> None:
    """One expert per rank: every token pair crosses the all-to-all to wherever its expert lives."""
    _check(run_on_ranks(4, _train, family, {"ep": 4, "per_device_train_batch_size": 1}), family)


def _train_pretrained(folder: str, overrides: dict[str, Any]) -> tuple[list[float], Any]:
    import torch.distributed as dist

    from merak_core import Trainer

    trainer = Trainer(None, _args(**overrides), Tokens(), optimizer_factory=_sgd, pretrained=folder)
    losses = [h["loss"] for h in trainer.train() if "loss" in h]
    state = trainer.full_state_dict()
    return losses, state if dist.get_rank() == 0 else None


def test_pretrained_mixtral_pp2_without_ep_equals_one_process() -> None:
    """ep=1 under a pipeline, the model built on the meta device from its folder: each fused experts module a
    trace leaf running its own forward inside one stage, its meta pre-run the active experts' work
    (merak_core.parallel.expert_hf.fused_expert_leaves; before, its routing's nonzero() on meta refused the
    trace). Two microbatches per step."""
    import json
    from pathlib import Path

    folder = Path(tempfile.mkdtemp(prefix="merak-ep-hf-pretrained-"))
    _model("mixtral").save_pretrained(str(folder), save_original_format=False)
    config = json.loads((folder / "config.json").read_text())  # transformers does not save the eager choice
    (folder / "config.json").write_text(json.dumps({**config, "experts_implementation": "eager"}))
    overrides = {"pp": 2, "per_device_train_batch_size": 2, "gradient_accumulation_steps": 2}
    _check(run_on_ranks(2, _train_pretrained, str(folder), overrides), "mixtral")


def test_mixtral_dp4_ep2_zero1_clipped_equals_one_process() -> None:
    """ZeRO-1 (the experts' states sharded over their replica group) with clipping at a norm below the
    gradient's: each expert's term counted once."""
    overrides = {"ep": 2, "zero_stage": 1, "per_device_train_batch_size": 1, "max_grad_norm": 0.05}
    _check(run_on_ranks(4, _train, "mixtral", overrides), "mixtral", max_norm=0.05)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "deepseek_v3"])
def test_dp2_ep2_tp2_equals_one_process(family: str) -> None:
    """Attention, embeddings and head TP-sharded by the model's plan, the fused experts whole per EP rank (the
    plan's experts entries dropped), the router replicated; clipping on."""
    overrides = {"ep": 2, "tp": 2, "max_grad_norm": 0.05}
    _check(run_on_ranks(4, _train, family, overrides), family, max_norm=0.05)


@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v3_dense"])
def test_deepseek_v3_tp2_equals_one_process(family: str) -> None:
    """DeepSeek-V3 at tp=2 alone: multi-head latent attention split by heads, the experts split by the plan
    (style experts), the shared expert column/row; ``deepseek_v3_dense``: with the low-rank query
    (q_lora_rank: q_a_proj and its norm replicated, q_b_proj column) and a dense first layer (column/row). The rotary key shared by the heads is expanded over each
    rank's heads only: merak_tp.LatentKVProjection sums that slice's gradient over TP (without it the
    latent projection and every replicated parameter before it get a partial gradient)."""
    overrides = {"ep": 1, "tp": 2, "per_device_train_batch_size": BATCH}
    _check(run_on_ranks(2, _train, family, overrides), family)


def _resume_ep_tp() -> dict[str, Any]:
    """3 steps at dp2·ep2·tp2 saving every step; resumed from step_1 at the same layout and at dp4 (ep=1, tp=1)."""
    import torch.distributed as dist

    from merak_core import Trainer

    shared = [tempfile.mkdtemp(prefix="merak-ep-tp-") if dist.get_rank() == 0 else ""]
    dist.broadcast_object_list(shared, src=0)
    out, common = shared[0], dict(max_steps=3, save_steps=1, learning_rate=0.01)
    full = Trainer(_model("mixtral"), _args(ep=2, tp=2, output_dir=f"{out}/run", **common), Tokens())
    got: dict[str, Any] = {"full": ([h["loss"] for h in full.train() if "loss" in h], full.full_state_dict())}
    dist.barrier()
    for name, layout in (
        ("same", dict(ep=2, tp=2)),
        ("dp4", dict(ep=1, tp=1, per_device_train_batch_size=1)),
    ):
        resumed = Trainer(_model("mixtral"), _args(output_dir=f"{out}/{name}", **layout, **common), Tokens())
        assert resumed.resume(f"{out}/run/checkpoints/step_1") == 1
        got[name] = ([h["loss"] for h in resumed.train() if "loss" in h], resumed.full_state_dict())
        dist.barrier()
    return got


def test_checkpoint_at_ep2_tp2_resumes() -> None:
    """The fused experts' DTensor over the EP mesh, written by both TP ranks of each EP coordinate: resumed at
    dp2·ep2·tp2 bit for bit, at dp4 (every expert on each rank, no TP) to rounding."""
    got = run_on_ranks(4, _resume_ep_tp)[0]
    full_losses, full_state = got["full"]
    same_losses, same_state = got["same"]
    assert same_losses == full_losses[1:]
    for name, value in full_state.items():
        assert torch.equal(same_state[name], value), name
    losses, state = got["dp4"]
    assert losses == pytest.approx(full_losses[1:], rel=RTOL)
    for name, value in full_state.items():
        torch.testing.assert_close(state[name], value, rtol=RTOL, atol=ATOL, msg=name)


def _resume_and_export() -> dict[str, Any]:
    """3 steps at ep=2 saving every step; fresh Trainers at ep=2 and ep=1 resume step_1 and train to 3; the
    first run exported to Hugging Face, and the export started from at ep=2."""
    import torch.distributed as dist

    from merak_core import Trainer
    from merak_core.hf.export import export_hf

    shared = [tempfile.mkdtemp(prefix="merak-ep-hf-resume-") if dist.get_rank() == 0 else ""]
    dist.broadcast_object_list(shared, src=0)
    out = shared[0]
    if dist.get_rank() == 0:
        _model("mixtral").save_pretrained(f"{out}/initial")
    dist.barrier()
    common = dict(output_dir=f"{out}/run", max_steps=3, save_steps=1, learning_rate=0.01)
    full = Trainer(_model("mixtral"), _args(ep=2, **common), Tokens())
    got: dict[str, Any] = {"full": ([h["loss"] for h in full.train() if "loss" in h], full.full_state_dict())}
    export_hf(full.checkpoint_parts, f"{out}/export", pretrained=f"{out}/initial")
    dist.barrier()
    # The export as model.pretrained at ep=2: each rank reads its own experts' rows.
    loaded = Trainer(None, _args(ep=2, output_dir=f"{out}/loaded"), Tokens(), pretrained=f"{out}/export")
    got["loaded"], got["out"] = loaded.full_state_dict(), out
    for ep in (2, 1):  # each in its own output_dir: the first run's step_3 stays as it saved it
        resumed = Trainer(
            _model("mixtral"), _args(ep=ep, **{**common, "output_dir": f"{out}/ep{ep}"}), Tokens()
        )
        assert resumed.resume(f"{out}/run/checkpoints/step_1") == 1
        got[ep] = ([h["loss"] for h in resumed.train() if "loss" in h], resumed.full_state_dict())
        dist.barrier()
    return got


def test_checkpoint_at_ep2_resumes_at_ep1_and_exports() -> None:
    """Fused experts are saved by their one-process names and full shapes: an ep=2 checkpoint resumes at ep=2
    bit for bit and at ep=1 (every expert on each rank) to rounding; the export of the ep=2 run loads with
    ``from_pretrained`` and gives the logits of the run's parameters in one process, and as
    ``model.pretrained`` at ep=2 (each rank reading its experts' rows) it gives back the run's parameters bit
    for bit; the checkpoint exported offline (``export_checkpoint``) gives the same logits."""
    from transformers import MixtralForCausalLM

    from merak_core.hf.export import export_checkpoint

    got = run_on_ranks(2, _resume_and_export)[0]
    full_losses, full_state = got["full"]
    assert full_state["model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 64, 32)
    for ep in (2, 1):
        losses, final_state = got[ep]
        assert set(final_state) == set(full_state)
        if ep == 2:
            assert losses == full_losses[1:]
            for name, value in full_state.items():
                assert torch.equal(final_state[name], value), name
        else:
            assert losses == pytest.approx(full_losses[1:], rel=RTOL)
            for name, value in full_state.items():
                torch.testing.assert_close(final_state[name], value, rtol=RTOL, atol=ATOL, msg=name)
    assert set(got["loaded"]) == set(full_state)
    for name, value in full_state.items():
        assert torch.equal(got["loaded"][name], value), name
    reference = _model("mixtral").eval()
    reference.load_state_dict(full_state)
    ids = Tokens().ids[:, :-1]
    out = got["out"]
    # The ep=2 checkpoint exported offline (merak export --to-hf) too: the experts' full tensors.
    export_checkpoint(f"{out}/run/checkpoints/step_3", f"{out}/offline", pretrained=f"{out}/initial")
    for folder in ("export", "offline"):
        exported = MixtralForCausalLM.from_pretrained(f"{out}/{folder}").float().eval()
        with torch.no_grad():
            torch.testing.assert_close(
                exported(input_ids=ids).logits, reference(input_ids=ids).logits, msg=folder
            )


def test_deepseek_v3_tp2_pp2_equals_one_process() -> None:
    """The latent projection's gradient sum inside a traced pipeline stage: merak_tp.LatentKVProjection is a
    TP trace leaf, so the stage keeps its backward (a hook would be lost in the traced graph)."""
    overrides = {
        "ep": 1,
        "tp": 2,
        "pp": 2,
        "per_device_train_batch_size": 2,
        "gradient_accumulation_steps": 2,
    }
    _check(run_on_ranks(4, _train, "deepseek_v3", overrides), "deepseek_v3")
