"""``model: {pretrained: DIR}`` at tp=2 for every transformers family with a built-in TP plan.

A tiny random float64 model of each family (``tests/tp/_hf_families.py``) is saved with
``save_pretrained``; on two ranks the Trainer builds it on the meta device from the folder
(``Trainer(None, ..., pretrained=DIR)``, the job file's ``model: {pretrained: DIR}``), shards it
at dp1 x tp2 x pp1 and loads each rank's slices. Checked against transformers itself:

- the first step's loss equals transformers' own loss (``model(input_ids, labels=...)``, labels
  shifted inside the model for causal LMs) of ``from_pretrained(DIR)`` on the same batch
  (transformers computes its loss in float32, hence the tolerance);
- every parameter's gradient of that step (unclipped, gathered over TP) equals the gradient of
  the same loss of ``from_pretrained(DIR)`` in one process (float64; float32 tolerances for the
  families that compute their norms or router in float32).

The loss must not depend on the way in: the buffers a constructor computes (Gemma's embedding
scale, rotary tables) are not in the folder, and a TP layer that replaces a module must still get
them (issue 24: Gemma's scale was left as uninitialised memory at tp=2).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import Dataset

from merak_tp.shard_spec import get_shard_spec
from tests.e2e._trainer_support import make_args, reference_microbatches
from tests.support.compare import assert_tensors_close
from tests.support.dist import run_on_ranks

pytest.importorskip("transformers")

from tests.tp import _hf_families as F  # noqa: E402

pytestmark = pytest.mark.transformers

SEQ = 8
MASKED_LM = ("bert",)
"""Families whose head predicts the token at its own position (labels are not shifted)."""


class Batches(Dataset):
    """Random token sequences (ids from 3 up: no pad/bos/eos) with the family's labels.

    Causal LMs: the next token, the last position ignored (-100), which is what transformers'
    ``labels=input_ids`` computes. Masked LMs: random targets at the positions, a few ignored.
    """

    def __init__(self, name: str, size: int = 8, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(3, F.VOCAB, (size, SEQ), generator=g)
        if name in MASKED_LM:
            self.labels = torch.randint(3, F.VOCAB, (size, SEQ), generator=g)
            self.labels[:, ::3] = -100
        else:
            self.labels = torch.cat([self.ids[:, 1:], torch.full((size, 1), -100)], dim=1)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i].clone(), "labels": self.labels[i].clone()}


def lm_loss(output: Any, labels: torch.Tensor) -> torch.Tensor:
    logits = getattr(output, "logits", output)
    if isinstance(logits, (tuple, list)):
        logits = logits[0]
    return torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.size(-1)), labels.reshape(-1), ignore_index=-100
    )


ARGS = dict(dp=1, tp=2, pp=1, gradient_accumulation_steps=1, max_steps=1, max_grad_norm=0.0)
"""One step, unclipped: the gradients the Trainer leaves on its parameters are the batch's own."""


def pretrained_on_ranks(name: str, folder: str, pp: int = 1, **extra: Any) -> tuple[float, Any]:
    """Rank body: the Trainer from the folder at tp=2, one step; (loss, (this stage's full gradients,
    transposed names))."""
    import merak_tp
    from merak_core import Trainer

    args = make_args(**{**ARGS, "pp": pp, "gradient_accumulation_steps": pp, **extra})
    trainer = Trainer(None, args, Batches(name), loss_fn=lm_loss, pretrained=folder)
    (loss,) = [h["loss"] for h in trainer.train() if "loss" in h]
    grads, transposed = {}, set()
    for pname, p in trainer.model.named_parameters():
        assert p.grad is not None, f"{pname} has no gradient"
        grads[pname] = merak_tp.gather_tensor(p.grad, like=p, group=trainer.layout.tp_group)
        if get_shard_spec(p).transposed:
            transposed.add(pname)
    return loss, (grads, transposed)


def first_batch(name: str) -> dict[str, torch.Tensor]:
    data = Batches(name)
    first = reference_microbatches(len(data), make_args(**ARGS), 1)[0][0]
    return torch.utils.data.default_collate([data[i] for i in first])


def transformers_model(name: str, folder: Path) -> torch.nn.Module:
    import transformers as tf

    auto = tf.AutoModelForMaskedLM if name in MASKED_LM else tf.AutoModelForCausalLM
    return auto.from_pretrained(str(folder), dtype=torch.float64)  # type: ignore[no-any-return]


def transformers_loss(name: str, folder: Path) -> float:
    """transformers' own loss of ``from_pretrained(folder)`` on the Trainer's batch (causal LMs shift inside:
    their labels are the inputs themselves)."""
    batch = first_batch(name)
    labels = batch["labels"] if name in MASKED_LM else batch["input_ids"]
    with torch.no_grad():
        return float(transformers_model(name, folder)(input_ids=batch["input_ids"], labels=labels).loss)


def reference_grads(name: str, folder: Path) -> dict[str, torch.Tensor]:
    """Every parameter's gradient of the same loss in one process from ``from_pretrained(folder)`` (float64)."""
    model = transformers_model(name, folder)
    model.train()
    batch = first_batch(name)
    lm_loss(model(input_ids=batch["input_ids"]), batch["labels"]).backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


MERGED = ("mixtral", "qwen3_moe")
"""Families whose tensors ``save_pretrained`` writes in a legacy layout that transformers merges on load
(the experts one by one): refused, so their folders are saved under the model's own names. GPT-NeoX's
legacy folder (the head as ``embed_out``, a rename) is loaded as transformers writes it."""


def save_family(name: str) -> Path:
    """The family's folder; mixture-of-experts configs name their (float64-capable) eager experts."""
    folder = Path(tempfile.mkdtemp(prefix=f"merak-pretrained-{name}-"))
    F.build_family(name).save_pretrained(str(folder), save_original_format=name not in MERGED)
    if name in F.MOE:  # transformers does not save the choice: its default kernel takes no float64
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, "experts_implementation": "eager"}))
    return folder


@pytest.mark.parametrize(
    ("name", "extra"),
    [
        *((name, {}) for name in F.FAMILIES),
        # the regions' sums of sequence-sharded gradients are hooks on the (meta) parameters too
        ("gemma3_text", {"sequence_parallel": True, "overlap_chunks": 2}),
    ],
    ids=[*F.FAMILIES, "gemma3_text-sp-overlap"],
)
def test_pretrained_folder_at_tp2_equals_transformers(name: str, extra: dict[str, Any]) -> None:
    folder = save_family(name)
    loss, (grads, transposed) = run_on_ranks(2, pretrained_on_ranks, name, str(folder), 1, **extra)[0]

    assert loss == pytest.approx(transformers_loss(name, folder), rel=1e-6)
    ref = reference_grads(name, folder)
    assert sorted(grads) == sorted(ref)
    tol = F.tolerance(name)
    for key, expected in ref.items():
        value = grads[key].t() if key in transposed else grads[key]
        assert_tensors_close(
            value,
            expected,
            name=f"{name} grad {key}",
            rtol=tol.get("rtol", 1e-8),
            atol=tol.get("atol", 1e-10),
        )


@pytest.mark.parametrize("name", MERGED)
def test_legacy_layout_is_refused_with_the_way_to_save_it(name: str) -> None:
    """Not merged yet: refused before any process group, naming the conversion and the save that avoids it."""
    from merak_core.hf import PretrainedWeights, pretrained_model

    folder = Path(tempfile.mkdtemp(prefix=f"merak-legacy-{name}-"))
    F.build_family(name).save_pretrained(str(folder))
    model = pretrained_model(folder, dtype=torch.float64)
    with pytest.raises(
        ValueError, match=r"lacks .*transformers converts the tensors of .*save_original_format=False"
    ):
        PretrainedWeights.match(model, folder)


def test_pretrained_gemma3_at_tp2_pp2() -> None:
    """Traced stages built alone from the meta model: the embedding scale (a stage's buffer taken from the
    TP layer of the model) and the per-head norms' gradient sums (hooks on the stage's copies) hold too."""
    name = "gemma3_text"
    folder = save_family(name)
    results = run_on_ranks(4, pretrained_on_ranks, name, str(folder), 2)
    args = make_args(**{**ARGS, "gradient_accumulation_steps": 2})
    first = reference_microbatches(len(Batches(name)), args, 1)[0]
    ref = {}
    for chunk in first:  # two microbatches, each loss halved as the pipeline averages them
        model = transformers_model(name, folder)
        batch = torch.utils.data.default_collate([Batches(name)[i] for i in chunk])
        (lm_loss(model(input_ids=batch["input_ids"]), batch["labels"]) / 2).backward()
        for n, p in model.named_parameters():
            ref[n] = ref.get(n, 0) + p.grad.detach()
    grads = {k: v for _, (g, _) in results for k, v in g.items()}
    assert sorted(grads) == sorted(ref)
    for key, expected in ref.items():
        assert_tensors_close(grads[key], expected, name=f"tp2 pp2 grad {key}", **F.tolerance(name))
