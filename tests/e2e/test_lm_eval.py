"""The lm-evaluation-harness model ``merak`` at dp1·tp2·pp2 against lm-eval's ``hf`` model and transformers.

A tiny Llama folder (GQA, a tokenizer with ``<unk>`` as its end-of-sequence token) is loaded by a
float32 Trainer at tp2·pp2 (in-pool ranks), which exports it as a Hugging Face folder
(``export_hf``) and is wrapped as ``MerakLM``. A multiple-choice task written here (a JSONL file and
a task YAML registered through ``TaskManager(include_path=...)``, no download) is scored by
``lm_eval.simple_evaluate`` with the ``merak`` model on the ranks and with lm-eval's ``hf`` model on
the exported folder here: the accuracy and every choice's (log-likelihood, greedy) agree. The
``loglikelihood``, ``loglikelihood_rolling`` and ``generate_until`` requests equal transformers'
float32 log-softmax of the same tokens (1e-6 relative) and greedy ``generate``.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.e2e._pretrained_support import Blocks, lm_loss, make_folder, token_stream
from tests.e2e._trainer_support import make_args
from tests.support.dist import run_on_ranks

pytestmark = pytest.mark.transformers

lm_eval = pytest.importorskip("lm_eval")

TASK = "merak_tiny_mc"
DOCS = [
    {"question": "every rank reads", "choices": [" its own shard", " the model", " a tensor"], "answer": 0},
    {"question": "the pipeline of", "choices": [" every stage", " and to", " merak export"], "answer": 2},
    {"question": "train a", "choices": [" model", " slice of the token"], "answer": 1},
    {"question": "shard the", "choices": [" tensor", " rank", " own"], "answer": 0},
]
PAIRS = [("the model reads", " its own tensor"), ("a", " shard of every stage")]
ROLLING = "merak reads every token of the pipeline and the tensor of its own rank."
GEN_CONTEXT = "every rank reads its"
GEN_KWARGS = {"until": ["."], "max_gen_toks": 6, "do_sample": False}


def _write_task(root: Path) -> Path:
    folder = root / "tasks"
    folder.mkdir()
    (folder / "docs.jsonl").write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    (folder / f"{TASK}.yaml").write_text(
        f"task: {TASK}\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {folder / 'docs.jsonl'}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        'doc_to_text: "{{question}}"\n'
        'doc_to_choice: "{{choices}}"\n'
        'doc_to_target: "{{answer}}"\n'
        "metric_list:\n  - metric: acc\n"
    )
    return folder


def _evaluate(model: Any, task_dir: str) -> dict[str, Any]:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    out = simple_evaluate(
        model=model,
        tasks=[TASK],
        task_manager=TaskManager(include_path=task_dir, include_defaults=False),
        log_samples=True,
    )
    assert out is not None
    samples = sorted(out["samples"][TASK], key=lambda s: s["doc_id"])
    return {
        "acc": out["results"][TASK]["acc,none"],
        "resps": [[(float(r[0][0]), bool(r[0][1])) for r in s["resps"]] for s in samples],
    }


def score_on_ranks(folder: str, text: str, task_dir: str, export_dir: str) -> dict[str, Any]:
    """Rank body: a float32 Trainer from the folder at tp2·pp2, exported, then scored as ``merak``."""
    from lm_eval.api.instance import Instance

    from merak_core import Trainer
    from merak_core.cli.lm_eval_model import MerakLM
    from merak_core.hf import export_hf

    args = make_args(dp=1, tp=2, pp=2, dtype="float32", output_dir=tempfile.mkdtemp(prefix="merak-lm-eval-"))
    data = Blocks(token_stream(Path(text), Path(folder) / "tokenizer.json"), count=8)
    trainer = Trainer(None, args, data, loss_fn=lm_loss, pretrained=folder)
    export_hf(trainer.checkpoint_parts, export_dir)
    lm = MerakLM(trainer=trainer, batch_size=3)  # the tokenizer: the pretrained folder's
    result = _evaluate(lm, task_dir)
    result["pairs"] = lm.loglikelihood([Instance("loglikelihood", {}, p, i) for i, p in enumerate(PAIRS)])
    result["rolling"] = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (ROLLING,), 0)])
    result["generated"] = lm.generate_until([Instance("generate_until", {}, (GEN_CONTEXT, GEN_KWARGS), 0)])
    return result


def _log_softmax_sum(model: Any, ids: list[int], first_target: int) -> float:
    """Transformers (float32): sum of log p(ids[j] | ids[:j]) for j >= first_target."""
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids[:-1]])).logits[0].float(), dim=-1)
    targets = torch.tensor(ids[1:])
    return float(logp.gather(-1, targets[:, None])[first_target - 1 :].sum())


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-6 * max(abs(a), abs(b))


def test_merak_model_scores_as_hf_model_and_transformers() -> None:
    import transformers as tf
    from lm_eval.models.huggingface import HFLM
    from tokenizers import Tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        folder, text = make_folder("llama", root)
        (folder / "tokenizer_config.json").write_text(
            json.dumps({"eos_token": "<unk>", "unk_token": "<unk>", "pad_token": "<unk>"})
        )
        task_dir = _write_task(root)
        export = root / "export"
        merak = run_on_ranks(
            4, score_on_ranks, str(folder), str(text), str(task_dir), str(export), timeout_s=900
        )
        assert all(r == merak[0] for r in merak[1:]), "the ranks disagree"
        merak_result = merak[0]
        reference = HFLM(pretrained=str(export), dtype="float32", batch_size=3, device="cpu")
        hf_result = _evaluate(reference, str(task_dir))
        model = tf.AutoModelForCausalLM.from_pretrained(str(export), dtype=torch.float32).eval()
        tok = Tokenizer.from_file(str(export / "tokenizer.json"))
    assert merak_result["acc"] == hf_result["acc"]
    for ours, theirs in zip(merak_result["resps"], hf_result["resps"], strict=True):
        assert [g for _, g in ours] == [g for _, g in theirs]
        assert all(_close(a, b) for (a, _), (b, _) in zip(ours, theirs, strict=True)), (ours, theirs)
    for (context, continuation), (logprob, _) in zip(PAIRS, merak_result["pairs"], strict=True):
        whole = tok.encode(context + continuation).ids
        assert _close(logprob, _log_softmax_sum(model, whole, len(tok.encode(context).ids))), (
            logprob,
            context,
        )
    eos = model.config.eos_token_id
    rolling_ids = [eos, *tok.encode(ROLLING).ids]
    assert _close(merak_result["rolling"][0], _log_softmax_sum(model, rolling_ids, 1))
    context_ids = torch.tensor([tok.encode(GEN_CONTEXT).ids])
    with torch.no_grad():
        out = model.generate(
            input_ids=context_ids,
            attention_mask=torch.ones_like(context_ids),
            max_new_tokens=GEN_KWARGS["max_gen_toks"],
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=eos,
        )
    new = out[0, context_ids.shape[1] :].tolist()
    expected = tok.decode(new[: new.index(eos)] if eos in new else new, skip_special_tokens=True)
    assert merak_result["generated"] == [expected.split(".")[0]]
