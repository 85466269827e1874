"""``merak check`` on a model too big to check whole: the same family with a tiny config.

The tiny config keeps the family (class, ``model_type``, the architecture flags) and
the shape of its attention (grouped-query stays grouped-query, multi-query stays
multi-query); the check on it reports per module the largest difference and flags a
wrong plan exactly as the whole-model check does. Marked ``transformers``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

from tests.tp import _hf_families as F  # noqa: E402

pytestmark = pytest.mark.transformers


@pytest.fixture(scope="module")
def full_configs() -> dict[str, object]:
    """transformers' default (full-size) config of every family, as a user's job would have."""
    return {name: type(F._config(name)[0])() for name in F.FAMILIES}


def test_tiny_config_keeps_the_family_and_its_attention_shape(full_configs: dict[str, object]) -> None:
    from merak_core.checks.tp_check_tiny import TINY_VOCAB, tiny_config, tiny_inputs

    for name, full in full_configs.items():
        tiny = tiny_config(full, tp=2)
        assert type(tiny) is type(full) and tiny.model_type == full.model_type  # type: ignore[attr-defined]
        assert tiny.num_attention_heads == 4 and tiny.vocab_size == TINY_VOCAB, name
        heads = full.num_attention_heads  # type: ignore[attr-defined]
        kv = getattr(full, "num_key_value_heads", None) or getattr(full, "num_kv_heads", None) or heads
        tiny_kv = getattr(tiny, "num_key_value_heads", None) or getattr(tiny, "num_kv_heads", None) or 4
        assert tiny_kv == (4 if kv == heads else 1 if kv == 1 else 2), (name, kv, tiny_kv)
        types = getattr(full, "layer_types", None)
        if types:  # every kind of layer the real config has, once at least
            assert set(tiny.layer_types) == set(types), name
        model = F._config(name)[1](tiny)
        assert sum(p.numel() for p in model.parameters()) < 100_000, name
        ids = torch.randint(3, 50_000, (4, 40))
        _, kwargs = tiny_inputs(((), {"input_ids": ids}), tiny)
        assert kwargs["input_ids"].shape == (2, 16) and int(kwargs["input_ids"].max()) < TINY_VOCAB
        model(**kwargs)


def test_the_tiny_config_is_chosen_for_a_large_or_unfitting_model(full_configs: dict[str, object]) -> None:
    import transformers as tf

    from merak_core.checks.tp_check_tiny import choose_check_model
    from merak_graph import empty_init

    with empty_init():
        big = tf.LlamaForCausalLM(full_configs["llama"])  # type: ignore[arg-type]
    assert choose_check_model(big, tp=2, tiny=None, available=2**50)[0]  # 6.7e9 parameters > --max-params
    assert not choose_check_model(big, tp=2, tiny=False)[0]  # --full
    small = F.build_family("llama")
    assert choose_check_model(small, tp=2, tiny=None, available=2**40) == (
        False,
        "LlamaForCausalLM has 24,736 parameters: checked whole",
    )
    use, why = choose_check_model(small, tp=2, tiny=None, available=1_000_000)
    assert use and "needs ~0.0 GiB, more than half of the 0.0 GiB available" in why
    assert choose_check_model(small, tp=2, tiny=True)[0]
    plain = nn.Sequential(nn.Linear(64, 64))
    with pytest.raises(ValueError, match="only a transformers model .* can be checked on a tiny config"):
        choose_check_model(plain, tp=2, tiny=None, max_params=100)


def test_tiny_check_passes_the_plan_and_flags_a_wrong_one(full_configs: dict[str, object]) -> None:
    """Phi-3 (fused q/k/v in unequal sections, fused gate/up) at its tiny config: exact with the built-in
    plan; gate/up split as one block (the silent-wrong plan) flagged module by module."""
    import transformers as tf

    import merak_tp
    from merak_core.checks.tp_check import check_plan_numerics
    from merak_core.checks.tp_check_tiny import tiny_builder, tiny_config, tiny_inputs

    tiny = tiny_config(full_configs["phi3"], tp=2)
    tiny.num_key_value_heads = 2  # grouped-query: unequal q/k/v sections
    inputs = tiny_inputs(((), {"input_ids": torch.randint(3, 30_000, (2, 24))}), tiny)
    build = tiny_builder(tf.Phi3ForCausalLM, tiny)
    rows = check_plan_numerics(build, inputs, tp=2)
    assert {r.name for r in rows} >= {"model.layers.1.mlp.gate_up_proj", "model.layers.0.self_attn.qkv_proj"}
    assert max(r.relative for r in rows) < 1e-12, rows
    wrong = merak_tp.get_plan("hf_phi3").with_options(
        sections={
            "*layers.*.self_attn.qkv_proj": merak_tp.get_plan("hf_phi3").sections[
                "*layers.*.self_attn.qkv_proj"
            ]
        }
    )
    rows = check_plan_numerics(build, inputs, plan=wrong, tp=2)
    flagged = [r.name for r in rows if r.relative > 1e-9]
    # The gathered gate/up output is right; the local gate * up pairs the wrong halves, so the first module
    # to differ is the down projection of layer 0, and everything after it.
    assert flagged[0] == "model.layers.0.mlp.down_proj", flagged
    assert {"model.layers.1.mlp.gate_up_proj", "model.layers.1.mlp.down_proj", "lm_head"} <= set(flagged)
    assert min(r.relative for r in rows if r.name in flagged) > 1e-3


EXAMPLE = str(Path(__file__).resolve().parents[2] / "examples" / "tp_families" / "job.yaml")
"""transformers' default (full-size) config of a family: Phi-3 mini, 3.8e9 parameters."""


def test_merak_check_of_a_full_size_job_checks_the_tiny_config(capsys: pytest.CaptureFixture[str]) -> None:
    from merak_core.cli import main

    assert main(["check", EXAMPLE, "model.kwargs={family: phi3}"]) == 0, capsys.readouterr()
    out = capsys.readouterr().out
    assert "Phi3ForCausalLM has 3,821,079,552 parameters" in out and "checking a tiny config" in out, out
    assert "tiny: hidden_size=32, num_hidden_layers=2, num_attention_heads=4" in out, out
    assert "model.layers.1.mlp.gate_up_proj" in out and "0 above the tolerance 1e-09" in out, out
    # The silent-wrong Phi-3 plan (gate/up as one block) fails the tiny check with exit 1.
    wrong = (
        "training.tp_plan={base: hf_phi3, sections: {'*layers.*.self_attn.qkv_proj': "
        "[num_attention_heads*head_dim, num_key_value_heads*head_dim, num_key_value_heads*head_dim]}}"
    )
    assert main(["check", EXAMPLE, "model.kwargs={family: phi3}", wrong, "--tiny"]) == 1
    flagged = [line.split()[0] for line in capsys.readouterr().out.splitlines() if line.endswith(" NO")]
    assert flagged[0] == "model.layers.0.mlp.down_proj", flagged


def test_merak_check_refuses_real_sizes_the_plan_cannot_split(capsys: pytest.CaptureFixture[str]) -> None:
    """What only the real config has (GPT-2's vocabulary of 50257) is refused on the meta model first."""
    from merak_core.cli import main

    assert main(["check", EXAMPLE, "model.kwargs={family: gpt2}"]) == 2
    assert "does not divide transformer.wte.num_embeddings=50257" in capsys.readouterr().err


def test_float32_inside_the_sharded_modules_sets_a_float32_tolerance() -> None:
    """OLMo 2's sharded q/k norms compute in float32 whatever the model's dtype: the check says so and
    accepts float32 rounding (1e-5) instead of flagging an exact plan; Llama stays at 1e-9."""
    from merak_core.checks.tp_check import (
        FLOAT32_TOLERANCE,
        FLOAT64_TOLERANCE,
        check_plan_numerics,
        default_tolerance,
        format_report,
    )

    inputs = (
        (),
        {"input_ids": torch.randint(3, F.VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))},
    )
    olmo = check_plan_numerics(lambda: F.build_family("olmo2"), inputs, tp=2)
    assert default_tolerance(olmo) == FLOAT32_TOLERANCE
    assert 1e-9 < max(r.relative for r in olmo) < 1e-5, olmo  # float32 rounding, not a wrong plan
    assert "0 above the tolerance 1e-05 (the model computes in float32 inside)" in format_report(olmo)
    llama = check_plan_numerics(lambda: F.build_family("llama"), inputs, tp=2)
    assert default_tolerance(llama) == FLOAT64_TOLERANCE and max(r.relative for r in llama) < 1e-12
