"""The copy of the job's model that ``layout: auto`` and ``merak plan`` profile, and one batch of real
training data for it: built (the job's adapters applied, the rest frozen), cast and placed as the run
will train it.

Not done here: profiling (:func:`merak_core.autoplan.auto.profile_for_plan`) or planning.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from merak_core.config import TrainingArguments
from merak_core.run.bootstrap import first_samples

__all__ = ["cast_floats", "job_model_and_batch", "profile_inputs", "with_adapters"]


def profile_inputs(
    model: nn.Module, dataset: Any, num_samples: int, data_collator: Callable[[list[Any]], Any] | None = None
) -> Any:
    """One batch of ``num_samples`` training samples as ``profile_model`` takes it (a tensor or keyword dict)."""
    from merak_core.data.loader import split_inputs_labels

    collate = data_collator or torch.utils.data.default_collate
    samples = first_samples(dataset, num_samples)
    if not samples:
        raise ValueError(
            "layout='auto' profiles the model on training samples, but the training set is empty"
        )
    inputs, _ = split_inputs_labels(collate(samples))
    params = list(inspect.signature(model.forward).parameters)
    if isinstance(
        inputs, Mapping
    ):  # by keyword when the keys are forward's parameters, else in order (as traced)
        if all(k in params for k in inputs):
            return dict(inputs)
        inputs = list(inputs.values())
    if isinstance(inputs, (tuple, list)):
        if len(inputs) == 1:
            return inputs[0]
        return dict(zip(params, inputs, strict=False))
    return inputs


def job_model_and_batch(
    args: TrainingArguments,
    model: nn.Module | Callable[[], nn.Module],
    dataset: Any,
    data_collator: Any,
    device: torch.device,
    lora: Any = None,
) -> tuple[nn.Module, Any]:
    """A copy of the job's model on ``device`` (with ``lora``: its adapters, the rest frozen) and one
    microbatch of real training data for it."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(args.seed)
        if isinstance(model, nn.Module):
            if any(p.is_meta for p in model.parameters()):
                raise ValueError(
                    "layout='auto' profiles the model, but it was built on the meta device "
                    "(empty_init): build it normally, or plan with `merak plan` and set dp/tp/pp"
                )
            copy_ = copy.deepcopy(model)
        else:
            copy_ = model()
        copy_ = copy_.to(device=device, dtype=args.torch_dtype)
        if lora is not None:
            with_adapters(copy_, lora, seed=args.seed)
        batch = profile_inputs(copy_, dataset, max(2, args.per_device_train_batch_size), data_collator)

    return copy_, cast_floats(batch, args.torch_dtype, device)


def with_adapters(model: nn.Module, lora: Any, *, seed: int = 0) -> nn.Module:
    """``model`` (unsharded, in place) with ``lora``'s adapters at their first values and every other
    parameter frozen, as the run trains it: the profile then counts the frozen weights as weights only
    ([Note: frozen weights] in :mod:`merak_core.planner.memory`)."""
    from merak_core.lora.apply import apply_lora, logical_name
    from merak_core.lora.init import initialise_adapters

    apply_lora(model, lora)
    initialise_adapters(
        ((logical_name(n), p) for n, p in model.named_parameters()), tp=1, tp_rank=0, seed=seed
    )
    return model


def cast_floats(batch: Any, dtype: torch.dtype, device: torch.device | str | None = None) -> Any:
    """A profiling batch (a tensor or a dict of them) with its floating tensors in the run's ``dtype``."""

    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(device=device, dtype=dtype) if t.is_floating_point() else t.to(device)

    return {k: cast(v) for k, v in batch.items()} if isinstance(batch, Mapping) else cast(batch)
