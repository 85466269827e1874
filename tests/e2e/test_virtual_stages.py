"""Virtual pipeline stages in the Trainer: pp * v stages, v per rank, train exactly like one process.

Interleaved-1F1B (stage s on pipeline rank s % pp) and ZB-V (a V: rank r holds stages r and
2pp - 1 - r, so the tied GPT embedding of stages 0 and 2pp - 1 is one local parameter of rank 0)
with v = 2 at pp = 2 and pp = 4, for both reference models with pp * v layers: 3 steps in float64,
the losses and every parameter by name equal the single-process run. A run with v = 2 saved at
step 2 and resumed by a fresh Trainer equals the uninterrupted run bit for bit. Settings the
Trainer cannot run (a schedule with one stage per rank, fewer layers than stages) are refused
before any step with the value, the expectation and the fix. Blocks kept in an ``nn.ModuleDict``
(torchtitan's Llama, nanoGPT variants keyed by ``str(i)``) count as layers like an ``nn.ModuleList``'s.
"""

from __future__ import annotations

import tempfile
from typing import Any

import pytest
import torch

from tests.e2e._trainer_support import TokenDataset, make_args, reference_steps
from tests.support.compare import assert_tensors_close
from tests.support.dist import run_on_ranks
from tests.support.models import GPT, REFERENCE_MODELS, DecoderConfig, Llama


class KeyedGPT(GPT):
    """The reference GPT with its blocks in an ``nn.ModuleDict`` keyed by ``str(i)`` (torchtitan's layout):
    the same parameters, names and initial values as :class:`GPT`."""

    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__(cfg)
        self.blocks = torch.nn.ModuleDict({str(i): block for i, block in enumerate(self.blocks)})

    def forward(self, input_ids_bt: torch.Tensor) -> torch.Tensor:
        pos_t = torch.arange(input_ids_bt.size(1), device=input_ids_bt.device)
        x_bth = self.drop(self.wte(input_ids_bt) + self.wpe(pos_t))
        for block in self.blocks.values():
            x_bth = block(x_bth)
        return self.lm_head(self.ln_f(x_bth))


def build(name: str, layers: int) -> torch.nn.Module:
    torch.manual_seed(0)
    if name == "keyed_gpt":
        return KeyedGPT(DecoderConfig(num_layers=layers)).double()
    if name == "llama":
        return Llama(DecoderConfig(num_heads=8, num_kv_heads=4, num_layers=layers)).double()
    return GPT(DecoderConfig(num_layers=layers)).double()


def train_body(name: str, layers: int, kwargs: dict[str, Any]) -> tuple[list[float], Any, list[int]]:
    import torch.distributed as dist

    from merak_core import Trainer

    args = make_args(**kwargs)
    model = build(name, layers)
    loss = REFERENCE_MODELS["gpt" if name == "keyed_gpt" else name].loss
    trainer = Trainer(model, args, TokenDataset(64, model.config.vocab_size), loss_fn=loss)
    history = trainer.train()
    state = trainer.full_state_dict()
    stages = sorted(trainer.model.stage_modules)
    return [h["loss"] for h in history], state if dist.get_rank() == 0 else None, stages


def _reference(name: str, layers: int, kwargs: dict[str, Any]) -> tuple[list[float], dict[str, torch.Tensor]]:
    args = make_args(**kwargs)
    model = build(name, layers)
    data = TokenDataset(64, model.config.vocab_size)
    loss = REFERENCE_MODELS["gpt" if name == "keyed_gpt" else name].loss
    losses = reference_steps(
        model, data, args, kwargs.get("dp", 1), lambda batch: loss(model(batch["input_ids"]), batch["labels"])
    )
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


CASES = [
    ("gpt", "interleaved_1f1b", 2),
    ("llama", "zb_v", 2),
    ("gpt", "zb_v", 4),
    ("llama", "interleaved_1f1b", 4),
    ("keyed_gpt", "interleaved_1f1b", 2),  # blocks in an nn.ModuleDict
]


@pytest.mark.parametrize(("name", "schedule", "pp"), CASES, ids=lambda v: str(v))
def test_virtual_stages_match_single_process(name: str, schedule: str, pp: int) -> None:
    layers = 2 * pp
    kwargs = {
        "pp": pp,
        "schedule": schedule,
        "virtual_stages": 2,
        "gradient_accumulation_steps": pp,
        "per_device_train_batch_size": 1,
    }
    results = run_on_ranks(pp, train_body, name, layers, kwargs)
    ref_losses, ref_state = _reference(name, layers, kwargs)
    losses, state, _ = results[0]
    placement = [r[2] for r in results]
    if schedule == "zb_v":
        assert placement[0] == [0, 2 * pp - 1]  # the V: first and last stage on rank 0
    else:
        assert placement[0] == [0, pp]  # round-robin
    for rank, (other, _, _) in enumerate(results):
        assert other == pytest.approx(losses, rel=1e-12), f"rank {rank} reports other losses"
    assert losses == pytest.approx(ref_losses, rel=1e-9, abs=1e-12)
    assert sorted(state) == sorted(ref_state)
    for key, ref in ref_state.items():
        assert_tensors_close(
            state[key], ref, name=f"{name} {schedule} pp{pp} v2 param {key}", rtol=1e-8, atol=1e-10
        )


def resume_body(kwargs: dict[str, Any], out: str) -> tuple[dict[int, float], dict[int, float], Any, Any]:
    import torch.distributed as dist

    from merak_core import Trainer

    def trainer(**extra: Any) -> Any:
        model = build("gpt", 4)
        args = make_args(**{**kwargs, "output_dir": out, **extra})
        return Trainer(
            model, args, TokenDataset(64, model.config.vocab_size), loss_fn=REFERENCE_MODELS["gpt"].loss
        )

    whole = trainer()
    full = {int(h["step"]): h["loss"] for h in whole.train()}
    state = whole.full_state_dict()
    dist.barrier()
    again = trainer()
    again.resume("step_2")
    resumed = {int(h["step"]): h["loss"] for h in again.train()}
    state2 = again.full_state_dict()
    return full, resumed, state if dist.get_rank() == 0 else None, state2 if dist.get_rank() == 0 else None


@pytest.mark.parametrize("schedule", ["zb_v"])
def test_virtual_stages_resume_bit_identical(schedule: str) -> None:
    kwargs = {
        "pp": 2,
        "schedule": schedule,
        "virtual_stages": 2,
        "gradient_accumulation_steps": 2,
        "per_device_train_batch_size": 1,
        "max_steps": 4,
        "save_steps": 2,
        "lr_scheduler_type": "cosine",
    }
    full, resumed, state, state2 = run_on_ranks(2, resume_body, kwargs, tempfile.mkdtemp(prefix="merak-v-"))[
        0
    ]
    assert sorted(resumed) == [3, 4]
    assert [resumed[k] for k in (3, 4)] == [full[k] for k in (3, 4)]
    assert sorted(state) == sorted(state2)
    assert [k for k in state if not torch.equal(state[k], state2[k])] == []


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (
            {"pp": 2, "schedule": "1f1b", "virtual_stages": 2},
            "runs 1 stage\\(s\\) per pipeline rank but virtual_stages=2",
        ),
        ({"pp": 2, "schedule": "zb_v", "virtual_stages": 3}, "set virtual_stages=2"),
    ],
)
def test_unsupported_virtual_stages_are_refused_in_the_arguments(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make_args(**kwargs)


def too_few_layers_body() -> str:
    from merak_core import Trainer

    model = build("gpt", 2)
    args = make_args(pp=2, schedule="interleaved_1f1b", virtual_stages=4, gradient_accumulation_steps=2)
    try:
        Trainer(model, args, TokenDataset(16, model.config.vocab_size), loss_fn=REFERENCE_MODELS["gpt"].loss)
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_fewer_layers_than_stages_is_refused_before_any_step() -> None:
    message = run_on_ranks(2, too_few_layers_body)[0]
    assert "2 layers" in message and "pp * virtual_stages = 8" in message, message


def test_blocks_in_a_module_dict_are_counted() -> None:
    """torchtitan keeps its blocks in ``layers: nn.ModuleDict`` keyed by ``str(i)``; nanoGPT's ``transformer``
    dict of named parts holds a block list: the blocks are counted, never the named parts."""
    from merak_core.parallel.virtual_stages import block_count, check_layer_count

    keyed = build("keyed_gpt", 4)
    assert block_count(keyed) == 4
    check_layer_count(keyed, 2, 2)  # 4 stages, 4 blocks
    with pytest.raises(ValueError, match="but it has 4 layers"):
        check_layer_count(keyed, 2, 4)

    class NanoGPT(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            cfg = DecoderConfig(num_layers=2)
            self.transformer = torch.nn.ModuleDict(
                dict(
                    wte=torch.nn.Embedding(cfg.vocab_size, cfg.hidden_size),
                    wpe=torch.nn.Embedding(cfg.max_seq_len, cfg.hidden_size),
                    drop=torch.nn.Dropout(0.0),
                    h=torch.nn.ModuleList(GPT(cfg).blocks),
                    ln_f=torch.nn.LayerNorm(cfg.hidden_size),
                )
            )

    assert block_count(NanoGPT()) == 2
