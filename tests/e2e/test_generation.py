"""Generation on the training layout against transformers' own ``generate`` (float64 tiny models).

A tiny GPT-2 (tied embeddings, Conv1D, fused q/k/v) and Llama (grouped-query attention) are saved
with ``save_pretrained``; Merak starts from the folder at tp2, pp2 (two microbatches) and tp2·pp2
and decodes a batch of left-padded prompts of different lengths (Llama also at dp2·pp2: two replicas). Greedy decoding must give exactly
the tokens of ``AutoModelForCausalLM.from_pretrained(folder).generate(do_sample=False)``, with an
EOS (chosen from the reference's own output) that ends one row early and pads it. Seeded sampling
must give the same tokens on every rank, the same again on a second call, and the tokens of the
same sampler run on the single-process model (``merak_core.generation.decode`` at pp=1).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from tests.e2e._pretrained_support import VOCAB, Blocks, lm_loss, make_folder, token_stream
from tests.e2e._trainer_support import make_args
from tests.support.dist import run_on_ranks

pytestmark = pytest.mark.transformers

LENGTHS = [5, 3, 7, 2]
PAD = 0
NEW = 6
SAMPLING = dict(do_sample=True, temperature=1.5, top_k=20, top_p=0.95, seed=5)


def _prompts() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    width = max(LENGTHS)
    ids = torch.full((len(LENGTHS), width), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(LENGTHS):
        ids[row, width - n :] = torch.randint(1, VOCAB, (n,), generator=gen)
        mask[row, width - n :] = 1
    return ids, mask


def _reference(folder: Path) -> Any:
    import transformers as tf

    return tf.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float64).eval()


def _hf_greedy(model: Any, eos: int | None) -> torch.Tensor:
    ids, mask = _prompts()
    with torch.no_grad():
        return model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=NEW,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=PAD,
            use_cache=True,
        )


def _eos_ending_one_row(model: Any) -> int:
    """A token that some row emits before its last new token (so it ends early) and some row never emits."""
    free = _hf_greedy(model, None)[:, max(LENGTHS) :].tolist()
    for row, tokens in enumerate(free):
        for j in range(NEW - 1):
            token = tokens[j]
            if token not in tokens[:j] and any(
                token not in other for r, other in enumerate(free) if r != row
            ):
                return token
    raise AssertionError(f"no token ends exactly some rows early in {free}: change the prompts' seed")


def _sampled_reference(model: Any) -> torch.Tensor:
    """The same sampler on the single-process model (the pp=1 decoding loop around the plain model)."""
    from merak_core.generation.decode import _decode_loop
    from merak_core.generation.decoders import WholeModelDecoder
    from merak_core.generation.sampling import SamplingOptions, row_generators

    ids, mask = _prompts()
    opts = SamplingOptions(**SAMPLING)
    decoder = WholeModelDecoder(model, model.config, model.config.vocab_size)
    gens = row_generators(opts.seed, ids.shape[0], torch.device("cpu"))
    fake = SimpleNamespace(layout=SimpleNamespace(pp=1))
    with torch.no_grad():
        return _decode_loop(fake, decoder, ids, mask, [slice(0, ids.shape[0])], opts, gens, [], PAD, NEW)


def generate_on_ranks(
    folder: str,
    text: str,
    layout: dict[str, int],
    eos: int,
    microbatches: int = 2,
) -> dict[str, Any]:
    """Rank body: a Trainer from the folder at ``layout`` (``microbatches`` under pp); greedy with ``eos``,
    then seeded sampling twice."""
    from merak_core import Trainer

    args = make_args(
        **layout, gradient_accumulation_steps=microbatches, output_dir=tempfile.mkdtemp(prefix="merak-gen-")
    )
    data = Blocks(token_stream(Path(text), Path(folder) / "tokenizer.json"), count=8)
    trainer = Trainer(None, args, data, loss_fn=lm_loss, pretrained=folder)
    ids, mask = _prompts()
    greedy = trainer.generate(ids, mask, max_new_tokens=NEW, eos_token_id=eos, pad_token_id=PAD)
    sampled = [
        trainer.generate(ids, mask, max_new_tokens=NEW, pad_token_id=PAD, **SAMPLING) for _ in range(2)
    ]
    return {"greedy": greedy.tolist(), "sampled": [s.tolist() for s in sampled]}


LAYOUTS = {
    "tp2": dict(dp=1, tp=2, pp=1),
    "pp2": dict(dp=1, tp=1, pp=2),
    "tp2pp2": dict(dp=1, tp=2, pp=2),
    "dp2pp2": dict(dp=2, tp=1, pp=2),
    "pp2-4mb": dict(dp=1, tp=1, pp=2),
}
CASES = [(name, layout) for name in ("gpt2", "llama") for layout in ("tp2", "pp2", "tp2pp2")]
CASES.append(("llama", "dp2pp2"))  # data-parallel replicas decode the same batch, each through its pipeline
# One row per microbatch: the row that meets EOS ends its microbatch early, which stops on every stage
# (the end marker of [Note: decoding under pipeline parallelism]) while the others go on.
CASES.append(("llama", "pp2-4mb"))


@pytest.mark.parametrize(("name", "layout"), CASES, ids=[f"{n}-{lay}" for n, lay in CASES])
def test_generation_equals_transformers(name: str, layout: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        folder, text = make_folder(name, tmp)
        model = _reference(folder)
        eos = _eos_ending_one_row(model)
        expected = _hf_greedy(model, eos)
        ended = (expected[:, -1] == PAD).tolist()
        assert any(ended) and not all(ended) and expected.shape[1] == max(LENGTHS) + NEW, expected
        sampled_ref = _sampled_reference(model)
        kwargs = LAYOUTS[layout]
        world = kwargs["dp"] * kwargs["tp"] * kwargs["pp"]
        microbatches = 4 if layout.endswith("4mb") else 2
        results = run_on_ranks(world, generate_on_ranks, str(folder), str(text), kwargs, eos, microbatches)
    for rank, result in enumerate(results):
        assert result["greedy"] == expected.tolist(), f"rank {rank}"
        assert result["sampled"][0] == result["sampled"][1], (
            f"rank {rank}: seeded sampling is not reproducible"
        )
        assert result["sampled"][0] == results[0]["sampled"][0], (
            f"rank {rank} sampled other tokens than rank 0"
        )
        assert result["sampled"][0] == sampled_ref.tolist(), f"rank {rank}"


def _eos_ending_every_row(model: Any) -> list[int]:
    """EOS tokens that end every row before its last new token, mostly at different steps: the token that
    row ``r`` emits at step ``min(r, NEW - 2)`` without EOS (a row may meet another row's token earlier)."""
    free = _hf_greedy(model, None)[:, max(LENGTHS) :].tolist()
    return sorted({tokens[min(r, NEW - 2)] for r, tokens in enumerate(free)})


def _deeper_llama(folder: Path, layers: int) -> None:
    """Replace the folder's model by a Llama with ``layers`` decoder layers (the tokenizer stays)."""
    import transformers as tf

    config = tf.LlamaConfig.from_pretrained(str(folder))
    config.num_hidden_layers = layers
    torch.manual_seed(0)
    tf.LlamaForCausalLM(config).double().save_pretrained(str(folder))


def generate_pp4_on_ranks(folder: str, eos: list[int]) -> list[list[int]]:
    """Rank body: the folder's 4-layer Llama composed at pp=4, one decoder layer per stage (the cut at each
    layer), greedy decoding of the prompts in 4 microbatches (one row each)."""
    import merak_core
    from merak_core.hf import PretrainedWeights, pretrained_model, skip_init
    from merak_core.parallel.compose import build_parallel_model

    layout = merak_core.init(dp=1, tp=1, pp=4)
    model = pretrained_model(folder, dtype=torch.float64)
    weights = PretrainedWeights.match(model, folder)
    pm = build_parallel_model(
        model,
        layout,
        example_inputs={"input_ids": torch.zeros(1, max(LENGTHS), dtype=torch.long)},
        init_fn=skip_init,
        split_points=[f"model.layers.{i}" for i in (1, 2, 3)],
    )
    weights.load_into(pm)
    ids, mask = _prompts()
    out = merak_core.generate(
        pm, ids, mask, max_new_tokens=NEW, eos_token_id=eos, pad_token_id=PAD, num_microbatches=4
    )
    return out.tolist()


def test_pipelined_decoding_stops_early_through_middle_stages() -> None:
    """pp=4, one row per microbatch, an EOS set that ends every row early at different steps: each
    microbatch's end marker passes through the two middle stages ([Note: decoding under pipeline
    parallelism]), decoding stops before max_new_tokens, and the tokens equal transformers' greedy
    generate (shorter than prompt + max_new_tokens, pads after each row's end)."""
    with tempfile.TemporaryDirectory() as tmp:
        folder, _text = make_folder("llama", tmp)
        _deeper_llama(folder, 4)
        model = _reference(folder)
        eos = _eos_ending_every_row(model)
        expected = _hf_greedy(model, eos)
        new = expected[:, max(LENGTHS) :].tolist()
        ends = [next(j for j, tok in enumerate(row) if tok in eos) for row in new]
        assert expected.shape[1] < max(LENGTHS) + NEW and len(set(ends)) > 1, (expected, ends)
        results = run_on_ranks(4, generate_pp4_on_ranks, str(folder), eos)
    for rank, result in enumerate(results):
        assert result == expected.tolist(), f"rank {rank}"


def refusal_on_ranks(folder: str) -> str:
    """Rank body: the 2-layer Llama at pp=3 cut inside layer 1 (stage 0 holds layer 0 whole, stages 1 and 2
    half of layer 1 each); the refusal generation raises on this rank."""
    import merak_core
    from merak_core.hf import PretrainedWeights, pretrained_model, skip_init
    from merak_core.parallel.compose import build_parallel_model

    layout = merak_core.init(dp=1, tp=1, pp=3)
    model = pretrained_model(folder, dtype=torch.float64)
    weights = PretrainedWeights.match(model, folder)
    pm = build_parallel_model(
        model,
        layout,
        example_inputs={"input_ids": torch.zeros(1, max(LENGTHS), dtype=torch.long)},
        init_fn=skip_init,
        split_points=["model.layers.1", "model.layers.1.mlp"],
    )
    weights.load_into(pm)
    ids, mask = _prompts()
    try:
        merak_core.generate(pm, ids, mask, max_new_tokens=2, pad_token_id=PAD)
    except ValueError as exc:
        return str(exc)
    return "no refusal"


def test_a_stage_that_refuses_alone_stops_every_rank() -> None:
    """Stage 0 could decode, stages 1 and 2 cannot (a cut inside a decoder layer): every rank raises the
    refusal before the first pipeline message (stage 0 waited for its peers until the timeout before)."""
    with tempfile.TemporaryDirectory() as tmp:
        folder, _text = make_folder("llama", tmp)
        messages = run_on_ranks(3, refusal_on_ranks, str(folder))
    assert messages[0].startswith("pipeline stage 1 refuses generation: this pipeline stage does not hold")
    assert all("the stage cut falls inside a decoder layer" in m for m in messages), messages
