"""Make what the fine-tuning example starts from, with no download: a tiny GPT-2 folder and some text.

Writes, next to this file (or under ``--out``):

- ``text.txt``: a few thousand generated lines of a small artificial language (a word is
  followed by words of its class, so there is something to learn);
- ``tiny-gpt2/``: a BPE tokenizer trained on that text with the ``tokenizers`` package
  (``tokenizer.json``) and a small, randomly initialised GPT-2 of that vocabulary written with
  ``save_pretrained`` (``config.json``, ``model.safetensors``, ``generation_config.json``).

It stands in for a published checkpoint: ``config.yaml`` points ``model.pretrained`` at it.

Run: python examples/finetune/prepare.py [--out DIR] [--force]
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
SUBJECTS = ("the pipeline", "a stage", "every rank", "the model", "a shard", "the tensor", "the trainer")
VERBS = ("reads", "sends", "splits", "trains", "exports", "gathers", "loads")
OBJECTS = ("its slice", "the weights", "a microbatch", "the gradient", "the checkpoint", "one layer")
ENDS = ("in order.", "on time.", "without waiting.", "once.", "again.", "by name.")
VOCAB = 128
"""Tokenizer vocabulary (and model vocabulary): divisible by tp = 2."""


def write_text(path: Path, lines: int = 4000, seed: int = 0) -> None:
    rng = random.Random(seed)
    rows = [
        " ".join((rng.choice(SUBJECTS), rng.choice(VERBS), rng.choice(OBJECTS), rng.choice(ENDS)))
        for _ in range(lines)
    ]
    path.write_text("\n".join(rows) + "\n")


def write_tokenizer(text: Path, folder: Path) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train(
        [str(text)],
        trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<unk>", "<eos>"], show_progress=False),
    )
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        '{"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<eos>", "unk_token": "<unk>"}\n'
    )
    return int(tok.token_to_id("<eos>"))


def write_model(folder: Path, eos_id: int) -> None:
    import torch
    import transformers as tf

    torch.manual_seed(0)
    config = tf.GPT2Config(
        vocab_size=VOCAB,
        n_embd=64,
        n_layer=4,
        n_head=4,
        n_positions=128,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        use_cache=False,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
    )
    tf.GPT2LMHeadModel(config).save_pretrained(str(folder))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(HERE), help="where to write text.txt and tiny-gpt2/")
    parser.add_argument("--force", action="store_true", help="write again even if the files exist")
    args = parser.parse_args()
    out = Path(args.out)
    text, folder = out / "text.txt", out / "tiny-gpt2"
    if not args.force and text.is_file() and (folder / "model.safetensors").is_file():
        print(f"{folder} and {text} exist (use --force to write them again)")
        return
    out.mkdir(parents=True, exist_ok=True)
    write_text(text)
    eos_id = write_tokenizer(text, folder)
    write_model(folder, eos_id)
    print(f"wrote {text} and {folder} (GPT-2, vocabulary {VOCAB}, 4 layers, width 64)")


if __name__ == "__main__":
    main()
