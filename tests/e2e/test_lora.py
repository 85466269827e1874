"""LoRA fine-tuning at 3D layouts against a single-process PEFT reference (float64), and PEFT out.

A tiny float64 GPT-2 (``Conv1D``, fused ``c_attn``, tied embeddings) or Llama (grouped-query
attention) is saved with ``save_pretrained``; the reference is ``peft.get_peft_model`` on
``from_pretrained`` of that folder with the same ``LoraConfig``. Its initial adapters are saved
with ``save_pretrained`` and Merak starts from them (``lora.from``), so both runs start equal; B
is zero at first (the first loss is the base model's), so only the steps make the comparison
meaningful. After 3 AdamW steps over the same microbatches:

- the losses and every adapter (Merak's PEFT export, ``adapter_model.safetensors``) equal PEFT's;
- the base weights are bit-unchanged on every rank, have no gradient and no optimizer state, and
  the DP gradient sync holds adapters only;
- ``PeftModel.from_pretrained(base, export)`` loads the export unchanged and its loss on the eval
  blocks equals Merak's eval loss (so the exported adapters give Merak's outputs).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.e2e._pretrained_support import Blocks, lm_loss, make_folder, token_stream
from tests.e2e._trainer_support import make_args, reference_steps
from tests.support.compare import assert_tensors_close
from tests.support.dist import run_on_ranks

pytestmark = pytest.mark.transformers

TRAIN_BLOCKS, EVAL_BLOCKS = 32, 8
TARGETS = {
    "gpt2": ["c_attn", "c_proj", "c_fc"],
    "llama": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "phi3": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],
}
TARGETS["llama4"] = TARGETS["llama"]


def _folder(name: str, root: Path) -> tuple[Path, Path]:
    """A tiny float64 model folder with a tokenizer: GPT-2 and Llama from the shared helpers; Phi-3 (fused
    grouped-query ``qkv_proj`` and ``gate_up_proj``) and a four-layer Llama here."""
    if name not in ("phi3", "llama4"):
        return make_folder(name, root)
    import transformers as tf

    from tests.e2e._pretrained_support import VOCAB, build_tokenizer, write_text

    torch.manual_seed(0)
    sizes = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2
    )
    common = dict(max_position_embeddings=64, use_cache=False, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    if name == "llama4":  # four layers: enough for two virtual stages on each of two pipeline ranks
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**sizes, **common, num_hidden_layers=4))
    else:
        cfg = tf.Phi3Config(
            **sizes, **common, num_hidden_layers=2, resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0
        )
        model = tf.Phi3ForCausalLM(cfg)
    folder = root / name
    model.double().save_pretrained(str(folder))
    text = write_text(root / "train.txt")
    build_tokenizer(text, folder)
    return folder, text


def _datasets(folder: Path, text: Path) -> tuple[Blocks, Blocks]:
    ids = token_stream(text, folder / "tokenizer.json")
    return Blocks(ids, count=TRAIN_BLOCKS), Blocks(ids, start=TRAIN_BLOCKS, count=EVAL_BLOCKS)


def lora_on_ranks(
    folder: str, text: str, out: str, args_kwargs: dict[str, Any], lora_kwargs: dict[str, Any]
) -> dict[str, Any]:
    """Rank body: LoRA from the folder and ``lora_kwargs`` (a ``from`` adapter), 3 steps, PEFT export."""
    from merak_core import Trainer
    from merak_core.lora import LoraConfig
    from merak_core.lora.apply import is_adapter_name
    from merak_core.parallel.fsdp import is_sharded

    args = make_args(
        **args_kwargs, output_dir=str(Path(out) / "run"), export_hf_dir=str(Path(out) / "adapter")
    )
    train, evaluation = _datasets(Path(folder), Path(text))
    trainer = Trainer(
        None, args, train, evaluation, loss_fn=lm_loss, pretrained=folder, lora=LoraConfig(**lora_kwargs)
    )
    named = trainer.model.named_parameters()
    base = {n: p.detach().clone() for n, p in named if not is_adapter_name(n)}
    history = trainer.train()
    frozen = [p for n, p in named if not is_adapter_name(n)]
    adapters = [p for n, p in named if is_adapter_name(n)]
    state_params = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    sync = trainer.dp_sync
    if sync is not None and hasattr(sync, "frozen"):  # ZeRO-2/3: FSDP2 shards the adapters alone
        synced = [p for p in adapters if is_sharded(p)] if all(not is_sharded(p) for p in frozen) else frozen
    else:
        synced = [] if sync is None else [p for b in sync.buckets for p in b.params]
    return {
        "losses": [h["loss"] for h in history],
        "eval_loss": trainer.last_eval["eval_loss"],
        "base_unchanged": all(torch.equal(base[n], p) for n, p in named if n in base),
        "frozen_clean": all(
            not p.requires_grad and p.grad is None and id(p) not in state_params for p in frozen
        ),
        "adapters_trained": bool(adapters)
        and all(p.requires_grad and id(p) in state_params for p in adapters),
        "synced_adapters_only": all(p.requires_grad for p in synced)
        and (trainer.dp_sync is None or bool(synced)),
        "optimizer_state": len(trainer.optimizer.state),
        "num_adapters": len(adapters),
    }


def peft_reference(
    folder: Path, text: Path, targets: list[str], args_kwargs: dict[str, Any], dp: int, adapter0: Path
) -> tuple[Any, list[float]]:
    """PEFT's LoRA on ``from_pretrained(folder)`` (float64); saves its initial adapters to ``adapter0``;
    trains 3 steps as the Trainer does. Returns (the PEFT model, its losses)."""
    import peft
    import transformers as tf

    torch.manual_seed(123)
    base = tf.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float64)
    model = peft.get_peft_model(
        base, peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets)
    )
    model.save_pretrained(str(adapter0))
    train, _ = _datasets(folder, text)

    def microbatch_loss(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return lm_loss(
            model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]), batch["labels"]
        )

    losses = reference_steps(model, train, make_args(**args_kwargs), dp, microbatch_loss)
    return model, losses


def _eval_loss(model: Any, folder: Path, text: Path) -> float:
    _, evaluation = _datasets(folder, text)
    batch = torch.utils.data.default_collate([evaluation[i] for i in range(len(evaluation))])
    with torch.no_grad():
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    return float(lm_loss(out, batch["labels"]))


@pytest.mark.parametrize(
    ("name", "layout", "options"),
    [
        ("gpt2", (1, 2, 1), {}),
        ("llama", (1, 1, 2), {}),
        ("gpt2", (2, 1, 1), {"zero_stage": 1}),
        ("llama", (1, 2, 2), {}),
        ("phi3", (1, 2, 1), {}),
        ("llama", (1, 2, 1), {"sequence_parallel": True}),
        ("gpt2", (1, 2, 2), {"sequence_parallel": True}),
        ("llama", (1, 2, 1), {"overlap_chunks": 2}),
        ("phi3", (1, 2, 1), {"sequence_parallel": True, "overlap_chunks": 2}),
        ("llama", (1, 2, 1), {"overlap_chunks": 2, "targets": ["q_proj", "v_proj", "up_proj"]}),
        ("gpt2", (2, 1, 2), {"recompute": "full"}),
        ("llama", (2, 2, 2), {"sequence_parallel": True}),
        ("llama4", (1, 1, 2), {"virtual_stages": 2, "schedule": "zb_v"}),
        ("gpt2", (2, 1, 1), {"zero_stage": 2}),
        ("llama", (2, 1, 1), {"zero_stage": 3}),
        ("gpt2", (2, 1, 2), {"zero_stage": 3}),
        ("phi3", (2, 1, 2), {}),
        ("phi3", (1, 2, 2), {}),
        ("phi3", (2, 2, 2), {"sequence_parallel": True}),
        ("gpt2", (2, 2, 2), {}),
        ("llama", (2, 1, 2), {}),
    ],
    ids=[
        "gpt2-tp2",
        "llama-pp2",
        "gpt2-dp2-zero1",
        "llama-tp2_pp2",
        "phi3-tp2",
        "llama-tp2-sp",
        "gpt2-tp2_pp2-sp",
        "llama-tp2-overlap2",
        "phi3-tp2-sp-overlap2",
        "llama-tp2-overlap2-blocks",  # row layers unwrapped: the regions run sub-pipelined (block mode)
        "gpt2-dp2_pp2-recompute",
        "llama-2x2x2-sp",
        "llama-pp2-zbv",  # two virtual stages per rank, split backward (frozen weights get no W step)
        "gpt2-dp2-zero2",  # FSDP2 shards the adapters only; the frozen base stays whole on every rank
        "llama-dp2-zero3",
        "gpt2-dp2_pp2-zero3",  # the frozen tied embedding on both stages: no cross-stage sum
        "phi3-dp2_pp2",
        "phi3-tp2_pp2",
        "phi3-2x2x2-sp",
        "gpt2-2x2x2",
        "llama-dp2_pp2",
    ],
)
def test_lora_matches_peft(name: str, layout: tuple[int, int, int], options: dict[str, Any]) -> None:
    peft = pytest.importorskip("peft")
    tf = pytest.importorskip("transformers")
    from safetensors.torch import load_file

    dp, tp, pp = layout
    options = dict(options)
    targets = options.pop("targets", TARGETS[name])
    root = Path(tempfile.mkdtemp(prefix="merak-lora-"))
    folder, text = _folder(name, root)
    kwargs: dict[str, Any] = dict(
        dp=dp, tp=tp, pp=pp, gradient_accumulation_steps=2, per_device_eval_batch_size=2, **options
    )
    ref_model, ref_losses = peft_reference(folder, text, targets, kwargs, dp, root / "adapter0")
    lora = {"r": 4, "alpha": 8, "target_modules": targets, "from_dir": str(root / "adapter0")}
    results = run_on_ranks(
        dp * tp * pp, lora_on_ranks, str(folder), str(text), str(root / "out"), kwargs, lora
    )

    for rank, r in enumerate(results):
        assert r["base_unchanged"] and r["frozen_clean"] and r["adapters_trained"], (rank, r)
        assert r["synced_adapters_only"], (rank, r)
        assert r["optimizer_state"] <= r["num_adapters"], (rank, r)
    losses = results[-1]["losses"]  # the last stage's ranks know it; every rank reports the global mean
    assert losses == pytest.approx(ref_losses, rel=1e-10, abs=1e-12)

    exported = root / "out" / "adapter"
    config = json.loads((exported / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", 4, 8)
    mine = load_file(str(exported / "adapter_model.safetensors"))
    ref_state = peft.get_peft_model_state_dict(ref_model)
    assert sorted(mine) == sorted(ref_state)
    for key, ref in ref_state.items():
        assert_tensors_close(mine[key], ref, rtol=1e-9, atol=1e-11, name=key)
    assert any(float(t.abs().max()) > 0 for k, t in mine.items() if "lora_B" in k)  # the steps moved B

    # PEFT loads the export unchanged; its eval loss is Merak's.
    base = tf.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float64)
    loaded = peft.PeftModel.from_pretrained(base, str(exported))
    loaded_state = peft.get_peft_model_state_dict(loaded)
    for key, tensor in mine.items():
        assert torch.equal(loaded_state[key], tensor), key
    assert _eval_loss(loaded, folder, text) == pytest.approx(results[0]["eval_loss"], rel=1e-10)


def lora_resume_on_ranks(folder: str, text: str, out: str, args_kwargs: dict[str, Any]) -> dict[str, Any]:
    """Rank body: a model built by a factory (real weights) with adapters drawn by Merak; 3 steps with a
    checkpoint at step 2; a second Trainer resumed from it runs step 3. Both final states on rank 0."""
    import torch.distributed as dist
    import transformers as tf

    from merak_core import Trainer
    from merak_core.lora import LoraConfig

    train, _ = _datasets(Path(folder), Path(text))
    lora = LoraConfig(r=4, alpha=8, target_modules="all-linear")
    states, losses = [], []
    for resume in (False, True):
        args = make_args(**args_kwargs, output_dir=str(Path(out) / ("b" if resume else "a")), save_steps=2)
        model = tf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64)  # a factory's model
        trainer = Trainer(model, args, train, loss_fn=lm_loss, lora=lora)
        if resume:
            dist.barrier()
            trainer.resume(str(Path(out) / "a" / "checkpoints" / "step_2"))
            assert trainer.global_step == 2, trainer.global_step
        history = trainer.train()
        losses.append([h["loss"] for h in history])
        states.append(trainer.full_state_dict())
    return {"losses": losses, "states": states if dist.get_rank() == 0 else None}


def test_lora_default_init_and_resume() -> None:
    """Adapters drawn by Merak (B = 0: the first loss is the base model's, PEFT's first loss); a resumed run
    continues bit-identically from the checkpoint (adapters and their optimizer state restored)."""
    pytest.importorskip("peft")
    root = Path(tempfile.mkdtemp(prefix="merak-lora-resume-"))
    folder, text = make_folder("gpt2", root)
    kwargs: dict[str, Any] = dict(dp=1, tp=1, pp=2, gradient_accumulation_steps=2)
    _, ref_losses = peft_reference(folder, text, ["c_attn", "c_proj", "c_fc"], kwargs, 1, root / "adapter0")
    results = run_on_ranks(2, lora_resume_on_ranks, str(folder), str(text), str(root / "out"), kwargs)
    (first, resumed), (full, after_resume) = results[0]["losses"], results[0]["states"]
    assert first[0] == pytest.approx(ref_losses[0], rel=1e-12)  # B = 0: the base model's loss
    assert first[1:] != pytest.approx(ref_losses[1:], rel=1e-6)  # Merak drew other A than PEFT's seed did
    assert resumed == [first[2]]
    assert sorted(full) == sorted(after_resume)
    adapters = [k for k in full if k.endswith((".lora_A.weight", ".lora_B.weight"))]
    assert len(adapters) == 2 * 2 * 4  # c_attn, attn.c_proj, c_fc, mlp.c_proj per layer (lm_head left out)
    for key, tensor in full.items():
        assert torch.equal(tensor, after_resume[key]), key
    base = tf_state(folder)
    for key, tensor in base.items():  # frozen: unchanged (tied lm_head is wte)
        assert torch.equal(full[key], tensor), key
    _check_checkpoint_exports(root, folder, full)


def _check_checkpoint_exports(root: Path, folder: Path, full: dict[str, torch.Tensor]) -> None:
    """``merak export`` of the LoRA checkpoint: a PEFT folder holding the run's adapters; with ``--merge`` the
    whole model with ``W + (alpha / r) B A`` (``Conv1D`` weights stored (in, out)), whose logits are PEFT's."""
    import peft
    import transformers as tf
    from safetensors.torch import load_file

    from merak_core.cli import main

    checkpoint = str(root / "out" / "a" / "checkpoints" / "latest")
    assert main(["export", checkpoint, "--to-hf", str(root / "peft")]) == 0
    exported = load_file(str(root / "peft" / "adapter_model.safetensors"))
    adapters = {k: t for k, t in full.items() if k.endswith((".lora_A.weight", ".lora_B.weight"))}
    assert sorted(exported) == sorted("base_model.model." + k for k in adapters)
    for key, tensor in adapters.items():
        assert torch.equal(exported["base_model.model." + key], tensor), key
    merge = ["export", checkpoint, "--to-hf", str(root / "merged"), "--merge", "--pretrained", str(folder)]
    assert main(merge) == 0  # the run's model came from a factory: the config.json is given
    merged = tf.AutoModelForCausalLM.from_pretrained(str(root / "merged"), dtype=torch.float64).eval()
    base_model = tf.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float64)
    with_adapters = peft.PeftModel.from_pretrained(base_model, str(root / "peft")).eval()
    w = "transformer.h.0.attn.c_proj"  # a square Conv1D: only the orientation tells (in, out) from (out, in)
    expected = full[w + ".weight"] + 2.0 * (full[w + ".lora_B.weight"] @ full[w + ".lora_A.weight"]).t()
    torch.testing.assert_close(
        dict(merged.named_parameters())[w + ".weight"], expected, rtol=1e-12, atol=1e-12
    )
    ids = torch.randint(0, 90, (2, 8), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, with_adapters(ids).logits, rtol=1e-10, atol=1e-10)


def tf_state(folder: Path) -> dict[str, torch.Tensor]:
    from tests.e2e._pretrained_support import read_folder

    return read_folder(folder)
