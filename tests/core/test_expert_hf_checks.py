"""Which transformers MoE models ep > 1 shards and which it refuses (pure: no process group).

transformers' Mixtral, Qwen3-MoE and DeepSeek-V3 blocks hold their experts as one fused module
(``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``): accepted, every fused module found (and the
families' other ``*Moe*`` modules, attention or norms, not mistaken for MoE blocks). Refused with the
fix: ep not dividing the experts, the model's own router
auxiliary loss (``output_router_logits``) at pp > 1 (merak_core.parallel.router_aux), and a fused module whose layout the EP forward does not
reproduce (transposed weights, biases). The job checks before torchrun (``merak train --dry-run``).
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import yaml

from tests.e2e._bad_input_support import dry_run_train

pytest.importorskip("transformers")
pytestmark = pytest.mark.transformers


def _args(**kw: object) -> SimpleNamespace:
    base: dict[str, object] = dict(ep=2, dp=2, tp=1, zero_stage=0, virtual_stages=1, cp=1, max_grad_norm=0.0)
    base.update(kw)
    return SimpleNamespace(**base)


def _tiny(family: str, **extra: Any) -> torch.nn.Module:
    import transformers as tf

    common: dict[str, Any] = dict(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_experts_per_tok=2,
        **extra,
    )
    if family == "mixtral":
        return tf.MixtralForCausalLM(tf.MixtralConfig(**common, num_local_experts=4))
    return tf.Qwen3MoeForCausalLM(
        tf.Qwen3MoeConfig(**common, head_dim=8, num_experts=4, moe_intermediate_size=8)
    )


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_transformers_moe_blocks_are_accepted(family: str) -> None:
    from merak_core.parallel.expert_parallel import check_ep_model
    from merak_core.parallel.fused_experts import check_fused_experts

    model = _tiny(family)
    check_ep_model(model, _args())
    assert check_fused_experts(model, _args()) == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]


@pytest.mark.parametrize(
    ("overrides", "extra", "words"),
    [
        ({"ep": 3, "dp": 3}, {}, r"ep=3 does not divide the 4 experts of 'model.layers.0.mlp.experts'"),
        (
            {"pp": 2},
            {"output_router_logits": True, "router_aux_loss_coef": 0.02},
            r"router auxiliary loss \(output_router_logits=True, router_aux_loss_coef=0.02\).*with pp=2 it cannot "
            r"\(the router logits of earlier stages' layers do not reach the loss\): set pp: 1",
        ),
    ],
)
def test_refusals(overrides: dict[str, object], extra: dict[str, Any], words: str) -> None:
    from merak_core.parallel.expert_parallel import check_ep_model

    with pytest.raises(ValueError, match=words):
        check_ep_model(_tiny("mixtral", **extra), _args(**overrides))


def test_refuses_the_aux_loss_of_a_family_it_does_not_reproduce() -> None:
    """A fused-experts model of another family with its own aux loss: Merak adds only the aux loss it computes
    exactly (Mixtral's and Qwen3-MoE's load_balancing_loss_func), so ep > 1 refuses it rather than drop it."""
    from merak_core.parallel.expert_parallel import check_ep_model

    model = _tiny("mixtral", output_router_logits=True, router_aux_loss_coef=0.02)
    model.config.model_type = "some_moe"
    with pytest.raises(ValueError, match=r"for mixtral, qwen3_moe only \(model_type 'some_moe'\)"):
        check_ep_model(model, _args())
    model.config.model_type = "mixtral"
    check_ep_model(model, _args())


@pytest.mark.parametrize(
    ("flag", "value", "words"), [("is_transposed", True, "transposed weights"), ("has_bias", True, "biases")]
)
def test_refuses_a_fused_layout_it_does_not_reproduce(flag: str, value: bool, words: str) -> None:
    from merak_core.parallel.expert_parallel import check_ep_model

    model = _tiny("mixtral")
    setattr(model.model.layers[1].mlp.experts, flag, value)
    with pytest.raises(
        ValueError, match=rf"MixtralExperts at 'model.layers.1.mlp.experts'.*{words}. Set ep: 1"
    ):
        check_ep_model(model, _args())


HERE = "tests.core.test_expert_hf_checks"


def build_mixtral() -> torch.nn.Module:
    return _tiny("mixtral")


def build_mixtral_aux() -> torch.nn.Module:
    return _tiny("mixtral", output_router_logits=True, router_aux_loss_coef=0.02)


class _Tokens(torch.utils.data.Dataset):
    def __init__(self) -> None:
        self.ids = torch.randint(0, 30, (16, 9), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i, :-1], "labels": self.ids[i, 1:]}


def tokens() -> Any:
    return _Tokens()


def _dry_run(tmp: Path, model: str, training: dict[str, Any]) -> tuple[int, str]:
    job = tmp / "job.yaml"
    training = {"output_dir": str(tmp / "out"), "per_device_train_batch_size": 2, "max_steps": 1, **training}
    spec = {
        "model": {"factory": f"{HERE}:{model}"},
        "data": {"factory": f"{HERE}:tokens"},
        "training": training,
    }
    job.write_text(yaml.safe_dump(spec))
    return dry_run_train(job, "--nproc-per-node", "2")


def test_job_checks_before_torchrun(tmp_path: Path) -> None:
    """A Mixtral job at ep=2 passes the checks before torchrun; its router aux loss at pp=2 is refused there."""
    from merak_core.run.exitcodes import BAD_INPUT

    status, err = _dry_run(tmp_path, "build_mixtral", {"ep": 2, "dp": 2})
    assert status == 0, err
    status, err = _dry_run(tmp_path, "build_mixtral_aux", {"pp": 2, "gradient_accumulation_steps": 2})
    assert status == BAD_INPUT, err
    assert "with pp=2 it cannot" in err and "set pp: 1, or output_router_logits: false" in err, err
