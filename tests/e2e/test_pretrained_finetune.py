"""A Hugging Face folder fine-tuned by Merak at 2x2x2 and 1x2x4 and exported back, against transformers.

A tiny float64 GPT-2 (tied embeddings, ``Conv1D`` weights, fused q/k/v) and Llama (grouped-query
attention, untied head) are saved with ``save_pretrained`` in the test, a tokenizer is trained on
text written in the test, and the text's token stream is cut into blocks. On the ranks the model
is built on the meta device from ``config.json`` and each rank loads only its TP slices of its
own stage; then:

(a) the folder exported before any step equals the original tensor for tensor (names, dtype, values);
(b) after 3 steps the parameters ``from_pretrained`` loads from the export equal a single-process
    fine-tune of ``from_pretrained(original)`` on the same token stream (float64);
(c) transformers' own loss (``model(input_ids, labels=...)``) on the eval text equals Merak's eval
    loss (transformers computes it in float32, hence the tolerance).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.e2e._pretrained_support import SEQ, Blocks, lm_loss, make_folder, read_folder, token_stream
from tests.e2e._trainer_support import make_args, reference_steps
from tests.support.compare import assert_tensors_close
from tests.support.dist import run_on_ranks

pytestmark = pytest.mark.transformers

TRAIN_BLOCKS, EVAL_BLOCKS = 64, 16


def _datasets(folder: Path, text: Path) -> tuple[Blocks, Blocks]:
    ids = token_stream(text, folder / "tokenizer.json")
    return Blocks(ids, count=TRAIN_BLOCKS), Blocks(ids, start=TRAIN_BLOCKS, count=EVAL_BLOCKS)


def finetune_on_ranks(
    folder: str, text: str, out: str, args_kwargs: dict[str, Any]
) -> tuple[int, int, float]:
    """Rank body: the Trainer from the folder, exported at once, trained (exported at the end), evaluated.

    Returns (bytes this rank read from the folder, bytes of its own parameters, eval loss).
    """
    from merak_core import Trainer
    from merak_core.hf import PretrainedWeights, export_hf

    args = make_args(**args_kwargs, output_dir=str(Path(out) / "run"), export_hf_dir=str(Path(out) / "step3"))
    train, evaluation = _datasets(Path(folder), Path(text))
    read: list[int] = []
    original = PretrainedWeights.load_into
    PretrainedWeights.load_into = lambda self, pm: read.append(original(self, pm)) or read[-1]  # type: ignore
    try:
        trainer = Trainer(None, args, train, evaluation, loss_fn=lm_loss, pretrained=folder)
    finally:
        PretrainedWeights.load_into = original  # type: ignore[method-assign]
    own = sum(
        p.numel() * p.element_size() for p in {id(p): p for _, p in trainer.model.named_parameters()}.values()
    )
    export_hf(trainer.checkpoint_parts, Path(out) / "step0", max_shard_size="40KB")
    trainer.train()  # exports to step3 (export_hf_dir) after the last step
    return read[0], own, trainer.last_eval["eval_loss"]


def reference_finetune(
    folder: Path, text: Path, args_kwargs: dict[str, Any], dp: int
) -> dict[str, torch.Tensor]:
    """The same fine-tune in one process, from ``from_pretrained(folder)``; its parameters by name."""
    import transformers as tf

    args = make_args(**args_kwargs)
    model = tf.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float64)
    train, _ = _datasets(folder, text)

    def microbatch_loss(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return lm_loss(
            model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]), batch["labels"]
        )

    reference_steps(model, train, args, dp, microbatch_loss)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def transformers_eval_loss(folder: Path, text: Path, tokenizer_folder: Path) -> float:
    """transformers' own causal-LM loss on the eval blocks (labels shifted inside the model)."""
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(str(folder))
    ids = token_stream(text, tokenizer_folder / "tokenizer.json")
    blocks = torch.stack(
        [ids[i * SEQ : i * SEQ + SEQ + 1] for i in range(TRAIN_BLOCKS, TRAIN_BLOCKS + EVAL_BLOCKS)]
    )
    with torch.no_grad():
        return float(model(input_ids=blocks, labels=blocks).loss)


def _files(folder: Path) -> tuple[set[str], dict[str, str] | None]:
    """The weight files of an exported folder and its index's weight map (None: one file, no index)."""
    import json

    index = folder / "model.safetensors.index.json"
    weight_map = json.loads(index.read_text())["weight_map"] if index.is_file() else None
    return {p.name for p in folder.glob("model*.safetensors")}, weight_map


@pytest.mark.parametrize(
    ("name", "layout", "save_steps"),
    [("gpt2", (2, 2, 2), None), ("llama", (1, 2, 4), 3)],
    ids=["gpt2-dp2_tp2_pp2", "llama-dp1_tp2_pp4-checkpointed"],
)
def test_pretrained_finetune_and_export(
    name: str, layout: tuple[int, int, int], save_steps: int | None
) -> None:
    """GPT-2 exports at the end with no checkpoint at all; Llama's step-3 checkpoint exports the same folder."""
    tf = pytest.importorskip("transformers")
    dp, tp, pp = layout
    root = Path(tempfile.mkdtemp(prefix="merak-pretrained-"))
    folder, text = make_folder(name, root)
    kwargs = dict(
        dp=dp,
        tp=tp,
        pp=pp,
        gradient_accumulation_steps=pp,
        per_device_eval_batch_size=2,
        save_steps=save_steps,
    )
    results = run_on_ranks(dp * tp * pp, finetune_on_ranks, str(folder), str(text), str(root / "out"), kwargs)

    # Each rank read exactly its own shard of its own stage, never the whole model.
    for rank, (read, own, _) in enumerate(results):
        assert read == own, f"rank {rank} read {read} bytes for {own} bytes of parameters"

    # (a) before any step: the export is the original folder, tensor for tensor.
    original, step0 = read_folder(folder), read_folder(root / "out" / "step0")
    assert sorted(step0) == sorted(original)
    for key, ref in original.items():
        assert step0[key].dtype == ref.dtype and torch.equal(step0[key], ref), key
    exported = root / "out" / "step3"
    assert (root / "out" / "step0" / "model.safetensors.index.json").is_file()
    # One format: the run's export cuts the same files as the one-process writer of the same tensors.
    from merak_core.hf import PretrainedFolder, write_hf_folder

    alone = write_hf_folder(step0, root / "alone", source=PretrainedFolder(folder), max_shard_size="40KB")
    assert _files(alone) == _files(root / "out" / "step0")
    assert (exported / "tokenizer.json").read_bytes() == (folder / "tokenizer.json").read_bytes()
    assert (exported / "generation_config.json").is_file()

    # (b) after 3 steps: what from_pretrained loads equals the single-process fine-tune.
    loaded = tf.AutoModelForCausalLM.from_pretrained(str(exported))
    ref_state = reference_finetune(folder, text, kwargs, dp)
    state = dict(loaded.named_parameters())
    assert sorted(state) == sorted(ref_state)
    for key, ref in ref_state.items():
        assert state[key].dtype == torch.float64, key
        assert_tensors_close(state[key].detach(), ref, name=f"{name} {layout} {key}", rtol=1e-8, atol=1e-10)

    checkpoints = root / "out" / "run" / "checkpoints"
    if save_steps is None:
        assert not checkpoints.exists()  # the export did not need one
    else:  # the checkpoint of step 3 ('latest') exports to the same folder, in one process
        from merak_core.hf import export_checkpoint

        again = export_checkpoint(checkpoints / "latest", root / "out" / "from_checkpoint")
        assert (again / "tokenizer.json").is_file()  # from the pretrained folder the checkpoint recorded
        from_checkpoint, final = read_folder(again), read_folder(exported)
        assert sorted(from_checkpoint) == sorted(final)
        assert all(torch.equal(from_checkpoint[k], final[k]) for k in final)
        assert _files(again) == _files(exported) == ({"model.safetensors"}, None)  # one file, as merak export

    # (c) transformers' loss on the eval text equals Merak's eval loss (every rank reports the same).
    eval_losses = [r[2] for r in results]
    assert all(v == pytest.approx(eval_losses[0], rel=1e-12) for v in eval_losses)
    assert eval_losses[0] == pytest.approx(transformers_eval_loss(exported, text, folder), rel=1e-6)


def load_at_pp1_on_ranks(folder: str) -> dict[str, torch.Tensor] | None:
    """Rank body: a meta GPT-2 at tp=2, pp=1 (no tracing) loaded from the folder; the full state dict on rank 0."""
    import merak_core
    from merak_core.hf import PretrainedWeights, pretrained_model, skip_init
    from merak_core.parallel.compose import build_parallel_model, gather_full_state_dict

    layout = merak_core.init(dp=1, tp=2, pp=1)
    model = pretrained_model(folder)
    weights = PretrainedWeights.match(model, folder)
    pm = build_parallel_model(
        model, layout, example_inputs={"input_ids": torch.zeros(1, SEQ, dtype=torch.long)}, init_fn=skip_init
    )
    weights.load_into(pm)
    return gather_full_state_dict(pm)


def test_meta_model_at_pp1_loads_under_its_own_names() -> None:
    """At pp=1 TP and materialisation replace every parameter: a new one reusing the id of a freed original
    must not take that original's logical name (it did: c_attn's slice went to the MLP's c_fc)."""
    pytest.importorskip("transformers")
    root = Path(tempfile.mkdtemp(prefix="merak-pretrained-pp1-"))
    folder, _ = make_folder("gpt2", root)
    state = run_on_ranks(2, load_at_pp1_on_ranks, str(folder))[0]
    original = read_folder(folder)
    assert state is not None and sorted(state) == sorted(original)
    for key, ref in original.items():
        assert torch.equal(state[key], ref), key
